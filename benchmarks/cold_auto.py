"""`auto` from a cold start (issue 26's goals): a freshly loaded engine per configuration, as a user gets it.

    python benchmarks/cold_auto.py --demo wide [--rules sd,fsd] [--ks 1-16] [--tokens 64] [--prompts 6] [--repeats 2]

For each rule (sd; fsd js tau 0.2) and repeat, every configuration (ar, each fixed k, auto) gets its own newly
loaded Engine, and all of them reply to the same chat prompts in turn (greedy), interleaved: for each prompt the
configurations run in a shuffled order, so the machine's drift hits all of them alike. A configuration's figures
are its session's tokens/s (all its replies) and its first reply's. No engine keeps acceptance evidence from
another; the machine's measured costs are kept on disk (what any earlier use leaves: drafting/calibration.py).
Prints one row per configuration (medians over repeats) and per rule auto over the best of the others, for the
session and the first reply, each ratio taken within a repeat.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from statistics import median

from fsd_local.bench.prompts import load_prompts
from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "fsd_local" / "data" / "prompts-chat.jsonl"
RULES = {"sd": {"mode": "sd"}, "fsd": {"mode": "fsd", "divergence": "js", "tau": 0.2}}


def configs(rule: str, ks: list[int]) -> dict[str, dict]:
    out = {"ar": {"mode": "ar"}}
    out.update({f"k={k}": {**RULES[rule], "draft_policy": "fixed", "draft_max": k} for k in ks})
    out["auto"] = {**RULES[rule], "draft_policy": "auto"}
    return out


def one_repeat(target, draft, prompts, cfgs: dict[str, dict], tokens: int, threads: int, seed: int) -> dict:
    """Every configuration on its own fresh engine, the prompts in turn, interleaved: per configuration the
    tokens and seconds of each reply."""
    engines = {name: Engine(target=str(target), draft=str(draft), n_threads=threads, n_ctx=2048) for name in cfgs}
    replies: dict[str, list] = {name: [] for name in cfgs}
    try:
        for pi, p in enumerate(prompts):
            names = list(cfgs)
            random.Random(seed * 1000 + pi).shuffle(names)
            for name in names:
                out = engines[name].chat([{"role": "user", "content": p.text}], max_tokens=tokens, **cfgs[name])
                st = out.stats
                replies[name].append((st["tokens"], st["seconds_total"], st["k_histogram"]))
    finally:
        for e in engines.values():
            e.close()
    return {
        name: {
            "tok_s": sum(t for t, _, _ in r) / sum(s for _, s, _ in r),
            "first_tok_s": r[0][0] / r[0][1],
            "k_histogram": [sum(h[k] if k < len(h) else 0 for _, _, h in r) for k in range(17)],
        }
        for name, r in replies.items()
    }


def ks(text: str) -> list[int]:
    """'1-16' -> 1..16; '1,2,4-6' -> [1, 2, 4, 5, 6]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="wide", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--target", help="a target GGUF instead of a demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--rules", default="sd,fsd")
    ap.add_argument("--ks", default="1-16", help="fixed draft lengths, e.g. 1-16, 4 or 1-6,8,12,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    prompts = load_prompts(str(CHAT_PROMPTS))[: a.prompts]
    results = {}
    for rule in a.rules.split(","):
        cfgs = configs(rule, ks(a.ks))
        reps = [one_repeat(target, draft, prompts, cfgs, a.tokens, a.threads, r) for r in range(a.repeats)]
        others = [n for n in cfgs if n != "auto" and (rule == "sd" or n != "ar")]
        rows = {n: {k: median(r[n][k] for r in reps) for k in ("tok_s", "first_tok_s")} for n in cfgs}
        best = max(others, key=lambda n: rows[n]["tok_s"])
        ratio = median(r["auto"]["tok_s"] / r[best]["tok_s"] for r in reps)
        first = median(r["auto"]["first_tok_s"] / r[best]["first_tok_s"] for r in reps)
        results[rule] = {"rows": rows, "best": best, "auto_over_best": ratio, "first_over_best_first": first}
        for name, row in rows.items():
            hist = reps[0][name]["k_histogram"]
            line = f"{rule:4s} {name:6s} {row['tok_s']:7.2f} tok/s  first {row['first_tok_s']:7.2f}  k {hist}"
            print(line, flush=True)
        print(f"{rule}: best {best}; auto {ratio:.3f}x its tokens/s, first reply {first:.3f}x its first", flush=True)
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
