"""`fsd-local bench --kernels`: the Numba divergence kernels against vectorised float32 NumPy, both doing each row's
log-sum-exp then the divergence on the same rows; each cell is a median of timings alternating the two."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from fsd_local.errors import ConfigError
from fsd_local.kernels.divergence import DIVERGENCES, TOPK_DEFAULT, divergence
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.rows import row_lse

VOCABS = (32000, 49152, 151936, 262144)
ROWS = (1, 2, 4, 8)
MIN_SECONDS = 0.004  # one timing repeats the call until it lasts about this long: perf_counter noise stays small


@jit
def numba_rows(kind, x, y, n, topk, out):
    """The engine's path (accept.py): row_lse of both rows, then the divergence, row by row."""
    for r in range(x.shape[0]):
        out[r] = divergence(kind, x[r], row_lse(x[r], n), y[r], row_lse(y[r], n), n, topk)
    return out


def _lse(x):
    m = x.max(axis=1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def _topk(kind, x, lx, y, ly, k):
    """k target-top tokens plus one bin of remaining mass per distribution (k+1 bins, not renormalised)."""
    n = x.shape[1]
    k = min(k, n)
    idx = np.argpartition(x, n - k, axis=1)[:, n - k :]
    p = np.exp(np.take_along_axis(x, idx, axis=1).astype(np.float64) - lx)
    q = np.exp(np.take_along_axis(y, idx, axis=1).astype(np.float64) - ly)
    p = np.concatenate([p, np.maximum(0.0, 1.0 - p.sum(axis=1, keepdims=True))], axis=1)
    q = np.concatenate([q, np.maximum(0.0, 1.0 - q.sum(axis=1, keepdims=True))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "topk-tv":
            return 0.5 * np.abs(p - q).sum(axis=1)
        if kind == "topk-kl":
            return np.where(p > 0, p * np.log(p / q), 0.0).sum(axis=1)
        m = 0.5 * (p + q)
        return 0.5 * (np.where(p > 0, p * np.log(p / m), 0.0) + np.where(q > 0, q * np.log(q / m), 0.0)).sum(axis=1)


def numpy_rows(kind: str, x, y, topk: int = TOPK_DEFAULT):
    """The same divergences as the kernels, vectorised over rows, float32 (docs/design.md, "The benchmarks")."""
    lx, ly = _lse(x), _lse(y)
    if kind.startswith("topk-"):
        return _topk(kind, x, lx, y, ly, topk)
    lp = x - lx
    lq = y - ly
    if kind == "kl":
        return (np.exp(lp) * (lp - lq)).sum(axis=1)
    if kind == "rkl":
        return (np.exp(lq) * (lq - lp)).sum(axis=1)
    p, q = np.exp(lp), np.exp(lq)
    if kind == "tv":
        return 0.5 * np.abs(p - q).sum(axis=1)
    m = 0.5 * (p + q)
    lm = np.log(m)
    if kind == "js":
        return 0.5 * ((p * (lp - lm)).sum(axis=1) + (q * (lq - lm)).sum(axis=1))
    if kind == "paper-js":
        return 0.5 * (m * ((lm - lp) + (lm - lq))).sum(axis=1)
    raise ConfigError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")


def logit_rows(vocab: int, rows: int, seed: int = 0):
    """Target/draft float32 logit rows shaped like SmolLM2's: a Gaussian bulk (sd 3), a sparse right tail (1% of
    the tokens, exponential, scale 2) and one leading token; the draft's row is the target's plus noise of sd 1.3."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 3.0, (rows, vocab))
    x += (rng.random((rows, vocab)) < 0.01) * rng.exponential(2.0, (rows, vocab))
    top = rng.integers(0, vocab, (rows, 1))
    np.put_along_axis(x, top, x.max(axis=1, keepdims=True) + rng.uniform(0, 3, (rows, 1)), axis=1)
    y = x + rng.normal(0.0, 1.3, (rows, vocab))
    return x.astype(np.float32), y.astype(np.float32)


def _time(fn, number):
    t = perf_counter()
    for _ in range(number):
        fn()
    return (perf_counter() - t) / number


def _number(fn):
    t = _time(fn, 1)
    return max(1, int(MIN_SECONDS / max(t, 1e-7)))


def bench_kernels(
    divergences=DIVERGENCES, vocabs=VOCABS, rows=ROWS, repeats: int = 7, topk: int = TOPK_DEFAULT, progress=None
) -> list[dict]:
    """One dict per (divergence, vocab, rows): numba_s and numpy_s (median seconds per job), ratio = numpy_s / numba_s,
    numba_ns_per_entry and numpy_ns_per_entry (over vocab * rows entries) and max_rel_diff between the results."""
    for d in divergences:
        if d not in DIVERGENCES:
            raise ConfigError(f"unknown divergence {d!r}; choose one of {', '.join(DIVERGENCES)}")
    if not vocabs or not rows or min(vocabs) < 2 or min(rows) < 1 or repeats < 1:
        raise ConfigError("--vocab values must be >= 2, --rows values >= 1, --repeats >= 1")
    out = []
    for vocab in vocabs:
        xs, ys = logit_rows(vocab, max(rows))
        for d in divergences:
            kind = DIVERGENCES.index(d)
            for r in rows:
                x, y = xs[:r], ys[:r]
                buf = np.empty(r)
                ours = lambda: numba_rows(kind, x, y, vocab, topk, buf)  # noqa: E731
                theirs = lambda: numpy_rows(d, x, y, topk)  # noqa: E731
                a, b = ours().copy(), theirs()  # also compiles/loads the kernel before any timing
                n_ours, n_theirs = _number(ours), _number(theirs)
                t_ours: list[float] = []
                t_theirs: list[float] = []
                for rep in range(repeats):  # alternate who goes first: drifting load hits both alike
                    pair = [(t_ours, ours, n_ours), (t_theirs, theirs, n_theirs)]
                    for times, fn, number in pair if rep % 2 == 0 else pair[::-1]:
                        times.append(_time(fn, number))
                numba_s, numpy_s = float(np.median(t_ours)), float(np.median(t_theirs))
                out.append(
                    {
                        "divergence": d,
                        "vocab": vocab,
                        "rows": r,
                        "numba_s": numba_s,
                        "numpy_s": numpy_s,
                        "ratio": numpy_s / numba_s,
                        "numba_ns_per_entry": numba_s / (vocab * r) * 1e9,
                        "numpy_ns_per_entry": numpy_s / (vocab * r) * 1e9,
                        "max_rel_diff": float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6))),
                    }
                )
                if progress:
                    progress()
    out.sort(key=lambda e: (DIVERGENCES.index(e["divergence"]), e["vocab"], e["rows"]))
    return out


def format_table(results: list[dict]) -> str:
    lines = [
        f"{'divergence':>10}  {'vocab':>7}  {'rows':>4}  {'numba ms':>9}  {'numpy ms':>9}  {'ratio':>6}  "
        f"{'numba ns/entry':>14}  {'numpy ns/entry':>14}"
    ]
    prev = None
    for r in results:
        if prev is not None and r["divergence"] != prev:
            lines.append("")
        prev = r["divergence"]
        lines.append(
            f"{r['divergence']:>10}  {r['vocab']:>7}  {r['rows']:>4}  {r['numba_s'] * 1e3:>9.3f}  "
            f"{r['numpy_s'] * 1e3:>9.3f}  {r['ratio']:>6.2f}  {r['numba_ns_per_entry']:>14.2f}  "
            f"{r['numpy_ns_per_entry']:>14.2f}"
        )
    return "\n".join(lines)
