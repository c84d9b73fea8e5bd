"""`fsd-local bench --costs`: seconds per decode of n tokens on the target and on the draft model (what `auto` prices),
each size decoded with a logit row per token `passes` times after the first prompt, the fastest kept and the cache
cut back after each, and its ratio to one token's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsd_local.drafting.calibration import time_sizes

if TYPE_CHECKING:
    from fsd_local.engine import Engine

SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)
PASSES = 3


def measure(engine: Engine, context: list[int], sizes=SIZES, passes: int = PASSES) -> list[dict]:
    """One dict per (model, batch size): model ("target" or "draft"), path, context (tokens in the cache before
    the batch), batch, ms, ratio (ms over one token's). Both caches are empty on return."""
    sizes = sorted({1, *sizes})
    rows = []
    for role, m in (("target", engine.target), ("draft", engine.draft)):
        if m is None:
            continue
        engine.reset()
        ids = context[: max(0, m.n_ctx - sizes[-1])]
        if ids:
            m.decode(ids, "none")
        token = m.bos if m.bos >= 0 else 0
        try:
            best = time_sizes(m, sizes, token, passes)
        finally:
            engine.reset()
        for n in sorted(best):
            rows.append(
                {
                    "model": role,
                    "path": m.path,
                    "context": len(ids),
                    "batch": n,
                    "ms": best[n] * 1e3,
                    "ratio": best[n] / best[1],
                }
            )
    return rows


def format_rows(rows: list[dict]) -> str:
    """A table: one line per batch size, the target's and the draft's ms and ratio side by side."""
    by = {(r["model"], r["batch"]): r for r in rows}
    models = [m for m in ("target", "draft") if any(r["model"] == m for r in rows)]
    head = "batch" + "".join(f"  {m + ' ms':>10}  {'x one':>6}" for m in models)
    lines = [head]
    for n in sorted({r["batch"] for r in rows}):
        cells = ""
        for m in models:
            r = by.get((m, n))
            cells += f"  {r['ms']:>10.2f}  {r['ratio']:>6.2f}" if r else f"  {'-':>10}  {'-':>6}"
        lines.append(f"{n:>5}{cells}")
    context = {r["model"]: r["context"] for r in rows}
    lines.append(
        "after " + ", ".join(f"{context[m]} tokens of context on the {m}" for m in models) + "; fastest of the passes"
    )
    return "\n".join(lines)
