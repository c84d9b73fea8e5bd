"""The `auto` policy's estimates and choice for one source of drafts: the k in [0, k_max] with the highest
rate(k) = E(k) / (k c_draft + v(k + 1) + c_start + r R(k)), E(k) = 1 + a_1 + a_1 a_2 + ..., r R(k) what a
rejection makes a checkpointed target decode again (docs/design.md, "The cost model of `auto`")."""

from __future__ import annotations

import copy
import math

from fsd_local.drafting.verify_cost import VerifyCost

__all__ = ["CostModel", "VerifyCost", "best_k", "expected_rates"]

ACCEPT_PRIOR_FIRST = 0.7
ACCEPT_PRIOR_DECAY = 0.98
ACCEPT_PRIOR_WEIGHT = 2.0  # positions of evidence the cold-start prior is worth in the pooled rate
POSITION_WEIGHT = 8.0  # rounds of evidence the pooled rate is worth at each position
# the most positions of evidence a probe's value counts as known: however long the policy has watched, the text
# may have changed since (code being copied accepts far more than prose), so a rate near the break-even stays
# worth a cheap look
OPTIMISM = 1.0
OPTIMISM_FADE = 4.0
ACCEPT_MAX = 0.995
VOI_WEIGHT_CAP = 16.0
RECHECK = 8  # rounds a plain-step decision or a probe value is reused while the evidence is unchanged
MODEL_DRAFT_COST_PRIOR = 0.3  # seconds per draft token / seconds of one target decode, before measuring


