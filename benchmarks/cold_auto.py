"""`auto` from a cold start (issues 26 and 37): what a user's engine does, against `ar` and fixed draft lengths.

    python benchmarks/cold_auto.py --demo wide [--rules sd,fsd] [--ks 1-16] [--tokens 64] [--prompts 6]
                                   [--repeats 2] [--store disk|empty|warm] [--sampling greedy|chat] [--conversation]

--store says what each configuration's engine knows of the machine's costs (drafting/calibration.py):
- `disk` (the default): every configuration (ar, each fixed k, auto) gets its own newly loaded Engine in this
  process, all reading and writing the one on-disk store (what earlier use left), and all reply to the same
  prompts in turn, interleaved: for each prompt the configurations run in a shuffled order, so the machine's drift
  hits all of them alike.
- `empty`: each repeat runs in a fresh process where `auto`'s engine has an EMPTY cost store of its own
  (FSD_LOCAL_COSTS names a new file: a new install, or a new model file); `ar` and the fixed k, which price
  nothing, run beside it on engines of their own, interleaved per prompt as above, so every ratio is taken within
  one process (processes of the same configuration differ by several percent here).
- `warm`: as `empty`, but an untimed process of `auto` first replies to the same prompts with the same store, so
  the timed `auto` starts from the costs that use left (a user's second session).
--sampling chat: chat's sampling defaults (settings.py CHAT_DEFAULTS), a seed per reply; default greedy.
--conversation: the prompts are the turns of one chat (each reply stays in the history) instead of separate chats.

A configuration's figures are its session's tokens/s (all its replies) and its first reply's. No engine keeps
acceptance evidence from another. Prints one row per configuration (medians over repeats), then per rule auto over
the best of the others (fsd: the best fixed k; sd: the best of ar and fixed k) and over ar, for the session and the
first reply, each ratio taken within a repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "fsd_local" / "data" / "prompts-chat.jsonl"
RULES = {"sd": {"mode": "sd"}, "fsd": {"mode": "fsd", "divergence": "js", "tau": 0.2}}


def rule_settings(rule: str) -> dict:
    """sd; fsd (js tau 0.2); fsd@T (js tau T); budget@B (fsd under a quality budget of B nats per token)."""
    name, _, value = rule.partition("@")
    if name == "fsd" and value:
        return {"mode": "fsd", "divergence": "js", "tau": float(value)}
    if name == "budget":
        return {"mode": "fsd", "divergence": "js", "quality_budget": float(value)}
    return RULES[rule]


def configs(rule: str, ks: list[int]) -> dict[str, dict]:
    out = {"ar": {"mode": "ar"}}
    out.update({f"k={k}": {**rule_settings(rule), "draft_policy": "fixed", "draft_max": k} for k in ks})
    out["auto"] = {**rule_settings(rule), "draft_policy": "auto"}
    return out


def _sampling(kind: str, reply: int) -> dict:
    if kind == "greedy":
        return {"temperature": 0.0}
    from fsd_local.settings import CHAT_DEFAULTS

    return {**CHAT_DEFAULTS, "seed": reply}


def _reply(engine, history: list, text: str, cfg: dict, tokens: int, sampling: dict, conversation: bool) -> tuple:
    """One reply; in a conversation the history grows by the message and the reply."""
    messages = [*history, {"role": "user", "content": text}] if conversation else [{"role": "user", "content": text}]
    out = engine.chat(messages, max_tokens=tokens, **cfg, **sampling)
    if conversation:
        history[:] = [*messages, {"role": "assistant", "content": out.text}]
    st = out.stats
    return st["tokens"], st["seconds_total"], st["k_histogram"], st.get("loss_per_token"), st["seconds"], st["probed"]


def _summary(replies: list) -> dict:
    """A session's figures: tokens/s over all replies and the first's, the k histogram, the mean loss per token,
    the seconds in the draft model, the target and the loop's own (`other`), and the positions probes scored."""
    losses = [r[3] for r in replies if r[3] is not None]
    return {
        "tok_s": sum(r[0] for r in replies) / sum(r[1] for r in replies),
        "first_tok_s": replies[0][0] / replies[0][1],
        "k_histogram": [sum(r[2][k] if k < len(r[2]) else 0 for r in replies) for k in range(17)],
        "loss": sum(losses) / len(losses) if losses else None,
        "seconds": {part: sum(r[4][part] for r in replies) for part in ("draft", "target", "other")},
        "probed": sum(r[5] for r in replies),
    }


def in_process(target, draft, prompts, cfgs: dict[str, dict], a, seed: int, auto_store: str | None = None) -> dict:
    """Every configuration on its own fresh engine in this process, interleaved per prompt. auto_store: the cost
    store `auto`'s engine reads and writes (the others use none: plain decoding and a fixed k price nothing);
    None: every engine uses the on-disk store (--store disk)."""
    from fsd_local.engine import Engine

    engines = {}
    for name in cfgs:
        if auto_store is not None:  # read when the engine loads (drafting/calibration.py CostStore.for_engine)
            os.environ["FSD_LOCAL_COSTS"] = auto_store if name == "auto" else "off"
        engines[name] = Engine(target=str(target), draft=str(draft), n_threads=a.threads, n_ctx=2048)
    replies: dict[str, list] = {name: [] for name in cfgs}
    histories: dict[str, list] = {name: [] for name in cfgs}
    try:
        for pi, p in enumerate(prompts):
            names = list(cfgs)
            random.Random(seed * 1000 + pi).shuffle(names)
            for name in names:
                r = _reply(engines[name], histories[name], p, cfgs[name], a.tokens, _sampling(a.sampling, pi), a.conv)
                replies[name].append(r)
    finally:
        for e in engines.values():
            e.close()
    return {name: _summary(r) for name, r in replies.items()}


