"""The `auto` draft-length policy (FSD.md, "Drafters and draft length").

Each round, pick the k in [0, k_max] that maximises expected tokens per second:

    rate(k) = E(k) / (k * c_draft + v(k + 1) + c_round),    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k

c_draft: seconds per draft token; v(n): seconds of one target decode of a batch of n tokens (n = k + 1: the last
accepted token and k drafts); a_j: the chance that draft position j is accepted given that position j - 1 was;
c_round: optional fixed seconds per round (the loop's own overhead). k = 0 is a plain target step (rate 1 / v(1)).

Why each estimate is built the way it is:
- Everything decays exponentially per observation, so the policy follows the text (code being copied accepts
  far more than free prose) and the machine (other jobs come and go).
- v(n) is measured per batch size and used as measured: llama.cpp's CPU matmul kernels work in tiles of 4 and 8
  rows, so a batch of 8 can cost what a batch of 5 costs (measured on a padded 1.4 GB Q8_0 target, 2 threads:
  n = 4: 225 ms, 5: 303, 7: 355, 8: 312). Smoothing the curve, or forcing it to grow with n, would hide exactly
  the batches worth paying for. Between measured sizes it interpolates linearly; beyond them it follows a
  weighted line a + b (n - 1) fitted through all measured n (b >= 0; with a single measured n the slope comes
  from a prior, b = 0.3 a). The engine measures the whole curve once (`calibrate` in proposer.py: one timed
  decode of every batch size 1..k_max + 1 at the first use of auto), so the policy never has to guess a size it
  could use, and every round refines the size it used. The load changes (other jobs come and go) while only
  one size is in use, so v(n) = level x shape(n): the level follows every decode within ~10 decodes, the
  shape (each size relative to the others) changes slowly, and a size unused for ~450 decodes is forgotten.
- Using the batch it pays for: because rate(k) is evaluated on every k with the measured v(k + 1), a k whose
  batch is cheap for its size wins by itself: when v(5) = v(8), drafting 7 tokens costs three draft tokens
  more than drafting 4 and earns E(7) - E(4) more tokens, so with good acceptance the policy drafts up to the
  next efficient size instead of stopping at the k its acceptance alone would suggest.
- a_j are decayed counts per position, shrunk toward the pooled rate of all positions (worth 8 rounds at each
  position), itself shrunk toward a cold-start prior (0.7 at position 1, x0.98 per position) worth 6 rounds.
  Positions beyond the k in use are never reached; their stale counts fade and they take the pooled rate, so
  when the positions in use accept well the policy tries longer drafts. The weights are what keeps an unlucky
  start from deciding a reply: with a prior worth 2 rounds, two rejections in the first two rounds (6% of
  replies for a pair that accepts 0.75) put a_1 near 0.3 and the policy into plain steps, where no probe
  was affordable for the rest of the reply (the issue's k histogram [63, 1]); a deep position seen rejected
  once, with little weight toward the pooled rate, kept k below the best for the rest of a short session.
- Before anything is measured the priors alone are used, in units of one target decode (only ratios matter), so
  the first round is already a sensible guess (k ~ 2 for a free drafter) rather than a wasted probe.
- k = 0 measures nothing about drafting, so a policy that settled there would never see conditions improve:
  after `probe_every` rounds at k = 0 it tries k = `probe_k` once; each probe that changes nothing doubles the
  wait (up to `probe_max`), so failed probes cost a few % of the time (length.py budgets a model drafter's);
  a probe that accepted a larger share than the current estimate, or any round that chooses k > 0, resets the
  wait (after a good probe the next one comes
  in probe_every / 4 rounds).
- `settings_changed()` (tau, mode, divergence or temperature changed) shrinks the acceptance counts to a tenth
  but keeps the costs: the machine did not change, the acceptance did.

The engine owns all timing and calls, per round:
    k = cm.choose_k(limit)                      # limit: remaining tokens, context room
    cm.observe_draft(n_proposed, seconds)       # when it drafted (a free drafter passes its tiny time)
    cm.observe_verify(batch_n, seconds)         # every target decode in the loop, plain steps included
    cm.observe_acceptance(n_drafted, n_accepted)  # only rounds that drafted
For `ngram+model`, use one CostModel per drafter sharing one `VerifyCost` (the target's costs are the same):
look the n-gram up first (free), then ask the model of whichever drafter will draft; report each target decode
once (to either model, or to the shared VerifyCost directly).
"""