class CostModel:
    """Online cost model and draft-length choice for one drafter (the module docstring):
    `CostModel(k_max=8, draft_cost_prior=0.0).choose_k()` for a free drafter (prompt lookup)."""

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
        self.optimism = OPTIMISM
        self.draft_cost_hint = 0.0  # seconds per draft token from a related measurement (a catch-up), until measured
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
        # what the last plain-step decision and probe value were computed from: while the evidence is the same,
        # a plain step is a plain step again (a catch-up price only grows, a limit only shrinks), and a probe's
        # value is its value per token of horizon times the horizon; the costs drift, so both are recomputed
        # every RECHECK rounds
        self._version = 0
        self._plain: tuple | None = None
        self._pv: tuple | None = None

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

    def forget_acceptance(self) -> None:
        """No acceptance evidence and no choices made: a fresh policy that keeps the measured costs."""
        self._acc = [0.0] * len(self._acc)
        self._seen = [0.0] * len(self._seen)
        self.k_histogram = [0] * len(self.k_histogram)
        self._zero_streak, self._probe_interval, self._probing = 0, self.probe_every, False
        self.rounds = self.probes = 0
        self._version += 1

    def forget_draft_cost(self) -> None:
        """No draft token timed and no hint: its cost is the prior again."""
        self._draft_mean, self._draft_weight, self.draft_cost_hint = 0.0, 0.0, 0.0
        self._version += 1

    def settings_changed(self, keep: float = 0.1) -> None:
        """Acceptance depends on tau, mode, divergence and temperature: keep only `keep` of its evidence (so a
        couple of rounds under the new settings dominate), keep every cost."""
        self._acc = [a * keep for a in self._acc]
        self._seen = [s * keep for s in self._seen]
        self._version += 1

    # ------------------------------------------------------------------ observations
    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        """Drafting n_tokens took `seconds` (0 or a few microseconds for ngram: pass what was measured)."""
        seconds = float(seconds)
        if n_tokens <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        self._draft_weight = self._draft_weight * self.decay + 1.0
        self._draft_mean += (seconds / n_tokens - self._draft_mean) / self._draft_weight
        self._version += 1

    def observe_verify(self, batch_n: int, seconds: float) -> None:
        """One target decode of batch_n tokens (k drafts + the pending token(s)); plain steps are batch_n = 1."""
        self.verify.observe(batch_n, seconds)

    def observe_acceptance(self, n_drafted: int, n_accepted: int, counterfactual: bool = False) -> None:
        """A round drafted n_drafted tokens and accepted the first n_accepted (the next one, if drafted, failed);
        counterfactual: scored afterwards against the text (a declined proposal), not a probe's outcome."""
        if n_drafted <= 0:
            return
        self._version += 1
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

    def observe_stream(self, accepted) -> None:
        """Teacher-forced evidence: accepted[i], whether the rule would have accepted the drafter's proposal at
        consecutive positions, fed as the rounds of k_max drafts a drafter would have run there (docs/design.md)."""
        i, n = 0, len(accepted)
        while i < n:
            j = i
            while j < min(n, i + max(1, self.k_max)) and accepted[j]:
                j += 1
            self.observe_acceptance(min(n, i + max(1, self.k_max)) - i, j - i, counterfactual=True)
            i = j + 1

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> list[float]:
        """Estimated a_j for positions 1..k_max (given j - 1 accepted): each position's decayed counts shrunk toward
        the pooled rate of all positions, itself shrunk toward the cold-start prior."""
        w0 = self.accept_prior_weight
        acc_all, seen_all = sum(self._acc), sum(self._seen)
        out = []
        for j in range(self.k_max):
            cold = self.accept_prior_first * self.accept_prior_decay**j
            pooled = (acc_all + w0 * cold) / (seen_all + w0)
            out.append((self._acc[j] + self.position_weight * pooled) / (self._seen[j] + self.position_weight))
        return out

    @property
    def draft_measured(self) -> bool:
        return self._draft_weight > 0

    @property
    def measured_draft_seconds(self) -> float:
        """The measured seconds per draft token (0: none measured)."""
        return self._draft_mean if self._draft_weight > 0 else 0.0

    def pooled(self) -> tuple[float, float]:
        """The pooled acceptance estimate of all positions and its weight in observed positions (the cold-start
        prior included): the mean and the evidence behind it."""
        w0 = self.accept_prior_weight
        acc_all, seen_all = sum(self._acc), sum(self._seen)
        return (acc_all + w0 * self.accept_prior_first) / (seen_all + w0), seen_all + w0

    def rate_at(self, a: float, k_limit: int | None = None) -> float:
        """The best expected tokens per second over k in 0..limit if every position accepted with chance a."""
        kmax = self.k_max if k_limit is None else max(0, min(self.k_max, k_limit))
        v = self.verify
        return max(expected_rates([a] * kmax, self.draft_seconds_per_token(), v.curve(kmax + 1), rework=v.rework()))

    def probe_value(self, m: int, horizon: float, k_limit: int | None = None) -> float:
        """Expected seconds saved over the next `horizon` tokens by scoring m more positions before choosing
        between plain steps and drafting (a preposterior value of information); 0 when no plausible acceptance
        makes drafting pay."""
        key = (self._version, m, k_limit)
        if self._pv is not None and self._pv[0] == key and self._pv[1] < RECHECK:
            self._pv = (key, self._pv[1] + 1, self._pv[2])
            return self._pv[2] * horizon
        per_token = self._probe_value(m, k_limit)
        self._pv = (key, 1, per_token)
        return per_token * horizon

    def _probe_value(self, m: int, k_limit: int | None) -> float:
        """probe_value per token of horizon (it is linear in the horizon)."""
        v1 = self.verify.seconds(1)
        value = 0.0
        for a, weight in self.belief(m):
            rate = self.rate_at(a, k_limit)
            if rate * v1 > 1.0:
                value += weight * (v1 - 1.0 / rate)
        return value

    def belief(self, m: int) -> list[tuple[float, float]]:
        """(acceptance, weight): what scoring m more positions may show the pooled acceptance to be (the estimate's
        uncertainty as those positions shrink it), at Gauss-Hermite nodes."""
        mu, w = self.pooled()
        w = min(w, VOI_WEIGHT_CAP)  # old evidence ages: acceptance follows the text, not only the pair
        sd = math.sqrt(max(mu * (1.0 - mu), 1e-4) / (w + 1.0) * m / (w + m))
        return [(min(max(mu + sd * z, 0.0), 0.999), weight) for z, weight in _NORMAL_NODES]

    def draft_seconds_per_token(self) -> float:
        """Measured mean, or the prior ratio times one target decode (relative units before any verify)."""
        if self._draft_weight > 0 and self.verify.measured:
            return self._draft_mean
        if self.draft_cost_hint > 0 and self.verify.measured:
            return self.draft_cost_hint
        return self.draft_cost_prior * self.verify.seconds(1)

    @property
    def plain_tokens_per_second_est(self) -> float:
        """1 / seconds of a single-token target decode, only where one was timed (a plain step, a probe's
        catch-up is not one, Engine.measure_costs): what `ar` does here, for the speed-up figure. 0 when
        none was: a figure read off the fitted curve is a prior, not a measurement, and is never shown as one."""
        if not self.verify.measured_at(1):
            return 0.0
        return 1.0 / self.verify.seconds(1)

    def rates(self, k_limit: int | None = None, start_seconds: float = 0.0) -> list[float]:
        """Expected tokens per second (per decode before measuring) of every k in 0..limit; start_seconds: what
        drafting at all costs this round (a draft model catching up on text it skipped), k > 0 only."""
        kmax = self.k_max if k_limit is None else max(0, min(self.k_max, k_limit))
        acc = self.acceptance()[:kmax]
        if self.optimism > 0:
            mu, w = self.pooled()
            bonus = self.optimism * math.sqrt(mu * (1.0 - mu) / (w + 1.0)) * min(1.0, OPTIMISM_FADE / w)
            acc = [min(a + bonus, ACCEPT_MAX) for a in acc]
        return expected_rates(
            acc,
            self.draft_seconds_per_token(),
            self.verify.curve(kmax + 1),
            start_seconds=start_seconds,
            rework=self.verify.rework(),
        )

    # ------------------------------------------------------------------ the choice
    def choose_k(self, k_limit: int | None = None, start_seconds: float = 0.0) -> int:
        """The k for this round (at most k_limit, e.g. the tokens still wanted minus one), re-probing
        periodically when the best is 0. start_seconds: see `rates`."""
        limit = self.k_max if k_limit is None else k_limit
        if not self.verify.measured_at(1):
            # every k is priced against a plain step, and no line through other batch sizes prices it well on a
            # CPU target (the wide demo target: read off its batches of 4..9, 104-134 ms against 31 ms timed,
            # and auto drafted a whole session at 0.93x plain decoding): the first round times one, at what ar
            # pays for a token
            self.rounds += 1
            self.k_histogram[0] += 1
            return 0
        p = self._plain
        if self.probe_every == 0 and p is not None and p[0] == self._version and p[1] < RECHECK:
            if limit <= p[2] and start_seconds >= p[3]:  # nothing that could make drafting pay has changed
                self._plain = (p[0], p[1] + 1, p[2], p[3])
                self.rounds += 1
                self.k_histogram[0] += 1
                return 0
        rates = self.rates(k_limit, start_seconds)
        k = best_k(rates)
        self.last_rate = rates[k]
        self._probing = False
        self._plain = (self._version, 1, limit, start_seconds) if k == 0 else None
        if k == 0 and len(rates) > 1 and self.probe_every > 0:
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


