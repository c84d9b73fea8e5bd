"""`auto` from a cold start (issue 26's goals): a freshly loaded engine per configuration, as a user gets it.

    python benchmarks/cold_auto.py --demo wide [--rules sd,fsd] [--ks 1-16] [--tokens 64] [--prompts 6]

For each rule (sd; fsd js tau 0.2), every configuration (ar, each fixed k, auto) loads a new Engine and replies
to the same chat prompts in turn (greedy): the session's tokens/s (all replies) and the first reply's. The engine
keeps no acceptance evidence between loads; the machine's measured costs are kept on disk (what any earlier use
leaves), and the fixed-k runs come first, so auto starts from a store that knows the batch sizes. Prints one
row per configuration and, per rule, auto over the best of the others: the session and the first reply.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsd_local.bench.prompts import load_prompts
from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "fsd_local" / "data" / "prompts-chat.jsonl"
RULES = {"sd": {"mode": "sd"}, "fsd": {"mode": "fsd", "divergence": "js", "tau": 0.2}}


def session(target, draft, prompts, settings: dict, tokens: int, threads: int) -> dict:
    """One fresh engine replying to each prompt in turn: tokens and seconds per reply."""
    replies = []
    with Engine(target=str(target), draft=str(draft), n_threads=threads, n_ctx=2048) as eng:
        for p in prompts:
            eng.reset()
            out = eng.chat([{"role": "user", "content": p.text}], max_tokens=tokens, **settings)
            st = out.stats
            replies.append({"tokens": st["tokens"], "seconds": st["seconds_total"], "k_histogram": st["k_histogram"]})
    total = sum(r["tokens"] for r in replies) / sum(r["seconds"] for r in replies)
    return {"tok_s": total, "first_tok_s": replies[0]["tokens"] / replies[0]["seconds"], "replies": replies}


def ks(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="wide", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--target", help="a target GGUF instead of a demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--rules", default="sd,fsd")
    ap.add_argument("--ks", default="1-16", help="fixed draft lengths, e.g. 1-16 or 4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    prompts = load_prompts(str(CHAT_PROMPTS))[: a.prompts]
    results = {}
    for rule in a.rules.split(","):
        rows = {"ar": session(target, draft, prompts, {"mode": "ar"}, a.tokens, a.threads)}
        for k in ks(a.ks):
            fixed = {**RULES[rule], "draft_policy": "fixed", "draft_max": k}
            rows[f"k={k}"] = session(target, draft, prompts, fixed, a.tokens, a.threads)
        rows["auto"] = session(target, draft, prompts, {**RULES[rule], "draft_policy": "auto"}, a.tokens, a.threads)
        others = [n for n in rows if n != "auto" and (rule == "sd" or n != "ar")]
        best = max(others, key=lambda n: rows[n]["tok_s"])
        results[rule] = {
            "rows": rows,
            "best": best,
            "auto_over_best": rows["auto"]["tok_s"] / rows[best]["tok_s"],
            "auto_first_over_best_first": rows["auto"]["first_tok_s"] / rows[best]["first_tok_s"],
        }
        for name, r in rows.items():
            hist = [sum(x) for x in zip(*[_pad(rep["k_histogram"], 17) for rep in r["replies"]])]
            print(
                f"{rule:4s} {name:6s} {r['tok_s']:7.2f} tok/s  first reply {r['first_tok_s']:7.2f}  k {hist}",
                flush=True,
            )
        res = results[rule]
        print(
            f"{rule}: best {best} ({rows[best]['tok_s']:.2f}); auto {rows['auto']['tok_s']:.2f} = "
            f"{res['auto_over_best']:.3f}x; first reply {res['auto_first_over_best_first']:.3f}x the best's first",
            flush=True,
        )
    if a.json:
        print(json.dumps(results, indent=1))


def _pad(h: list[int], n: int) -> list[int]:
    return (h + [0] * n)[:n]


if __name__ == "__main__":
    main()
