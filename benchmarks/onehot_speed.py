"""The one-hot divergences (kernels/onehot.py: a prompt-lookup draft scored in O(1) from the target's row) against
the general kernel on the same one-hot row, per call, on a vocabulary-sized row (Gemma's 262,144 by default).

    python benchmarks/onehot_speed.py [--n 262144] [--repeats 20] [--topk 50]
"""

from __future__ import annotations

import argparse
from time import perf_counter

import numpy as np

from fsd_local.kernels import divergence as D
from fsd_local.kernels import onehot as O
from fsd_local.kernels.rows import row_lse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=262144, help="the row's length (the vocabulary)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--topk", type=int, default=50)
    a = ap.parse_args()
    x = (np.random.default_rng(14).standard_normal(a.n) * 3.0).astype(np.float32)
    d = 7  # the draft's token
    y = np.full(a.n, -np.inf, np.float32)  # the one-hot draft row: softmax exactly e_d
    y[d] = 0.0
    lx, ly = row_lse(x, a.n), row_lse(y, a.n)
    lines = []
    for name in ("js", "tv", "kl", "topk-js"):
        kind = D.divergence_id(name)
        O.divergence_onehot(kind, x, lx, d, a.n, a.topk)  # compiled or loaded before the clock starts
        D.divergence(kind, x, lx, y, ly, a.n, a.topk)
        t = perf_counter()
        for _ in range(a.repeats):
            O.divergence_onehot(kind, x, lx, d, a.n, a.topk)
        onehot = (perf_counter() - t) / a.repeats
        t = perf_counter()
        for _ in range(a.repeats):
            D.divergence(kind, x, lx, y, ly, a.n, a.topk)
        general = (perf_counter() - t) / a.repeats
        lines.append(f"{name} {onehot * 1e6:.1f} us vs general {general * 1e6:.0f} us")
    print(f"one-hot divergences, n={a.n}, mean of {a.repeats}: " + "; ".join(lines))


if __name__ == "__main__":
    main()