def fresh_process(rule: str, a, seed: int) -> dict:
    """--store empty / warm: one repeat in a fresh process, `auto` on a fresh engine with a cost store of its own
    (empty, or primed by an untimed process of `auto` replying to the same prompts), the others beside it."""
    store = os.path.join(tempfile.mkdtemp(prefix="fsd-costs-"), "costs.json")
    child = [sys.executable, __file__, *sys.argv[1:], "--child", json.dumps([rule, seed, store])]
    if a.store == "warm":
        subprocess.run([*child, "--prime"], check=True, stdout=subprocess.DEVNULL)
    done = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(target, draft, prompts, a) -> dict:
    """What a --store empty / warm child does: one repeat (in_process), or with --prime, `auto` alone."""
    rule, seed, store = json.loads(a.child)
    cfgs = configs(rule, ks(a.ks) if a.ks else [])
    if a.prime:
        cfgs = {"auto": cfgs["auto"]}
    return in_process(target, draft, prompts, cfgs, a, seed, auto_store=store)


def ks(text: str) -> list[int]:
    """'1-16' -> 1..16; '1,2,4-6' -> [1, 2, 4, 5, 6]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def report(rule: str, cfgs: dict, reps: list[dict]) -> dict:
    others = [n for n in cfgs if n != "auto" and (rule == "sd" or n != "ar")] or ["ar"]
    rows = {n: {k: median(r[n][k] for r in reps) for k in ("tok_s", "first_tok_s")} for n in cfgs}
    best = max(others, key=lambda n: rows[n]["tok_s"])
    ratio = median(r["auto"]["tok_s"] / r[best]["tok_s"] for r in reps)
    first = median(r["auto"]["first_tok_s"] / r[best]["first_tok_s"] for r in reps)
    over_ar = median(r["auto"]["tok_s"] / r["ar"]["tok_s"] for r in reps)
    for name, row in rows.items():
        r0 = reps[0][name]
        hist, loss, sec = r0["k_histogram"], r0["loss"], r0["seconds"]
        lo = f"  loss {loss:.3f}" if loss is not None else ""
        parts = (
            f"  s draft {sec['draft']:.2f} target {sec['target']:.2f} other {sec['other']:.2f} probed {r0['probed']}"
        )
        print(f"{rule:4s} {name:6s} {row['tok_s']:7.2f} tok/s  first {row['first_tok_s']:7.2f}  k {hist}{lo}{parts}")
    each = ", ".join(f"{r['auto']['tok_s'] / r[best]['tok_s']:.3f}" for r in reps)
    print(
        f"{rule}: best {best}; auto {ratio:.3f}x its tokens/s (repeats: {each}), first reply {first:.3f}x its "
        f"first; auto {over_ar:.3f}x ar",
        flush=True,
    )
    return {
        "rows": rows,
        "best": best,
        "auto_over_best": ratio,
        "first_over_best_first": first,
        "auto_over_ar": over_ar,
    }


def _repeat_line(rule: str, r: int, rep: dict) -> str:
    """One repeat's tokens/s per configuration, and auto's k histogram, seconds and positions probed."""
    auto = rep["auto"]
    sec = " ".join(f"{part} {v:.2f}" for part, v in auto["seconds"].items())
    rates = ", ".join(f"{n} {v['tok_s']:.2f}" for n, v in rep.items())
    return f"{rule} repeat {r}: {rates} tok/s; auto k {auto['k_histogram']} s {sec} probed {auto['probed']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="wide", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--target", help="a target GGUF instead of a demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--rules", default="sd,fsd", help="sd, fsd (js 0.2), fsd@TAU, budget@B [default: sd,fsd]")
    ap.add_argument("--ks", default="1-16", help="fixed draft lengths, e.g. 1-16, 4 or 1-6,8,12,16 ('' : none)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--store", default="disk", choices=("disk", "empty", "warm"))
    ap.add_argument("--sampling", default="greedy", choices=("greedy", "chat"))
    ap.add_argument("--conversation", dest="conv", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a --store empty/warm repeat: [rule, seed, store]
    ap.add_argument("--prime", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.pairs.demo import demo_pair

    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    prompts = [p.text for p in load_prompts(str(CHAT_PROMPTS))[: a.prompts]]
    if a.child:
        print(json.dumps(child(target, draft, prompts, a)))
        return
    results = {}
    for rule in a.rules.split(","):
        cfgs = configs(rule, ks(a.ks) if a.ks else [])
        if a.store == "disk":
            reps = [in_process(target, draft, prompts, cfgs, a, r) for r in range(a.repeats)]
        else:
            reps = []
            for r in range(a.repeats):  # each repeat said as it ends: a run cut short still tells what it measured
                reps.append(fresh_process(rule, a, r))
                print(_repeat_line(rule, r, reps[-1]), flush=True)
        results[rule] = report(rule, cfgs, reps)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
