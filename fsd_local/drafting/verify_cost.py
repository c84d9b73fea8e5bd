"""v(n), the seconds of one target decode of n tokens, learned online per batch size and used as measured
(level x shape: the level follows the load, the shape each size's cost); a size not timed yet is priced
optimistically until it is (docs/design.md, "The cost model of `auto`" and "The cold start")."""

from __future__ import annotations

import math

VERIFY_SLOPE_PRIOR = 0.3
TILE_ROWS = 8  # an untimed batch of whole tiles is priced as the timed batch below it (docstring)
FORGET_WEIGHT = 0.01  # a batch size's evidence below this weight is dropped (its shape may no longer hold)


def _finite_positive(x) -> bool:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and x > 0


class VerifyCost:
    """Seconds of one target decode of a batch of n tokens, learned online (shareable between CostModels)."""

    def __init__(
        self, n_max: int = 9, decay: float = 0.9, slope_prior: float = VERIFY_SLOPE_PRIOR, shape_decay: float = 0.99
    ):
        self.decay = decay  # of the level: it follows the load within ~10 decodes
        self.shape_decay = shape_decay  # of each size's evidence: a size unused for ~450 decodes is forgotten
        self.slope_prior = slope_prior
        # v(n) = level x shape[n]: the shape keeps each size's measured cost relative to the others (the tiles),
        # the level follows the machine (other jobs come and go) from whatever size the loop is using, so a
        # size measured long ago is rescaled, not trusted as it was nor flattened into a line
        self.level = 1.0
        self._mean = [0.0] * (n_max + 1)  # index n; 0 unused: the shape, seconds / level at the time
        self._weight = [0.0] * (n_max + 1)
        self._live: list[int] = []  # the sizes with weight
        self._cache: list[float] | None = None
        self._slope: float | None = None  # fit()'s slope, until the next observation
        self.redecode = False  # a rejection sends the target back to a checkpoint (SequenceCache.redecodes)

    def rework(self) -> float:
        """Seconds a token decoded again costs the next decode: the fitted slope where the target re-decodes the
        accepted text after a rejection (`redecode`), else 0."""
        if not self.redecode:
            return 0.0
        if self._slope is None:
            self._slope = self.fit()[1]
        return self._slope

    def forget(self) -> None:
        """No decode timed: every size priced by the prior again (the policy's costs replaced by a table)."""
        self.level, self._live, self._cache, self._slope = 1.0, [], None, None
        self._mean, self._weight = [0.0] * len(self._mean), [0.0] * len(self._weight)

    @property
    def measured(self) -> bool:
        return any(w > 0.0 for w in self._weight)

    def _grow(self, n: int) -> None:
        extra = n + 1 - len(self._mean)
        if extra > 0:
            self._mean += [0.0] * extra
            self._weight += [0.0] * extra

    def observe(self, n: int, seconds: float) -> None:
        """One target decode of n tokens took `seconds`. Non-positive or non-finite times are ignored."""
        if n < 1 or not _finite_positive(seconds):
            return
        seconds = float(seconds)
        self._grow(n)
        w = self._weight
        if w[n] > 0.0 and self._mean[n] > 0.0:  # the level moves by a share of the log residual
            self.level *= (seconds / (self.level * self._mean[n])) ** (1.0 - self.decay)
        elif not self.measured:
            self.level = seconds  # the first measurement sets the scale: shapes are then near 1
        for i in self._live:  # only the sizes measured decay (a few of the 65)
            w[i] = w[i] * self.shape_decay if w[i] * self.shape_decay >= FORGET_WEIGHT else 0.0
        if w[n] == 0.0 and n not in self._live:
            self._live.append(n)
        self._live = [i for i in self._live if w[i] > 0.0 or i == n]
        w[n] += 1.0
        self._mean[n] += (seconds / self.level - self._mean[n]) / w[n]
        self._cache = self._slope = None

    def fit(self) -> tuple[float, float]:
        """(a, b) of v(n) = a + b (n - 1): weighted least squares over the measured n, b >= 0; the slope prior
        when only one n is measured; (1, slope_prior) in units of one decode when nothing is."""
        pts = [(n, m * self.level, w) for n, (m, w) in enumerate(zip(self._mean, self._weight)) if w > 0.0]
        if not pts:
            return 1.0, self.slope_prior
        if len(pts) == 1:
            n0, m0, _ = pts[0]
            a = m0 / (1.0 + self.slope_prior * (n0 - 1))
            return a, self.slope_prior * a
        sw = sum(w for _, _, w in pts)
        xbar = sum(w * (n - 1) for n, _, w in pts) / sw
        ybar = sum(w * m for _, m, w in pts) / sw
        sxx = sum(w * (n - 1 - xbar) ** 2 for n, _, w in pts)
        sxy = sum(w * (n - 1 - xbar) * (m - ybar) for n, m, w in pts)
        b = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        a = ybar - b * xbar
        floor = 0.1 * min(m for _, m, _ in pts)  # a steep fit must not predict a free (or negative) single decode
        a = max(a, floor)
        return a, b

    def measured_sizes(self) -> dict[int, float]:
        """The estimated seconds of every batch size ever timed (what the cost store keeps)."""
        return {n: self.seconds(n) for n in range(1, len(self._weight)) if self._weight[n] > 0.0}

    def measured_at(self, n: int) -> bool:
        """Whether a decode of exactly n tokens was ever timed (not read off the curve)."""
        return 0 < n < len(self._weight) and self._weight[n] > 0.0

    def curve(self, n_hi: int) -> list[float]:
        """Estimated seconds for n = 0..n_hi (index 0 unused): measured sizes as measured, linear between them
        (at most the timed size below, for whole tiles), the fitted line below the first and, beyond the last, the
        last measured mean (the prior's line after a plain step alone)."""
        if self._cache is not None and len(self._cache) > n_hi:
            return self._cache
        a, b = self.fit()
        known = [n for n in range(1, len(self._weight)) if self._weight[n] > 0.0]
        v = [m * self.level for m in self._mean]
        out = [0.0] * (n_hi + 1)
        lo = 0  # the largest measured size below n, walked up with n (one pass, this runs every round)
        nxt = 0  # index in `known` of the first measured size >= n
        for n in range(1, n_hi + 1):
            while nxt < len(known) and known[nxt] < n:
                lo = known[nxt]
                nxt += 1
            if nxt < len(known) and known[nxt] == n:
                out[n] = v[n]
            elif not known or n < known[0]:
                out[n] = a + b * (n - 1)
            elif nxt == len(known):
                last = known[-1]
                out[n] = v[last] if last > 1 else v[last] + b * (n - last)
            else:
                hi = known[nxt]
                out[n] = v[lo] + (n - lo) / (hi - lo) * (v[hi] - v[lo])
                if n % TILE_ROWS == 0 and lo > 1:  # whole tiles: maybe no dearer than the batch below (docstring)
                    out[n] = min(out[n], v[lo])
        self._cache = out
        return out

    def seconds(self, n: int) -> float:
        return self.curve(n)[n]