from __future__ import annotations

import copy
import math

ACCEPT_PRIOR_FIRST = 0.7
ACCEPT_PRIOR_DECAY = 0.98
ACCEPT_PRIOR_WEIGHT = 6.0  # rounds of evidence the cold-start prior is worth in the pooled rate
POSITION_WEIGHT = 8.0  # rounds of evidence the pooled rate is worth at each position
VERIFY_SLOPE_PRIOR = 0.3
FORGET_WEIGHT = 0.01  # a batch size's evidence below this weight is dropped (its shape may no longer hold)
MODEL_DRAFT_COST_PRIOR = 0.3  # seconds per draft token / seconds of one target decode, before measuring


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
        self._cache: list[float] | None = None

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
        for i in range(len(w)):
            w[i] = w[i] * self.shape_decay if w[i] * self.shape_decay >= FORGET_WEIGHT else 0.0
        w[n] += 1.0
        self._mean[n] += (seconds / self.level - self._mean[n]) / w[n]
        self._cache = None

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

    def measured_at(self, n: int) -> bool:
        """Whether a decode of exactly n tokens was ever timed (not read off the curve)."""
        return 0 < n < len(self._weight) and self._weight[n] > 0.0

    def curve(self, n_hi: int) -> list[float]:
        """Estimated seconds for n = 0..n_hi (index 0 unused, 0.0): the measured mean at every measured n (no
        smoothing: the CPU tiles make some larger batches cheaper than smaller ones, module docstring),
        linear interpolation between measured sizes, the fitted line below the first and, beyond the last,
        the last measured mean plus the line's slope."""
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
                out[n] = v[known[-1]] + b * (n - known[-1])
            else:
                hi = known[nxt]
                out[n] = v[lo] + (n - lo) / (hi - lo) * (v[hi] - v[lo])
        self._cache = out
        return out

    def seconds(self, n: int) -> float:
        return self.curve(n)[n]


