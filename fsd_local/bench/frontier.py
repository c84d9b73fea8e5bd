"""The speed / quality Pareto frontier of a benchmark: within each temperature, the configurations no other one beats
on both median tokens/s and a quality (target log-prob per token, loss per token, or greedy agreement at
temperature 0); a row without that quality is not on the frontier (null) and blocks nothing."""

from __future__ import annotations

SPEED = "tokens_per_second"
QUALITIES = (
    ("on_frontier", "target_logprob_mean"),
    ("on_frontier_agreement", "agreement"),
    ("on_frontier_loss", "loss_per_token"),
)
LOWER_IS_BETTER = frozenset({"loss_per_token"})  # quality = minus the loss the budget counts


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] >= b[0] and a[1] >= b[1] and (a[0] > b[0] or a[1] > b[1])


def frontier(points: list[tuple[float, float] | None]) -> list[bool | None]:
    """For each (speed, quality) point, whether no other point dominates it (None where the point is None)."""
    real = [p for p in points if p is not None]
    return [None if p is None else not any(dominates(q, p) for q in real) for p in points]


def mark_frontier(rows: list[dict]) -> list[dict]:
    """Adds `on_frontier` and `on_frontier_agreement` to every summary row (in place; returns rows)."""
    for flag, quality in QUALITIES:
        for temp in {r["temperature"] for r in rows}:
            at = [r for r in rows if r["temperature"] == temp]
            sign = -1.0 if quality in LOWER_IS_BETTER else 1.0
            points = [
                (r[SPEED], sign * r[quality]) if r.get(SPEED) is not None and r.get(quality) is not None else None
                for r in at
            ]
            for r, on in zip(at, frontier(points)):
                r[flag] = on
    return rows


def frontier_rows(rows: list[dict], temperature: float, quality: str = "target_logprob_mean") -> list[dict]:
    """The frontier at one temperature, fastest first (quality then rises along it)."""
    flag = dict((q, f) for f, q in QUALITIES)[quality]
    on = [r for r in rows if r["temperature"] == temperature and r.get(flag)]
    sign = -1.0 if quality in LOWER_IS_BETTER else 1.0
    return sorted(on, key=lambda r: (-r[SPEED], sign * r[quality]))
