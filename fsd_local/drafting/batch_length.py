"""The draft length of every sequence in a batch, priced for the batch: the ks with the most expected tokens per
second of rate(k_1..k_S) = sum_i E_i(k_i) / (sum_j d(m_j) + v(S + sum_i k_i) + sum_i c_i [k_i > 0])
(docs/design.md, "Draft lengths for a batch": the terms, and why the search finds the best)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fsd_local.drafting.cost_model import CostModel, VerifyCost


@dataclass(frozen=True)
class BatchPlan:
    ks: list[int]  # each sequence's draft length this round (0: a plain step)
    rate: float  # expected tokens per second of the round
    plain_rate: float  # the same round with every k = 0
    tokens: float  # expected tokens the round emits
    seconds: float  # its expected price


def plan_batch(
    acceptance: Sequence[Sequence[float]],
    limits: Sequence[int],
    verify: Sequence[float],
    draft: Sequence[float],
    *,
    free: Sequence[bool] | None = None,
    start: Sequence[float] | None = None,
    fixed: Sequence[bool] | None = None,
    round_seconds: float = 0.0,
) -> BatchPlan:
    """The ks with the highest expected tokens per second. acceptance[i]: sequence i's a_1..; limits[i]: its most
    drafts; verify[n] / draft[m]: seconds of a decode of n target / m draft rows (index 0 unused); free[i]: it drafts
    without the draft model; start[i]: what drafting at all costs it; fixed[i]: it drafts exactly limits[i]."""
    n = len(acceptance)
    if len(limits) != n:
        raise ValueError(f"{n} sequences' acceptance, {len(limits)} limits")
    price = _Price(acceptance, limits, verify, draft, free, start, fixed, round_seconds)
    # the order by survival cannot see that a free drafter's drafts cost less, nor that a sequence that must catch
    # up may be worth leaving out: search those subsets too
    subsets = [np.ones(len(price.s), bool)]
    if price.free.any() and not price.free.all():
        subsets.append(price.free[price.i])
    waiting = np.flatnonzero(price.start)
    if len(waiting):
        ready = price.start[price.i] == 0.0
        subsets.append(ready)
        if len(waiting) > 1:  # each waiting sequence alone, and all but each
            subsets += [keep for w in waiting for keep in (ready | (price.i == w), price.i != w)]
    searched = {tuple(_search(price, keep)) for keep in subsets} | {tuple(price.base)}
    ks = max((_improve(list(ks), price) for ks in searched), key=price.rate)
    tokens, seconds = price(ks)
    return BatchPlan(ks, tokens / seconds, price.rate([0] * n), tokens, seconds)


class _Price:
    """The drafts as arrays in falling survival (s, position - 1 j, sequence i) and the price of given ks."""

    def __init__(self, acceptance, limits, verify, draft, free, start, fixed, round_seconds):
        n = len(acceptance)
        self.n, self.round_seconds = n, round_seconds
        self.limits = [max(0, min(k, len(a))) for k, a in zip(limits, acceptance)]
        self.fixed = np.zeros(n, bool) if fixed is None else np.asarray(fixed, bool)
        self.base = [k if f else 0 for k, f in zip(self.limits, self.fixed.tolist())]  # the ks no plan changes
        self.free = np.zeros(n, bool) if free is None else np.asarray(free, bool)
        self.start = np.zeros(n) if start is None else np.asarray(start, float)
        self.verify, self.draft = np.asarray(verify, float), np.asarray(draft, float)
        if len(self.verify) <= n + sum(self.limits) or len(self.draft) <= n - int(self.free.sum()):
            raise ValueError(
                f"cost curves too short: {n + sum(self.limits)} target rows and "
                f"{n - int(self.free.sum())} draft rows possible"
            )
        surv = [np.cumprod(np.clip(np.asarray(a[:k], float), 0.0, 1.0)) for a, k in zip(acceptance, self.limits)]
        # Python lists for the local search's scalar reads (a NumPy scalar read costs several times more)
        self.gain = [[1.0, *(1.0 + np.cumsum(s)).tolist()] for s in surv]  # E_i(k)
        self.v, self.d = self.verify.tolist(), self.draft.tolist()
        self.model_at = [not f for f in self.free.tolist()]
        self.start_at = self.start.tolist()
        s = np.concatenate([*surv, np.zeros(0)])
        j = np.concatenate([np.arange(len(x)) for x in surv] + [np.zeros(0, int)]).astype(int)
        i = np.repeat(np.arange(n), [len(x) for x in surv])
        order = np.lexsort((j, -s))  # the larger survival first; on ties the earlier position (prefixes)
        self.s, self.j, self.i = s[order], j[order], i[order]

    def __call__(self, ks) -> tuple[float, float]:
        """(expected tokens, seconds) of a round drafting ks."""
        tokens = sum(g[k] for g, k in zip(self.gain, ks))
        seconds = self.v[self.n + sum(ks)] + self.round_seconds
        seconds += sum(c for k, c in zip(ks, self.start_at) if k)
        # one draft decode per position; with the model drafters' ks falling, the r widest decodes have r rows
        drafted = sorted((k for k, m in zip(ks, self.model_at) if k and m), reverse=True)
        drafted.append(0)
        d = self.d
        for r in range(len(drafted) - 1):
            seconds += (drafted[r] - drafted[r + 1]) * d[r + 1]
        return tokens, seconds

    def rate(self, ks) -> float:
        tokens, seconds = self(ks)
        return tokens / seconds


def _search(price: _Price, keep: np.ndarray) -> list[int]:
    """The best allocation of the K first drafts (of those `keep` allows) at positions <= L, over every cap L on
    the model drafters and total K, beside the fixed sequences' drafts: a row per cap, a column per draft, each
    priced at once."""
    keep = keep & ~price.fixed[price.i]
    s, j, i = price.s[keep], price.j[keep], price.i[keep]
    model = ~price.free[i]
    n, caps = price.n, int(j.max(initial=-1)) + 1
    base = price.base
    # what the fixed drafts cost whatever the plan: their rows of each draft decode, their catch-ups, their tokens
    fixed_at = np.zeros(max(base, default=0) + caps + 1, int)
    for k, m in zip(base, price.model_at):
        fixed_at[:k] += m
    tokens0 = n + sum(g[k] - 1.0 for g, k in zip(price.gain, base))
    seconds0 = sum(price.d[r] for r in fixed_at if r) + sum(c for k, c in zip(base, price.start_at) if k)
    seconds0 += price.round_seconds
    rows0 = n + sum(base)
    if not caps:
        return list(base)
    # the draft decode row a draft adds is the next of its position's (a cap drops whole positions, so the rank
    # is the same under every cap); the first draft of a sequence adds its start cost
    at = (j[:, None] == np.arange(caps)) & model[:, None]
    rank = (np.cumsum(at, axis=0)[np.arange(len(j)), j] + fixed_at[j]) * model
    add = np.where(model, price.draft[rank] - price.draft[np.maximum(rank - 1, 0)] * (rank > 1), 0.0)
    add += np.where(j == 0, price.start[i], 0.0)
    taken = (j < np.arange(1, caps + 1)[:, None]) | ~model  # caps x drafts
    count = np.cumsum(taken, axis=1)
    tokens = tokens0 + np.cumsum(np.where(taken, s, 0.0), axis=1)
    seconds = seconds0 + np.cumsum(np.where(taken, add, 0.0), axis=1) + price.verify[rows0 + count]
    rate = np.where(taken, tokens / seconds, 0.0)
    cap, last = np.unravel_index(int(np.argmax(rate)), rate.shape)
    ks = np.asarray(base, int)
    if rate[cap, last] > tokens0 / (seconds0 + price.verify[rows0]):
        sel = taken[cap, : last + 1]
        np.maximum.at(ks, i[: last + 1][sel], j[: last + 1][sel] + 1)
    return ks.tolist()


def _improve(ks: list[int], price: _Price) -> list[int]:
    """Local search: one sequence's k up or down by one or to 0, or one draft moved from a sequence to one that
    drafts differently (free against model, or either must catch up), while that raises the rate."""
    n, model, start = price.n, price.model_at, price.start_at
    limits = [0 if f else k for k, f in zip(price.limits, price.fixed.tolist())]  # a fixed k never moves
    mixed = [
        (a, b)
        for a in range(n)
        for b in range(n)
        if a != b and limits[a] and limits[b] and (model[a] != model[b] or start[a] or start[b])
    ]
    best = price.rate(ks)
    while True:
        moves = [
            {a: k}
            for a in range(n)
            if limits[a]
            for k in {ks[a] - 1, ks[a] + 1, 0}
            if k != ks[a] and 0 <= k <= limits[a]
        ]
        moves += [{a: ks[a] - 1, b: ks[b] + 1} for a, b in mixed if ks[a] and ks[b] < limits[b]]
        found = None
        for move in moves:
            new = [move.get(a, k) for a, k in enumerate(ks)]
            rate = price.rate(new)
            if rate > best * (1.0 + 1e-12):
                best, found = rate, new
        if found is None:
            return ks
        ks = found


class BatchPrices:
    """What the batch policy prices a round by: seconds of a target decode of n rows and of a draft decode of m
    rows, learned from the batch's own decodes unless `frozen` (a test's injected costs)."""

    def __init__(self, verify: VerifyCost, draft: VerifyCost | None = None, frozen: bool = False) -> None:
        self.verify, self.draft, self.frozen = verify, draft if draft is not None else VerifyCost(), frozen

    def observe(self, curve: VerifyCost, n: int, seconds: float) -> None:
        if not self.frozen:
            curve.observe(n, seconds)

    def curves(self, n_hi: int, m_hi: int) -> tuple[list[float], list[float]]:
        """(v, d) to n_hi target and m_hi draft rows, cautious beyond what was timed: the target's fitted slope
        past its largest timed size, the draft's largest timed size scaled by the target's shape."""
        v = _cautious(self.verify, n_hi)
        d = list(self.draft.curve(m_hi)[: m_hi + 1])
        last = max(self.draft.measured_sizes(), default=0)
        for m in range(last + 1, m_hi + 1) if last else ():
            d[m] = d[last] * v[m] / v[last]
        return v, d


def _cautious(cost: VerifyCost, n_hi: int) -> list[float]:
    """cost.curve to n_hi, continued past the largest timed size along the fitted slope rather than flat (which
    prices an untimed wider decode as free: a single sequence's exploration, a loss for the whole batch)."""
    out = list(cost.curve(n_hi)[: n_hi + 1])
    last = max(cost.measured_sizes(), default=0)
    if last:
        b = cost.fit()[1]
        for n in range(last + 1, n_hi + 1):
            out[n] = out[last] + b * (n - last)
    return out


def plan_from_costs(
    costs: Sequence[CostModel | None],
    limits: Sequence[int],
    prices: BatchPrices,
    *,
    free: Sequence[bool] | None = None,
    start: Sequence[float] | None = None,
    fixed: Sequence[bool] | None = None,
    round_seconds: float = 0.0,
) -> BatchPlan:
    """plan_batch on the online estimates: each sequence's CostModel's acceptance (None: a sequence that never
    drafts, `ar`) and the batch's prices of a target decode of n rows and a draft decode of m rows."""
    n = len(costs)
    acceptance = [cm.acceptance() if cm is not None else [] for cm in costs]
    limits = [min(k, len(a)) for k, a in zip(limits, acceptance)]
    v, d = prices.curves(n + sum(limits) + 1, max(1, n) + 1)
    return plan_batch(acceptance, limits, v, d, free=free, start=start, fixed=fixed, round_seconds=round_seconds)


def probe_pays(
    costs: Sequence[CostModel | None],
    limits: Sequence[int],
    prices: BatchPrices,
    i: int,
    k: int,
    horizon: float,
    catch_up: float,
    *,
    fixed: Sequence[bool] | None = None,
) -> bool:
    """Whether sequence i should draft k this round though the plan drafts nothing: the seconds its evidence is
    expected to save over `horizon` tokens of the batch (the plan had its acceptance been each value
    CostModel.belief finds plausible) exceed the round's extra price and the `catch_up` it pays first."""
    cm = costs[i]
    assert cm is not None
    n = len(costs)
    acceptance = [c.acceptance() if c is not None else [] for c in costs]
    limits = [min(lim, len(a)) for lim, a in zip(limits, acceptance)]
    v, d = prices.curves(n + sum(limits) + 1, max(1, n) + 1)
    now = plan_batch(acceptance, limits, v, d, fixed=fixed)
    value = 0.0
    for a, weight in cm.belief(k):
        told = [*acceptance[:i], [a] * len(acceptance[i]), *acceptance[i + 1 :]]
        value += weight * horizon * (1.0 / now.rate - 1.0 / plan_batch(told, limits, v, d, fixed=fixed).rate)
    price = _Price(acceptance, limits, v, d, None, None, fixed, 0.0)
    probe = [min(k, limits[i]) if j == i else x for j, x in enumerate(now.ks)]
    (t0, s0), (t1, s1) = price(now.ks), price(probe)
    return value > catch_up + (s1 - s0) - (t1 - t0) / now.rate
