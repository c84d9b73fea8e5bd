"""One process of the kernel-cache tests (tests/test_kernel_cache.py), run with its own NUMBA_CACHE_DIR:
`python kernel_worker.py JOB DRAFT TARGET CROSS_DRAFT CROSS_TARGET` prints one JSON object: what the workload
computed, how many kernels it compiled and loaded (and whose entries it loaded), and the kernels it never reached.

JOB: `run` (the workload), `rows-first` (the benchmark's kernel on a long row before anything else, as
`fsd-local bench --kernels` does), `divergence` (only the divergence of two rows, as a generation's first kernels
are), `recompile` (the workload, then every kernel compiled again from its source while what it calls stays
loaded from the cache). CROSS_*: a pair of two tokenizers."""

from __future__ import annotations

import json
import sys

import numpy as np


def rows(vocab: int) -> list:
    from fsd_local.bench.kernels import logit_rows, numba_rows
    from fsd_local.kernels.divergence import DIVERGENCES

    x, y = logit_rows(vocab, 2)
    return [numba_rows(kind, x, y, vocab, 20, np.empty(2)).tolist() for kind in range(len(DIVERGENCES))]


def generations(draft: str, target: str, cross_draft: str, cross_target: str) -> list:
    """Token ids of generations in every acceptance path, and one drafted across tokenizers."""
    from fsd_local import Engine

    out = []
    fixed = {"n_ctx": 256, "n_threads": 1, "draft_policy": "fixed", "draft_max": 4}  # drafts whatever was measured
    with Engine(target=cross_target, draft=cross_draft, **fixed) as eng:
        for mode in ("fsd", "sd"):  # a greedy lossless round takes the carried row's argmax alone
            out.append(eng.generate("The cat sat", max_tokens=24, mode=mode, tau=0.3).token_ids)
    with Engine(target=target, draft=draft, **fixed) as eng:
        for settings in (
            {"mode": "fsd", "tau": 0.3},
            {"mode": "sd"},
            {"mode": "fsd", "tau": 0.4, "temperature": 0.8, "top_p": 0.9, "seed": 3},
            {"mode": "fsd", "quality_budget": 0.1},
            {"mode": "fsd", "tau": 0.3, "repeat_penalty": 1.2, "top_logprobs": 2},
        ):
            out.append(eng.generate("The cat sat", max_tokens=24, **settings).token_ids)
    return out


def main(job: str, draft: str, target: str, cross_draft: str, cross_target: str) -> None:
    from fsd_local.kernels.divergence import compute
    from fsd_local.kernels.jit_cache import KERNELS

    result: dict = {}
    if job == "divergence":
        x, y = np.linspace(-3, 3, 300, dtype=np.float32), np.linspace(3, -3, 300, dtype=np.float32)
        result["divergence"] = compute("js", x, y)
    else:
        if job == "rows-first":
            result["long_rows"] = rows(70000)
        from fsd_local.kernels.warm import warm_up

        warm_up()
        result["rows"] = rows(300)
        result["long_rows"] = rows(70000)
        result["tokens"] = generations(draft, target, cross_draft, cross_target)
        from fsd_local.kernels.rows import max_argmax_wide  # the benchmarks' own (benchmarks/carry_cost.py)

        result["argmax"] = [float(v) for v in max_argmax_wide(np.linspace(0, 1, 70000, dtype=np.float32), 70000)]
    if job == "recompile":
        done: set[int] = set()
        while todo := [k for k in reversed(KERNELS) if k.overloads and id(k) not in done]:
            for kernel in todo:  # callers first: what each calls is still the cache's when it compiles
                kernel.recompile()
                done.add(id(kernel))
    result["compiled"] = sum(sum(k._cache_misses.values()) for k in KERNELS)
    result["loaded"] = sum(sum(k._cache_hits.values()) for k in KERNELS)
    result["loaded_files"] = sorted(k._cache._impl.filename_base for k in KERNELS if k._cache_hits)
    result["unreached"] = sorted(k.py_func.__qualname__ for k in KERNELS if not k.overloads)
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:6])