class CostModel:
    """Online cost model and draft-length choice for one drafter (see the module docstring).

    cm = CostModel(k_max=8, draft_cost_prior=0.0)   # 0.0: a free drafter (ngram)
    k = cm.choose_k()
    """

    def __init__(
        self,
        k_max: int,
        *,
        draft_cost_prior: float = MODEL_DRAFT_COST_PRIOR,
        verify: VerifyCost | None = None,
        decay: float = 0.9,
        accept_decay: float = 0.95,
        accept_prior_first: float = ACCEPT_PRIOR_FIRST,
        accept_prior_decay: float = ACCEPT_PRIOR_DECAY,
        accept_prior_weight: float = ACCEPT_PRIOR_WEIGHT,
        position_weight: float = POSITION_WEIGHT,
        probe_every: int = 16,
        probe_max: int = 64,
        probe_k: int = 2,
    ):
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.verify = verify if verify is not None else VerifyCost(k_max + 1, decay)
        self.decay = decay
        self.accept_decay = accept_decay
        self.accept_prior_first = accept_prior_first
        self.accept_prior_decay = accept_prior_decay
        self.accept_prior_weight = accept_prior_weight
        self.position_weight = position_weight
        self.draft_cost_prior = draft_cost_prior
        self.probe_every = probe_every
        self.probe_max = probe_max
        self.probe_k = probe_k
        self._draft_mean = 0.0
        self._draft_weight = 0.0
        self._round_mean = 0.0
        self._round_weight = 0.0
        self._acc: list[float] = []  # decayed accepted counts per position (0-based)
        self._seen: list[float] = []  # decayed reached counts per position
        self.k_max = 0
        self.k_histogram: list[int] = []
        self.set_k_max(k_max)
        self._zero_streak = 0
        self._probe_interval = probe_every
        self._probing = False  # the last choice was a probe whose acceptance is not reported yet
        self.rounds = 0
        self.probes = 0
        self.last_rate = 0.0  # expected tokens per second (or per decode before measuring) of the last choice

    # ------------------------------------------------------------------ configuration
    def set_k_max(self, k_max: int) -> None:
        """Change the largest k (settings' draft_max); estimates for positions beyond the old k_max start at
        the prior."""
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        extra = k_max - len(self._acc)
        if extra > 0:
            self._acc += [0.0] * extra
            self._seen += [0.0] * extra
        self.k_histogram += [0] * (k_max + 1 - len(self.k_histogram))
        self.k_max = k_max

    def fork(self) -> CostModel:
        """A copy with its own acceptance evidence and choices, sharing this one's target costs (`verify`)."""
        new = copy.copy(self)
        new._acc, new._seen, new.k_histogram = list(self._acc), list(self._seen), list(self.k_histogram)
        return new

    def settings_changed(self, keep: float = 0.1) -> None:
        """Acceptance depends on tau, mode, divergence and temperature: keep only `keep` of its evidence (so a
        couple of rounds under the new settings dominate), keep every cost."""
        self._acc = [a * keep for a in self._acc]
        self._seen = [s * keep for s in self._seen]

    # ------------------------------------------------------------------ observations
    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        """Drafting n_tokens took `seconds` (0 or a few microseconds for ngram: pass what was measured)."""
        seconds = float(seconds)
        if n_tokens <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        self._draft_weight = self._draft_weight * self.decay + 1.0
        self._draft_mean += (seconds / n_tokens - self._draft_mean) / self._draft_weight

    def observe_verify(self, batch_n: int, seconds: float) -> None:
        """One target decode of batch_n tokens (k drafts + the pending token(s)); plain steps are batch_n = 1."""
        self.verify.observe(batch_n, seconds)

    def observe_round_overhead(self, seconds: float) -> None:
        """Optional: the loop's own seconds per round besides drafting and verifying (favours larger k)."""
        if math.isfinite(seconds) and seconds >= 0:
            self._round_weight = self._round_weight * self.decay + 1.0
            self._round_mean += (seconds - self._round_mean) / self._round_weight

    def observe_acceptance(self, n_drafted: int, n_accepted: int, counterfactual: bool = False) -> None:
        """A round drafted n_drafted tokens and accepted the first n_accepted: positions 1..n_accepted passed,
        position n_accepted + 1 (if drafted) failed, later ones were never reached (no evidence).
        counterfactual: the tokens were not drafted but scored afterwards against the text the target wrote
        (a free drafter's declined proposal, drafting/length.py); it is evidence, not the outcome of a probe."""
        if n_drafted <= 0:
            return
        n_accepted = max(0, min(n_accepted, n_drafted))
        if n_drafted > len(self._acc):
            self.set_k_max(n_drafted)
        # a probe that accepted a larger share than position 1's estimate is news: conditions changed
        probe = self._probing and not counterfactual
        news = probe and n_accepted > 0 and n_accepted / n_drafted > self.acceptance()[0]
        g = self.accept_decay
        self._acc = [a * g for a in self._acc]
        self._seen = [s * g for s in self._seen]
        for j in range(min(n_accepted + 1, n_drafted)):
            self._seen[j] += 1.0
            if j < n_accepted:
                self._acc[j] += 1.0
        if probe:
            self._probing = False
            if news:  # drop the back-off and look again soon
                self._probe_interval = self.probe_every
                self._zero_streak = max(self._zero_streak, self.probe_every - max(1, self.probe_every // 4))

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> list[float]:
        """Estimated a_j for positions 1..k_max (conditional on reaching j): each position's decayed counts,
        shrunk toward the pooled rate of all positions, which is itself shrunk toward the cold-start prior.
        Pooling is what lets the policy grow k: positions beyond the k it has been choosing are never reached,
        and the best guess for them is the rate of the positions that are."""
        w0 = self.accept_prior_weight
        acc_all, seen_all = sum(self._acc), sum(self._seen)
        out = []
        for j in range(self.k_max):
            cold = self.accept_prior_first * self.accept_prior_decay**j
            pooled = (acc_all + w0 * cold) / (seen_all + w0)
            out.append((self._acc[j] + self.position_weight * pooled) / (self._seen[j] + self.position_weight))
        return out

    def draft_seconds_per_token(self) -> float:
        """Measured mean, or the prior ratio times one target decode (relative units before any verify)."""
        if self._draft_weight > 0 and self.verify.measured:
            return self._draft_mean
        return self.draft_cost_prior * self.verify.seconds(1)

    @property
    def plain_tokens_per_second_est(self) -> float:
        """1 / seconds of a single-token target decode, only where one was timed (a plain step, a probe's
        catch-up is not one, the engine's calibration): what `ar` does here, for the speed-up figure. 0 when
        none was: a figure read off the fitted curve is a prior, not a measurement, and is never shown as one."""
        if not self.verify.measured_at(1):
            return 0.0
        return 1.0 / self.verify.seconds(1)

    def rates(self, k_limit: int | None = None, start_seconds: float = 0.0) -> list[float]:
        """Expected tokens per second (per decode before measuring) of every k in 0..limit; start_seconds: what
        drafting at all costs this round (a draft model catching up on text it skipped), k > 0 only."""
        kmax = self.k_max if k_limit is None else max(0, min(self.k_max, k_limit))
        return expected_rates(
            self.acceptance()[:kmax],
            self.draft_seconds_per_token(),
            self.verify.curve(kmax + 1),
            self._round_mean,
            start_seconds,
        )

    # ------------------------------------------------------------------ the choice
    def choose_k(self, k_limit: int | None = None, start_seconds: float = 0.0) -> int:
        """The k for this round (at most k_limit, e.g. the tokens still wanted minus one), re-probing
        periodically when the best is 0. start_seconds: see `rates`."""
        rates = self.rates(k_limit, start_seconds)
        k = best_k(rates)
        self.last_rate = rates[k]
        self._probing = False
        if k == 0 and len(rates) > 1:
            self._zero_streak += 1
            if self._zero_streak >= self._probe_interval:
                self._zero_streak = 0
                self._probe_interval = min(2 * self._probe_interval, self.probe_max)
                k = min(self.probe_k, len(rates) - 1)
                self.probes += 1
                self._probing = True
        elif k > 0:
            self._zero_streak = 0
            self._probe_interval = self.probe_every
        self.rounds += 1
        self.k_histogram[k] += 1
        return k

    @property
    def probing(self) -> bool:
        """The last choice was a re-probe from k = 0, not the estimated best."""
        return self._probing

    def cancel_probe(self, k: int) -> None:
        """The caller could not afford the probe it was offered (a model drafter far behind the text): count
        the round as the plain step it becomes. The wait before the next offer stays as it was."""
        if self._probing:
            self._probing = False
            self.probes -= 1
            self.k_histogram[k] -= 1
            self.k_histogram[0] += 1

    def summary(self) -> dict:
        """Plain numbers for the statistics (JSON-safe)."""
        v = self.verify.curve(self.k_max + 1)
        return {
            "k_histogram": list(self.k_histogram),
            "probes": self.probes,
            "acceptance_est": [round(a, 4) for a in self.acceptance()],
            "draft_seconds_per_token_est": self.draft_seconds_per_token() if self.verify.measured else None,
            "verify_seconds_est": v[1 : self.k_max + 2] if self.verify.measured else None,
            "plain_tokens_per_second_est": self.plain_tokens_per_second_est,
            "expected_tokens_per_second": self.last_rate if self.verify.measured else None,
        }


def expected_rates(
    acceptance, draft_seconds_per_token: float, verify_curve, round_seconds: float = 0.0, start_seconds: float = 0.0
) -> list[float]:
    """rate(k) = E(k) / (k c_draft + v(k+1) + c_round + c_start [k > 0]) for k = 0..len(acceptance);
    verify_curve[n] = seconds of a batch of n (index 0 unused)."""
    rates = [1.0 / (verify_curve[1] + round_seconds)]
    e, prod = 1.0, 1.0
    for k, a in enumerate(acceptance, start=1):
        prod *= a
        e += prod
        rates.append(e / (k * draft_seconds_per_token + verify_curve[k + 1] + round_seconds + start_seconds))
    return rates


def best_k(rates) -> int:
    """The k with the highest rate; ties (within 1e-12 relative) go to the smaller k, the cheaper round."""
    k, best = 0, rates[0]
    for i in range(1, len(rates)):
        if rates[i] > best * (1.0 + 1e-12):
            k, best = i, rates[i]
    return k
