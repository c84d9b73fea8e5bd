"""The offline oracle of `fsd-local bench`: the tokens per second the best fixed draft length would have reached
with a configuration's own measured acceptance and the bench's measured costs, to judge a policy (`auto`)
against the k nobody could have known in advance.

For a fixed k, a round drafts k tokens and emits 1 + (the accepted prefix) tokens, so its expected tokens are
E(k) = 1 + sum_{i <= k} P(position i accepted), and P(position i accepted) is what the bench already reports
as acceptance by position (accepted / drafted at i: with a fixed k every round reaches position i's test
only through an accepted prefix, so this is the unconditional survival). Its seconds are k x (the draft's
seconds per drafted token) + v(k + 1) + (the loop's own seconds per round), v(n) being the target's measured
seconds for a batch of n, pooled over every configuration of the bench (the target's cost does not depend on
the rule) and interpolated by the same `VerifyCost` the policy uses where a size was never decoded. Positions
no round of the configuration reached are not extrapolated: the oracle covers k up to the longest draft seen.
k = 0 is plain decoding at v(1).
"""

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
