"""What one decode of n tokens costs on a demo pair's target and draft: the shape the `auto` policy prices
(README, "Measured: `auto` by default, and the wide demo target").

    python tests/verify_cost.py [wide|f16|q4_1] [--threads 2] [--repeats 3]

After a 64-token prompt, times one decode of n tokens with logits for every row (a verification batch), keeps
the fastest of `--repeats`, and cuts the cache back after each; prints milliseconds and the ratio to one token.
"""

from __future__ import annotations

import argparse
from time import perf_counter

from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.pairs.demo import demo_pair

SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("demo", nargs="?", default="wide", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    draft, target = demo_pair() if a.demo == "q4_1" else demo_pair(precision=a.demo)
    for role, path in (("target", target), ("draft", draft)):
        m = Model(ModelOptions(path=str(path), n_ctx=512, n_threads=a.threads), role)
        try:
            m.decode(list(range(100, 164)), logits="none")
            base = len(m.tokens)
            ms = {}
            for n in SIZES:
                best = float("inf")
                for _ in range(a.repeats):
                    t = perf_counter()
                    m.decode(list(range(200, 200 + n)), "from:0")
                    m.synchronize()
                    best = min(best, perf_counter() - t)
                    m.truncate(base)
                ms[n] = 1000 * best
            print(f"{a.demo} {role}: " + "  ".join(f"n={n} {v:.0f} ms ({v / ms[1]:.2f}x)" for n, v in ms.items()))
        finally:
            m.close()


if __name__ == "__main__":
    main()
