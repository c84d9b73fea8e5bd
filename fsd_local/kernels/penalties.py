"""The logit-processing chain's kernels: logit bias, llama.cpp's repetition penalties and a token mask, applied in
place to one logit row before any sampling or acceptance test (fsd_local/chain.py decides which rows, with
which window of accepted text and which mask).

Bias and penalties touch only the tokens they name (sparse: a few dozen entries per row, whatever the
vocabulary); the mask is one vectorised pass over a bit per token.
"""

from typing import NamedTuple

import numpy as np
from numba import njit

from fsd_local.kernels.fastmath import FLAGS, wide


class Penalties(NamedTuple):
    """llama.cpp's penalties over the last `last_n` tokens of the text (its `penalty_last_n`): a token seen there
    has its logit divided by `repeat` when positive, multiplied by it otherwise (1 = off), then lowered by
    `frequency` times its count and by `presence` once."""

    repeat: float
    frequency: float
    presence: float


@njit(cache=True)
def apply_bias(row, ids, values):
    """row[ids[i]] += values[i] (a -inf value bans the token)."""
    for i in range(ids.shape[0]):
        row[ids[i]] += np.float32(values[i])


@njit(cache=True)
def apply_penalties(row, window, pen, counts):
    """Penalise the tokens of `window` (the accepted text's last tokens) in `row`, each once by its count.
    `counts` is an int32 scratch array over the vocabulary, all zero on entry and on return."""
    n = min(row.shape[0], counts.shape[0])  # a token past either (a wider model's padding) is left alone
    for i in range(window.shape[0]):
        if 0 <= window[i] < n:
            counts[window[i]] += 1
    for i in range(window.shape[0]):
        t = window[i]
        if not 0 <= t < n or counts[t] == 0:  # outside, or already done (penalised once, by its count)
            continue
        c = counts[t]
        x = row[t]
        x = x * np.float32(pen.repeat) if x <= 0 else x / np.float32(pen.repeat)
        row[t] = x - np.float32(c * pen.frequency + pen.presence)
        counts[t] = 0


@njit(fastmath=FLAGS, error_model="numpy", cache=True)  # fastmath.kernel, spelled out for the type checker
def apply_mask(row, n, bits):
    """row[i] = -inf for every i < n whose bit (bits: int32 words, token i at bit i % 32 of word i // 32) is 0."""
    wide()
    ninf = np.float32(-np.inf)
    for i in range(n):
        keep = (bits[i >> 5] >> (i & 31)) & 1
        row[i] = row[i] if keep else ninf


def warm_up() -> None:
    """Compile (or load from numba's cache) the chain's kernels with the loop's argument types."""
    row = np.zeros(64, np.float32)
    apply_bias(row, np.zeros(1, np.int32), np.zeros(1))
    apply_penalties(row, np.zeros(2, np.int32), Penalties(1.1, 0.1, 0.1), np.zeros(64, np.int32))
    apply_mask(row, 64, np.full(2, -1, np.int32))