# Gauss-Hermite nodes and weights of a standard normal (7 points): expectations over an estimate's uncertainty
_NORMAL_NODES = tuple(
    zip(
        (-3.7504397, -2.3667594, -1.1544054, 0.0, 1.1544054, 2.3667594, 3.7504397),
        (0.000548269, 0.030757124, 0.240123178, 0.457142857, 0.240123178, 0.030757124, 0.000548269),
    )
)


def expected_rates(
    acceptance, draft_seconds_per_token: float, verify_curve, start_seconds: float = 0.0, rework: float = 0.0
) -> list[float]:
    """rate(k) = E(k) / (k c_draft + v(k+1) + c_start [k > 0] + rework R(k)) for k = 0..len(acceptance): the module
    docstring's, verify_curve[n] the seconds of a batch of n, start_seconds c_start (a draft model catching up),
    rework the seconds per token a checkpointed target decodes again (design.md, "The cost model of `auto`")."""
    rates = [1.0 / verify_curve[1]]
    e, prod, redo = 1.0, 1.0, 0.0
    for k, a in enumerate(acceptance, start=1):
        redo += prod * (1.0 - a) * k  # the first k-1 accepted, the k-th rejected: k tokens to decode again
        prod *= a
        e += prod
        rates.append(e / (k * draft_seconds_per_token + verify_curve[k + 1] + start_seconds + rework * redo))
    return rates


def best_k(rates) -> int:
    """The k with the highest rate; ties (within 1e-12 relative) go to the smaller k, the cheaper round."""
    k, best = 0, rates[0]
    for i in range(1, len(rates)):
        if rates[i] > best * (1.0 + 1e-12):
            k, best = i, rates[i]
    return k
