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

MS = 1e-3
# measured on this host (docs/measurements/batch-costs.md: 2-core AMD EPYC, 2 threads, unified KV, 128 tokens of
# context a sequence): one decode of n rows (index n) from min(n, 4) sequences of the target, and of m rows from m
# sequences (one each) of the draft, in ms. The F16 demo pair: a row more costs 1.7x at 2 rows, then ~3 ms each;
# its draft costs 0.7 of the target. The wide pair: 2 rows cost 2x one, 4 rows 2.5x; its draft costs 0.2.
F16_TARGET_MS = [16.5, 28.5, 30.9, 33.0, 36.0, 35.6, 41.3, 45.3, 46.6, 50.7, 51.9, 56.8, 57.4, 60.5, 64.7, 67.3]
F16_DRAFT_MS = [11.8, 23.2, 26.5, 26.2, 26.8, 29.1, 34.2, 36.5]
WIDE_TARGET_MS = [
    46.3,
    94.7,
    101.1,
    113.9,
    161.1,
    165,
    203.3,
    185.9,
    261,
    245,
    283.6,
    269.6,
    357.5,
    302.5,
    337.3,
    347.5,
]
WIDE_DRAFT_MS = [9.1, 14.8, 17.4, 22.1, 26.8, 32.1, 35.5, 41.2]
F16_TARGET, F16_DRAFT = ([0.0] + [t * MS for t in c] for c in (F16_TARGET_MS, F16_DRAFT_MS))
WIDE_TARGET, WIDE_DRAFT = ([0.0] + [t * MS for t in c] for c in (WIDE_TARGET_MS, WIDE_DRAFT_MS))


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
