"""The logit chain's kernels, in place on one row: logit bias and llama.cpp's repetition penalties (touching only the
tokens they name) and a token mask (one vectorised pass over a bit per token); fsd_local/chain.py decides which
rows, with which window of accepted text and which mask."""

from typing import NamedTuple

import numpy as np
from numba import njit

from fsd_local.kernels.fastmath import FLAGS, wide
from fsd_local.kernels.jit_cache import jit


class Penalties(NamedTuple):
    """llama.cpp's penalties over the last `last_n` tokens of the text (its `penalty_last_n`): a token seen there
    has its logit divided by `repeat` when positive, multiplied by it otherwise (1 = off), then lowered by
    `frequency` times its count and by `presence` once."""

    repeat: float
    frequency: float
    presence: float


@jit
def apply_bias(row, ids, values):
    """row[ids[i]] += values[i] (a -inf value bans the token)."""
    for i in range(ids.shape[0]):
        row[ids[i]] += np.float32(values[i])


@jit
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


class Window(NamedTuple):
    """The penalties' window over the accepted text, kept incrementally (chain.py): `counts[t]` is how often token t
    occurs in it, and `distinct[:size[0]]` lists the tokens that occur (`slot[t]`: where t sits in it), so a row is
    penalised in time proportional to the tokens in the window, whatever the context's length."""

    counts: np.ndarray
    distinct: np.ndarray
    slot: np.ndarray
    size: np.ndarray


@njit(inline="always")
def _penalise_once(row, t, counts, pen, n):
    """Penalise token t by its count, once: its count is negated until `penalise_row` restores it."""
    c = counts[t]
    if c > 0:
        if t < n:
            x = row[t]
            x = x * np.float32(pen.repeat) if x <= 0 else x / np.float32(pen.repeat)
            row[t] = x - np.float32(c * pen.frequency + pen.presence)
        counts[t] = -c


@jit
def penalise_row(row, pen, w, text, drop_lo, drop_hi, pending, p_lo, p_hi):
    """Penalise `row` for the window: the accepted text's window (w) without text[drop_lo:drop_hi] (what the
    round's drafts before this row pushed out of it) and with pending[p_lo:p_hi] (those drafts), each token once
    by its count; w is as it was on return."""
    counts, distinct = w.counts, w.distinct
    n = min(row.shape[0], counts.shape[0])
    for i in range(drop_lo, drop_hi):
        counts[text[i]] -= 1
    for i in range(p_lo, p_hi):
        counts[pending[i]] += 1
    for a in range(w.size[0]):
        _penalise_once(row, distinct[a], counts, pen, n)
    for i in range(p_lo, p_hi):
        _penalise_once(row, pending[i], counts, pen, n)
    for a in range(w.size[0]):
        counts[distinct[a]] = abs(counts[distinct[a]])
    for i in range(p_lo, p_hi):
        counts[pending[i]] = abs(counts[pending[i]]) - 1
    for i in range(drop_lo, drop_hi):
        counts[text[i]] += 1


@jit
def window_move(w, text, enter_lo, enter_hi, leave_lo, leave_hi):
    """The window takes in text[enter_lo:enter_hi] and lets go of text[leave_lo:leave_hi]."""
    counts, distinct, slot, size = w.counts, w.distinct, w.slot, w.size
    for i in range(enter_lo, enter_hi):
        t = text[i]
        if counts[t] == 0:
            slot[t] = size[0]
            distinct[size[0]] = t
            size[0] += 1
        counts[t] += 1
    for i in range(leave_lo, leave_hi):
        t = text[i]
        counts[t] -= 1
        if counts[t] == 0:  # the last one left: the list's last token takes its place
            last = distinct[size[0] - 1]
            distinct[slot[t]] = last
            slot[last] = slot[t]
            size[0] -= 1


def new_window(n_vocab: int) -> Window:
    return Window(
        np.zeros(n_vocab, np.int32), np.zeros(n_vocab, np.int32), np.zeros(n_vocab, np.int32), np.zeros(1, np.int64)
    )


@jit(fastmath=FLAGS, error_model="numpy")  # fastmath.kernel, spelled out for the type checker
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
    text = np.zeros(4, np.int32)
    w = new_window(64)
    window_move(w, text, 0, 2, 0, 1)
    penalise_row(row, Penalties(1.1, 0.1, 0.1), w, text, 0, 1, text, 0, 1)
    apply_bias(row, np.zeros(1, np.int32), np.zeros(1))
    apply_penalties(row, np.zeros(2, np.int32), Penalties(1.1, 0.1, 0.1), np.zeros(64, np.int32))
    apply_mask(row, 64, np.full(2, -1, np.int32))
