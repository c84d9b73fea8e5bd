"""Random rounds for the acceptance kernel's tests."""

from __future__ import annotations

import numpy as np


def random_round(seed: int, k: int = 6, n: int = 500, spread: float = 1.0):
    """(P, Q, drafts): k + 1 target rows, k draft rows that are the target's plus noise of sd `spread`, and the
    draft's greedy picks, float32 over n tokens."""
    rng = np.random.default_rng(seed)
    P = (rng.standard_normal((k + 1, n)) * 2).astype(np.float32)
    Q = (P[:k] + rng.standard_normal((k, n)) * spread).astype(np.float32)
    return P, Q, [int(np.argmax(Q[i])) for i in range(k)]
