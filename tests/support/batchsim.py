"""Drive a batch of sequences through rounds like the engine's scheduler would, on acceptance traces and per-batch
costs, without models: every round one draft decode per draft position for the sequences that draft and one target
decode of every sequence's rows; the draft lengths chosen by the batch policy (drafting/batch_length.py) on each
sequence's online acceptance estimate (a CostModel fed each round's outcome), or fixed. Sequences leave when they
have their tokens, so the batch shrinks as it would under continuous batching with no new arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsd_local.drafting.batch_length import plan_batch
from fsd_local.drafting.cost_model import CostModel


@dataclass
class BatchCosts:
    verify: list[float]  # seconds of a target decode of n rows, index n (0 unused)
    draft: list[float]  # seconds of a draft decode of m rows, index m (0 unused)

    def v(self, n: int) -> float:
        return self.verify[min(n, len(self.verify) - 1)]

    def d(self, m: int) -> float:
        return self.draft[min(m, len(self.draft) - 1)] if m else 0.0


def extend(curve: list[float], n: int) -> list[float]:
    """The curve (index 0 unused) to index n, continued past its end along the line from its first size to its
    last (a measured curve's last step is mostly noise and tiles; it can even fall)."""
    out = list(curve)
    slope = max(0.0, (out[-1] - out[1]) / (len(out) - 2)) if len(out) > 2 else out[-1]
    while len(out) <= n:
        out.append(out[-1] + slope)
    return out


def run_batch(
    traces, costs: BatchCosts, n_tokens: int, k: int | None = None, k_max: int = 16, warm: CostModel | None = None
) -> tuple[float, float]:
    """(tokens, seconds) of serving every trace to n_tokens in one batch: fixed k (0: plain decoding) or, with
    k None, the batch policy, each sequence's acceptance estimate a fork of `warm` (the evidence of earlier
    replies, as the engine keeps it) or fresh. traces[i][p]: whether sequence i's draft at position p is accepted."""
    n = len(traces)
    pos = [0] * n
    cms = [warm.fork() if warm is not None else CostModel(k_max) for _ in range(n)]
    verify, draft = extend(costs.verify, n * (k_max + 1) + 1), extend(costs.draft, n + 1)
    tokens = seconds = 0.0
    while True:
        live = [i for i in range(n) if pos[i] < n_tokens]
        if not live:
            return tokens, seconds
        limits = [min(k_max, n_tokens - pos[i] - 1) for i in live]
        if k is None:
            ks = plan_batch([cms[i].acceptance() for i in live], limits, verify, draft).ks
        else:
            ks = [min(k, lim) for lim in limits]
        seconds += sum(costs.d(sum(1 for x in ks if x >= j)) for j in range(1, max(ks) + 1))
        seconds += costs.v(len(live) + sum(ks))
        for i, ki in zip(live, ks):
            acc = 0
            while acc < ki and traces[i][pos[i] + acc]:
                acc += 1
            if ki:
                cms[i].observe_acceptance(ki, acc)
                if warm is not None:
                    warm.observe_acceptance(ki, acc)
            pos[i] += acc + 1
            tokens += acc + 1
