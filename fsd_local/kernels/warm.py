"""Every kernel the loop uses compiled (or loaded from numba's cache) before the first generation's timed span."""

import threading

import numpy as np

from fsd_local.kernels.accept import Drafts, Rule, Sampling, accept_round, round_out
from fsd_local.kernels.budget import new_budget
from fsd_local.kernels.emit import accept_tops, emit_one
from fsd_local.kernels.names import CASCADE, FSD, FSD_ENTROPY, FSD_PAPER, RELAXED, SD, TYPICAL
from fsd_local.kernels.penalties import warm_up as warm_chain
from fsd_local.kernels.sampling import pick, pick_kept, pick_kept_copy
from fsd_local.kernels.score import score_slots

_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel the loop and the chain use, on a thread of its own: the
    OpenMP threads its parallel kernels start end with it (docs/design.md, "One OpenMP pool")."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            _warm_loop()
            warm_chain()
        except BaseException as e:  # raised again on the caller's thread
            failed.append(e)

    thread = threading.Thread(target=run, name="fsd-local-warm")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _warm_loop() -> None:
    """Every kernel the loop uses, with the loop's exact argument types, so the first generation does not pay
    for it inside its timed span. Once per process."""
    global _warm
    if _warm:
        return
    n, k = 64, 2
    rng = np.random.default_rng(0)
    P = rng.standard_normal((k + 1, n)).astype(np.float32)
    Q = rng.standard_normal((k, n)).astype(np.float32)
    q_stats = np.zeros((k + 1, 3), np.float32)
    q_prob = np.ones(k)
    drafts = np.zeros(k, np.int32)
    for onehot in (0, 1):
        draft = Drafts(Q, drafts, q_prob, q_stats, np.full(k, onehot, np.uint8))
        out = round_out(k, 2 * onehot)  # with and without top alternatives (the same types)
        budgets = (new_budget(None, k), new_budget(0.1, k))
        for budget in budgets:  # a greedy lossless round whose rows stayed on the device (round.judge_tops)
            accept_tops(drafts, k, out, budget)
        for temperature in (0.0, 1.0):
            sampling = Sampling(temperature, 0, 1.0, 0.0)
            pick(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], False)
            pick(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], True)
            pick_kept(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], out.kept[0], False, out.summaries[0])
            pick_kept(Q[0], n, temperature, 8, 0.9, 0.05, 0.5, q_stats[0], out.kept[0], True, out.summaries[0])
            pick_kept_copy(
                Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], out.kept[0], False, Q[1], out.summaries[0]
            )
            pick_kept_copy(
                Q[0], n, temperature, 8, 0.9, 0.05, 0.5, q_stats[0], out.kept[0], True, Q[1], out.summaries[0]
            )
            emit_one(P[0], n, sampling, 0.5, q_stats[0], out)
            for mode in (FSD, FSD_PAPER, SD, TYPICAL, CASCADE, RELAXED, FSD_ENTROPY):
                for budget in budgets:
                    accept_round(P, draft, k, n, Rule(mode, 0, 1.0, 50), sampling, np.full(k + 1, 0.5), out, budget)
                idx = np.arange(k, dtype=np.int64)
                scored = np.zeros(k, np.uint8)
                rule, us = Rule(mode, 0, 1.0, 50), np.full((k, 2), 0.5)
                score_slots(
                    P, idx, Q, idx, n, rule, sampling, 1.0, us, q_stats[0], out.kept[0], out.summaries[0], scored
                )
    _warm = True
