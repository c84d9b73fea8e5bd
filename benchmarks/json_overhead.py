"""What a JSON-schema constraint costs per token (a script, not a unit test): the same chat prompts with and
without `json_schema`, interleaved, for ar, sd and fsd, on the demo pair.

    python benchmarks/json_overhead.py [--precision f16] [--repeats 2] [--max-tokens 160] [--threads 2] [--tau 0.3]
        [--no-jump-forward]

Time per token is the engine's generation time (after the prompt) over its output tokens, summed over the
prompts of each side. The two sides write different text (one is JSON), so their acceptance differs in the
speculative modes; `chain_ms_per_token` isolates the constraint's own work: the time spent in the chain's hooks
(masks from llguidance, applying them to the rows, advancing and rolling back the matcher), measured by timing
those methods in this script, `force` included (the forced tokens proposed under jump_forward, on unless
--no-jump-forward). The schema and prompts are jump_forward.py's profile (5 fields: an enum array, a nested
object, a boolean). The two sides of each prompt and mode run back to back, each first half the time, so a busy
neighbour slows both alike. Prints one JSON object per mode, then a table.
"""

from __future__ import annotations

import argparse
import json
import time

from jump_forward import PEOPLE, PROFILE, profile_message  # a sibling script: its profile schema and prompts

from fsd_local import Engine
from fsd_local.chain import Chain
from fsd_local.pairs.demo import demo_pair

HOOKS = ("draft_row", "target_rows", "push", "settle", "admit", "force")
spent = [0.0]


def _timed(name: str) -> None:
    inner = getattr(Chain, name)

    def wrapper(self, *args):
        t = time.perf_counter()
        try:
            return inner(self, *args)
        finally:
            spent[0] += time.perf_counter() - t

    setattr(Chain, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="f16", choices=("q4_1", "f16"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tau", type=float, default=0.3)
    ap.add_argument("--people", type=int, default=len(PEOPLE), help="the first N people to describe")
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    ap.add_argument("--no-jump-forward", dest="jump_forward", action="store_false")
    args = ap.parse_args()
    for name in HOOKS:
        _timed(name)
    modes = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), f"fsd {args.tau}": dict(mode="fsd", tau=args.tau)}
    jump = {"jump_forward": args.jump_forward}
    d, t = (args.draft, args.target) if args.target else demo_pair(precision=args.precision)
    totals = {(m, c): [0.0, 0, 0.0] for m in modes for c in (False, True)}  # seconds, tokens, chain seconds
    with Engine(target=str(t), draft=str(d), n_ctx=1024, n_threads=args.threads) as eng:
        eng.chat([{"role": "user", "content": "hi"}], max_tokens=4, json_schema=PROFILE)  # tokenizer and kernels
        for r in range(args.repeats):
            for i, who in enumerate(PEOPLE[: args.people]):
                msg = profile_message(who)
                for m in modes:
                    for c in (False, True) if (r + i) % 2 == 0 else (True, False):  # each side first half the time
                        spent[0] = 0.0
                        schema = PROFILE if c else None
                        out = eng.chat(msg, max_tokens=args.max_tokens, json_schema=schema, **modes[m], **jump)
                        tot = totals[(m, c)]
                        tot[0] += out.stats["seconds_total"]
                        tot[1] += out.stats["tokens"]
                        tot[2] += spent[0]
    rows = []
    for m in modes:
        (s0, n0, c0), (s1, n1, c1) = totals[(m, False)], totals[(m, True)]
        row = {
            "mode": m,
            "ms_per_token_free": 1000 * s0 / n0,
            "ms_per_token_json": 1000 * s1 / n1,
            "ratio": (s1 / n1) / (s0 / n0),
            "chain_ms_per_token_free": 1000 * c0 / n0,
            "chain_ms_per_token_json": 1000 * c1 / n1,
            "chain_share_json": c1 / s1,
            "tokens_free": n0,
            "tokens_json": n1,
        }
        rows.append(row)
        print(json.dumps(row))
    print(
        f"\n{'mode':<9} {'free ms/tok':>12} {'json ms/tok':>12} {'ratio':>6} {'chain ms/tok':>13} {'chain share':>12}"
    )
    for r in rows:
        print(
            f"{r['mode']:<9} {r['ms_per_token_free']:>12.2f} {r['ms_per_token_json']:>12.2f} {r['ratio']:>6.2f} "
            f"{r['chain_ms_per_token_json']:>13.3f} {r['chain_share_json']:>12.1%}"
        )


if __name__ == "__main__":
    main()
