"""The offline oracle of `fsd-local bench`: the tokens/s the best fixed draft length would have reached with a
configuration's own acceptance by position and the bench's measured costs: what `auto` is judged against."""

from __future__ import annotations

from fsd_local.drafting.cost_model import VerifyCost


def verify_curve(all_runs, n_hi: int) -> list[float] | None:
    """Seconds per target batch of n = 0..n_hi from every run's `verify_by_batch` (None: nothing measured)."""
    counts: dict[int, list[float]] = {}
    for runs in all_runs:
        for run in runs:
            for n, c, t in run.stats.get("verify_by_batch", []):
                acc = counts.setdefault(int(n), [0.0, 0.0])
                acc[0] += c
                acc[1] += t
    if not counts:
        return None
    vc = VerifyCost(max(max(counts), n_hi))
    for n, (c, t) in sorted(counts.items()):
        if c > 0:
            vc.observe(n, t / c)
    return vc.curve(n_hi)


def position_totals(runs) -> tuple[list[int], list[int]]:
    """Tokens drafted and accepted at each draft position, summed over runs."""
    drafted: list[int] = []
    accepted: list[int] = []
    for run in runs:
        for i, (d, a) in enumerate(zip(run.stats["drafted_by_position"], run.stats["accepted_by_position"])):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    return drafted, accepted


def oracle(runs, curve: list[float] | None) -> dict | None:
    """{"k", "tokens_per_second", "by_k"} of the best fixed k for one configuration's runs, or None when it
    drafted nothing or no costs were measured."""
    drafted, accepted = position_totals(runs)
    n_drafted = sum(run.stats["drafted"] for run in runs)
    if not n_drafted or curve is None:
        return None
    rounds = sum(run.stats["rounds"] for run in runs)
    draft_s = sum(run.stats["seconds"]["draft"] for run in runs) / n_drafted
    other_s = sum(run.stats["seconds"]["other"] for run in runs) / max(1, rounds)
    k_hi = min(len(curve) - 2, max((i + 1 for i, d in enumerate(drafted) if d), default=0))
    by_k = [1.0 / (curve[1] + other_s)]
    expected = 1.0
    for k in range(1, k_hi + 1):
        expected += accepted[k - 1] / drafted[k - 1] if drafted[k - 1] else 0.0
        by_k.append(expected / (k * draft_s + curve[k + 1] + other_s))
    best = max(range(len(by_k)), key=lambda k: by_k[k])
    return {"k": best, "tokens_per_second": by_k[best], "by_k": by_k}
