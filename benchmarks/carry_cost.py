"""What carrying a draft's row onto the target's vocabulary costs (kernels/carry.py), against what a draft of the
target's own vocabulary does to its row anyway: copy it for the acceptance kernel (kernels/rows.py `copy_row`)
when a rule reads it, pick its argmax when none does.

    python benchmarks/carry_cost.py --draft SmolLM2-135M-Instruct.Q4_1.gguf --target gemma-3-270m-q4_k_m.gguf
    python benchmarks/carry_cost.py --draft-vocab 49152 --target-vocab 262144 --shared 0.94   # a random map

Each cell is the median of several timings of many calls on rows kept in the caches (a row just written by a
decode is colder; bench --overhead measures the loop as it runs). NumPy's fancy-index assignment of the same
scatter is printed beside it.
"""

from __future__ import annotations

import argparse
import sys
from time import perf_counter

import numpy as np

from fsd_local.kernels.carry import carried_argmax, carry_row, prepare
from fsd_local.kernels.rows import copy_row, max_argmax_wide
from fsd_local.llama.vocab_map import map_between, primary_of, split_map


def _median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        n = 50
        t = perf_counter()
        for _ in range(n):
            fn()
        times.append((perf_counter() - t) / n)
    return float(np.median(times)) * 1e6


def _random_map(n_draft: int, n_target: int, shared: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    target_of = np.full(n_draft, -1, np.int32)
    k = int(min(n_draft, n_target) * shared)
    target_of[rng.choice(n_draft, k, replace=False)] = rng.choice(n_target, k, replace=False)
    return target_of


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft")
    ap.add_argument("--target")
    ap.add_argument("--draft-vocab", type=int, default=49152)
    ap.add_argument("--target-vocab", type=int, default=262144)
    ap.add_argument("--shared", type=float, default=0.94)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--k", type=int, default=4, help="rows a round carries")
    a = ap.parse_args(argv)
    if a.draft and a.target:
        vm = map_between(a.draft, a.target)
        draft_of, extra, target_of = vm.draft_of, vm.extra, vm.target_of
        where = f"{a.draft} -> {a.target}"
    else:
        target_of = _random_map(a.draft_vocab, a.target_vocab, a.shared, 0)
        draft_of, extra = split_map(target_of, a.target_vocab)
        where = f"a random map, {a.shared:.0%} of the draft's tokens shared"
    n_draft, n_target = target_of.shape[0], draft_of.shape[0]
    shared_t = np.flatnonzero(draft_of >= 0).astype(np.int32)
    shared_d = draft_of[shared_t]
    primary = primary_of(target_of, draft_of)
    row = np.random.default_rng(1).normal(0, 3, n_draft).astype(np.float32)
    out = np.empty(n_target, np.float32)
    prepare(out)
    wide_row = np.random.default_rng(2).normal(0, 3, n_target).astype(np.float32)
    copy = np.empty(n_target, np.float32)
    cells = {
        "carry_row (scatter of the shared tokens)": lambda: carry_row(row, shared_t, shared_d, extra, out),
        "numpy out[t] = row[d]": lambda: out.__setitem__(shared_t, row[shared_d]),
        "carried_argmax (greedy, no row kept)": lambda: carried_argmax(row, primary, draft_of, extra),
        "one vocabulary: copy_row of the target-sized row": lambda: copy_row(wide_row, n_target, copy),
        "one vocabulary: argmax of the target-sized row": lambda: max_argmax_wide(wide_row, n_target),
    }
    print(f"{where}: draft {n_draft} tokens, target {n_target}, {shared_t.shape[0]} shared, {extra.shape[0]} extra")
    for name, fn in cells.items():
        us = _median_us(fn, a.repeats)
        print(f"{name:<52} {us:8.1f} us a row  {us * a.k:8.1f} us a round of {a.k}")


if __name__ == "__main__":
    sys.exit(main())
