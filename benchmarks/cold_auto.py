"""`auto` from a cold start (issues 26 and 37): what a user's engine does, against `ar` and fixed draft lengths.

    python benchmarks/cold_auto.py --demo wide [--rules sd,fsd] [--ks 1-16] [--tokens 64] [--prompts 6]
                                   [--repeats 2] [--store disk|empty|warm] [--sampling greedy|chat] [--conversation]

--store says what each configuration's engine knows of the machine's costs (drafting/calibration.py):
- `disk` (the default): every configuration (ar, each fixed k, auto) gets its own newly loaded Engine in this
  process, all reading and writing the one on-disk store (what earlier use left), and all reply to the same
  prompts in turn, interleaved: for each prompt the configurations run in a shuffled order, so the machine's drift
  hits all of them alike.
- `empty`: every configuration runs in a fresh process with an EMPTY store of its own (FSD_LOCAL_COSTS names a new
  file): a new install, or a new model file. Configurations run one after another, in a shuffled order per repeat.
- `warm`: as `empty`, but an untimed process of the same configuration first replies to the same prompts with the
  same store, so the timed process starts from the costs that use left (a user's second session).
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


def in_process(target, draft, prompts, cfgs: dict[str, dict], a, seed: int) -> dict:
    """--store disk: every configuration on its own fresh engine in this process, interleaved per prompt."""
    from fsd_local.engine import Engine

    engines = {name: Engine(target=str(target), draft=str(draft), n_threads=a.threads, n_ctx=2048) for name in cfgs}
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


def one_process(target, draft, prompts, cfg: dict, a) -> dict:
    """What the `--one` child does: load one engine, reply to every prompt in turn."""
    from fsd_local.engine import Engine

    with Engine(target=str(target), draft=str(draft), n_threads=a.threads, n_ctx=2048) as eng:
        history: list = []
        return _summary(
            [_reply(eng, history, p, cfg, a.tokens, _sampling(a.sampling, i), a.conv) for i, p in enumerate(prompts)]
        )


def fresh_processes(cfgs: dict[str, dict], a, seed: int) -> dict:
    """--store empty / warm: each configuration in its own process with its own store, in a shuffled order."""
    names = list(cfgs)
    random.Random(seed).shuffle(names)
    out = {}
    for name in names:
        store = os.path.join(tempfile.mkdtemp(prefix="fsd-costs-"), "costs.json")
        env = {**os.environ, "FSD_LOCAL_COSTS": store}
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", json.dumps(cfgs[name])]
        if a.store == "warm":
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        done = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


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
    print(
        f"{rule}: best {best}; auto {ratio:.3f}x its tokens/s, first reply {first:.3f}x its first; "
        f"auto {over_ar:.3f}x ar",
        flush=True,
    )
    return {
        "rows": rows,
        "best": best,
        "auto_over_best": ratio,
        "first_over_best_first": first,
        "auto_over_ar": over_ar,
    }


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
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child of --store empty/warm: one configuration's JSON
    a = ap.parse_args()
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.pairs.demo import demo_pair

    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    prompts = [p.text for p in load_prompts(str(CHAT_PROMPTS))[: a.prompts]]
    if a.one:
        print(json.dumps(one_process(target, draft, prompts, json.loads(a.one), a)))
        return
    results = {}
    for rule in a.rules.split(","):
        cfgs = configs(rule, ks(a.ks) if a.ks else [])
        if a.store == "disk":
            reps = [in_process(target, draft, prompts, cfgs, a, r) for r in range(a.repeats)]
        else:
            reps = [fresh_processes(cfgs, a, r) for r in range(a.repeats)]
        results[rule] = report(rule, cfgs, reps)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
