"""Drive the `auto` policy (drafting/length.py) like the engine does, on recorded or generated acceptance traces
and per-batch costs, without models: what it chooses and the tokens per second it would reach, side by side with
every fixed k on the same trace (the offline oracle's arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsd_local.drafting.length import PENDING_MAX, DraftLength
from fsd_local.drafting.proposer import MODEL
from fsd_local.settings import Settings


@dataclass
class Costs:
    verify: list[float]  # seconds of a target batch of n tokens, index n (0 unused)
    draft: float  # seconds per drafted token
    catch_up: float = 0.0  # seconds per token the draft evaluates in one batch after plain steps
    per_token_other: float = 0.0  # the loop's own seconds per drafted token (kernels, row copies)

    def v(self, n: int) -> float:
        return self.verify[min(n, len(self.verify) - 1)]


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    ks: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def run_auto(
    depths, costs: Costs, n_tokens: int, k_max: int = 16, lengths: DraftLength | None = None, calibrate: bool = True
):
    """depths[i]: how many leading drafts the target accepts at text position i (a trace); one reply.
    calibrate: time every batch size first, as the engine does (False: learn only the sizes used)."""
    dl = lengths or DraftLength()
    dl.start(Settings(draft_policy="auto", draft_max=k_max))
    for n in range(1, k_max + 2) if calibrate else ():  # the engine's calibration
        if not dl.verify.measured_at(n):
            dl.verify.observe(n, costs.v(n))
    res, behind = Result(), 2
    while res.tokens < n_tokens:
        limit = n_tokens - res.tokens - 1
        k = dl.choose(MODEL, limit, behind=behind)
        res.ks.append(k)
        if k:
            t = k * costs.draft + k * costs.per_token_other
            if behind > PENDING_MAX:
                catch = costs.catch_up * behind
                dl.observe_catch_up(behind, catch)
                t += catch
            acc = min(k, depths[res.tokens % len(depths)])
            dl.observe(MODEL, k, acc, k * costs.draft, costs.v(k + 1))
            res.seconds += t + costs.v(k + 1)
            res.tokens += acc + 1
            behind = 2
        else:
            dl.observe(None, 0, 0, 0.0, costs.v(1))
            res.seconds += costs.v(1)
            res.tokens += 1
            behind += 1
    return res, dl


def run_fixed(depths, costs: Costs, n_tokens: int, k: int) -> Result:
    res = Result()
    while res.tokens < n_tokens:
        kk = min(k, n_tokens - res.tokens - 1)
        acc = min(kk, depths[res.tokens % len(depths)])
        res.seconds += kk * (costs.draft + costs.per_token_other) + costs.v(kk + 1)
        res.tokens += acc + 1
        res.ks.append(kk)
    return res


def best_fixed(depths, costs: Costs, n_tokens: int, k_max: int = 16) -> tuple[int, float]:
    rates = [(run_fixed(depths, costs, n_tokens, k).rate, k) for k in range(0, k_max + 1)]
    rate, k = max(rates)
    return k, rate
