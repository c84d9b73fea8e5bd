"""How many tokens a round drafts under the settings' `draft_policy` (fixed, adaptive, auto), with one CostModel
per source of drafts sharing the target's VerifyCost; probes and shadows bring `auto` back from k = 0
(docs/design.md, "Drafting and the draft length")."""

from __future__ import annotations

from dataclasses import dataclass

from fsd_local.drafting.cost_model import MODEL_DRAFT_COST_PRIOR, VOI_WEIGHT_CAP, CostModel, VerifyCost, best_k
from fsd_local.kernels.names import TAU_MODES

# A source of drafts: (drafter, evidence class). The model drafter has one class; prompt lookup has one per match
# length bucket (ngram.match_class), because how far the text agrees before the match predicts acceptance far
# better than a pooled rate does: the policy drafts 8+ tokens into a copied block and none on a lone unigram hit.
Source = tuple[str, int]

K_LIMIT = 64  # settings' largest draft_max
# the acceptance a rule's evidence starts from (docs/design.md, "The acceptance prior"): a lossless rule accepts only
# the target's own pick (pairs: 0.5-0.9), a lossy one also what the divergence allows (the wide pair: sd 0.81, fsd js
# 0.05 0.90, js 0.2 0.99); low enough that sd explores long drafts only on evidence, high enough that two early
# rejections do not keep a lossy rule from drafting for the rest of a session
ACCEPT_PRIOR_LOSSLESS = 0.5
ACCEPT_PRIOR_LOSSY = 0.85
CATCH_UP_PRIOR = 0.5  # a catch-up batch's seconds per token / a drafted token's, before measuring
# the evidence (positions, the prior's included) from which a look's value is counted over this reply only; below
# it the next reply counts too, in proportion to how thin the evidence is (`DraftLength.look_horizon`)
NEXT_REPLY_EVIDENCE = 2.0 * VOI_WEIGHT_CAP
# a drafting round leaves the draft model at most this many tokens behind the text (the last draft it did not
# evaluate and the target's token); more means it skipped rounds and must catch up first
PENDING_MAX = 2


@dataclass
class CostTable:
    """Seconds a policy sees in place of the ones it measures (`DraftLength.prices`): verify[n] for a target
    decode of n tokens (index 0 unused; beyond the table, its last entry), draft per drafted token, catch_up per
    token the draft model evaluates after plain steps."""

    verify: list[float]
    draft: float
    catch_up: float = 0.0

    def v(self, n: int) -> float:
        return self.verify[min(n, len(self.verify) - 1)]


class DraftLength:
    def __init__(self) -> None:
        self.verify = VerifyCost(K_LIMIT + 1)
        self.costs: dict[Source, CostModel] = {}
        self._acceptance_key: tuple | None = None
        self._by_key: dict[tuple, dict[Source, CostModel]] = {}  # the evidence gathered under other settings
        self._catch_up_mean, self._catch_up_weight = 0.0, 0.0  # seconds per token the draft model catches up
        self.policy, self.k, self.k_min, self.k_max = "fixed", 4, 1, 4
        self.accept_prior = ACCEPT_PRIOR_LOSSLESS
        self._shadow: tuple[Source, list[int], int] | None = None  # (source, declined proposal, its position)
        self.written = 0  # tokens this reply's rounds have written (`look_horizon`)
        self._prices: CostTable | None = None

    @property
    def prices(self) -> CostTable | None:
        """Recorded costs that replace every cost one sequence's policy measures or loads from the store (a batch
        of several times its own decodes: BatchPrices, frozen in a test): what a test of the policy sets, so that
        what it decides hangs on the models' acceptance and these seconds, never on the host's load or the store."""
        return self._prices

    @prices.setter
    def prices(self, table: CostTable | None) -> None:
        # what was measured or loaded before is dropped, and every later observation reads the table instead
        self._prices = table
        if table is not None:
            self.verify.forget()
            for cm in self.costs.values():
                cm.forget_draft_cost()
            for costs in self._by_key.values():
                for cm in costs.values():
                    cm.forget_draft_cost()
            self._catch_up_mean, self._catch_up_weight = 0.0, 0.0

    def observe_batch(self, n: int, seconds: float) -> None:
        """A target decode of n tokens outside a round (timed at load, or stored) took `seconds`."""
        self.verify.observe(n, self._prices.v(n) if self._prices is not None else seconds)

    def observe_draft_token(self, seconds: float) -> None:
        """The draft model's decode of one token outside a round (timed at load, or stored) took `seconds`."""
        self.cost(("model", 0)).observe_draft(1, self._prices.draft if self._prices is not None else seconds)

    def start(self, settings) -> None:
        """A new generation: take its policy and bounds; forget acceptance evidence gathered under other rules."""
        key = (
            settings.mode,
            settings.divergence,
            settings.tau,
            settings.temperature,
            settings.divergence_topk,
            settings.typical_eps,
            settings.typical_alpha,
            settings.relaxed_k,
        )
        if self._acceptance_key is not None and key != self._acceptance_key:
            # settings seen before get their own evidence back (a bench alternating configurations, a chat
            # switching tau back and forth); new ones start from the current evidence, discounted
            self._by_key[self._acceptance_key] = self.costs
            known = self._by_key.get(key)
            if known is None:
                known = {source: cm.fork() for source, cm in self.costs.items()}
                for cm in known.values():
                    cm.settings_changed()
            self.costs = known
        self._acceptance_key = key
        self._shadow, self.written = None, 0
        self.accept_prior = accept_prior(settings)
        for cm in self.costs.values():
            cm.accept_prior_first = self.accept_prior
        self.policy, self.k = settings.draft_policy, settings.draft_max
        self.k_min, self.k_max = settings.draft_min, settings.draft_max

    def forget_acceptance(self) -> None:
        """The evidence of a freshly loaded engine: no acceptance seen under any settings. The measured costs
        (the target's batches, the drafters' tokens, the catch-up) are the machine's and stay."""
        for cm in self.costs.values():
            cm.forget_acceptance()
        self._by_key.clear()
        self._acceptance_key = None
        self._shadow = None

    def evidence(self) -> dict:
        """A copy of the acceptance evidence (per settings and source), for `restore`: a benchmark gives each
        configuration its own, as if each ran on its own engine."""
        copy = lambda costs: {src: cm.fork() for src, cm in costs.items()}  # noqa: E731
        return {
            "key": self._acceptance_key,
            "costs": copy(self.costs),
            "by_key": {k: copy(c) for k, c in self._by_key.items()},
        }

    def restore(self, evidence: dict | None) -> None:
        """Put back what `evidence` copied (None: a fresh engine's, `forget_acceptance`)."""
        if evidence is None:
            self.forget_acceptance()
            return
        self._acceptance_key, self.costs, self._by_key = evidence["key"], evidence["costs"], evidence["by_key"]
        self._shadow = None

    def cost(self, source: Source) -> CostModel:
        cm = self.costs.get(source)
        if cm is None:  # prompt lookup costs nothing to draft; the model's cost is learned from the first rounds
            prior = self.accept_prior
            if source[0] == "ngram":  # free: a plain step re-probes it now and then (its shadows score it too)
                cm = CostModel(self.k_max, verify=self.verify, draft_cost_prior=0.0, accept_prior_first=prior)
            else:  # probed through its catch-up instead (`probe`)
                cm = CostModel(
                    self.k_max,
                    verify=self.verify,
                    draft_cost_prior=MODEL_DRAFT_COST_PRIOR,
                    probe_every=0,
                    accept_prior_first=prior,
                )
            self.costs[source] = cm
        if cm.k_max != self.k_max:
            cm.set_k_max(self.k_max)
        return cm

    def choose(self, source: Source, limit: int, behind: int = 0) -> int:
        """The k for this round, at most `limit` (tokens still wanted, room in the context). `behind`: tokens the
        drafter must evaluate before it can draft (the draft model after plain steps)."""
        if self.policy != "auto":
            return max(0, min(self.k, limit))
        cm = self.cost(source)
        # a draft model that skipped rounds must first evaluate the text it missed: drafting this round costs
        # that too, so the policy does not flip between plain steps and marginal drafts, paying a catch-up at
        # every switch (once caught up, a round that drafts again has only its own tokens to evaluate)
        catch_up = self.catch_up_seconds(behind, cm) if behind > PENDING_MAX else 0.0
        return cm.choose_k(max(0, limit), start_seconds=catch_up)

    def follows_prompt(self, source: Source) -> bool:
        """Whether the drafter should evaluate a new prompt before the first round: not where `auto` knows what
        its tokens and the target's steps cost and no k pays at the current evidence with it current (then the
        prompt is text it skipped: a round that drafts catches up first, at a price `choose` counts)."""
        if self.policy != "auto" or source not in self.costs or not self.verify.measured_at(1):
            return True
        cm = self.cost(source)  # at this generation's k_max
        if not cm.draft_measured and cm.draft_cost_hint <= 0:
            return True  # the prompt's batch is what prices the draft's tokens
        return best_k(cm.rates()) > 0

    def probe(self, source: Source, behind: int, scorable: int, horizon: int) -> bool:
        """After plain steps: whether to catch the drafter up on the `behind` tokens it skipped now, scoring the
        `scorable` positions whose target rows were kept, because what they would tell is worth more over the
        tokens they serve (`look_horizon`, `horizon` of them left in this reply) than the catch-up costs."""
        if self.policy != "auto" or scorable <= 0 or behind <= PENDING_MAX:
            return False
        cm = self.cost(source)
        return cm.probe_value(scorable, self.look_horizon(horizon, cm)) > self.catch_up_seconds(behind, cm)

    def look_horizon(self, left: int, cm: CostModel) -> float:
        """The tokens a look's evidence serves: the `left` of this reply and, while the evidence is thinner than
        NEXT_REPLY_EVIDENCE, a share of a next reply as long as this one (docs/design.md, "Looking again")."""
        thin = max(0.0, 1.0 - cm.pooled()[1] / NEXT_REPLY_EVIDENCE)
        return left + thin * (self.written + left)

    def observe_stream(self, source: Source, accepted) -> None:
        """Scored positions of skipped text (`CostModel.observe_stream`)."""
        if accepted is not None and len(accepted):
            self.cost(source).observe_stream(accepted)

    def shadow(self, source: Source, proposal: list[int], position: int) -> None:
        """A free drafter proposed `proposal` for text position `position` and the round drafted none of it:
        score it later against the text (`score_shadow`), unless a shadow is already open."""
        if self._shadow is None and proposal and self.policy == "auto":
            self._shadow = (source, list(proposal), position)

    def score_shadow(self, seq) -> None:
        """Score the open shadow against the text so far once its outcome is known: at the first token the
        target wrote differently, or when every proposed token is matched."""
        if self._shadow is None:
            return
        source, proposal, pos = self._shadow
        known = len(seq) - pos
        if known < 0:  # the text was rewound below the proposal: nothing to score
            self._shadow = None
            return
        m = 0
        while m < len(proposal) and m < known and proposal[m] == seq[pos + m]:
            m += 1
        if m == len(proposal) or m < known:  # all matched, or the target wrote seq[pos + m] instead
            self.cost(source).observe_acceptance(len(proposal), m, counterfactual=True)
            self._shadow = None

    def catch_up_seconds(self, n_tokens: int, cm: CostModel) -> float:
        """Estimated seconds for the draft model to evaluate n_tokens it missed, in one batch: measured, or
        before any catch-up was seen, CATCH_UP_PRIOR of its cost per drafted token (a batch is cheaper per token
        than one-by-one decoding)."""
        per_token = self._catch_up_mean if self._catch_up_weight > 0 else CATCH_UP_PRIOR * cm.draft_seconds_per_token()
        return n_tokens * per_token

    @property
    def measured_catch_up_seconds(self) -> float:
        """The measured seconds per caught-up token (0: none measured)."""
        return self._catch_up_mean if self._catch_up_weight else 0.0

    def observe_catch_up(self, n_tokens: int, seconds: float) -> None:
        """The draft model evaluated n_tokens it had missed (one batch) in `seconds`."""
        if self._prices is not None:
            seconds = n_tokens * self._prices.catch_up
        if n_tokens > 1 and seconds > 0:
            self._catch_up_weight = self._catch_up_weight * 0.8 + 1.0
            self._catch_up_mean += (seconds / n_tokens - self._catch_up_mean) / self._catch_up_weight
            # until the draft model has drafted, its cost per token is read off its batches
            self.cost(("model", 0)).draft_cost_hint = self._catch_up_mean / CATCH_UP_PRIOR

    def observe(
        self,
        source: Source | None,
        n_drafted: int,
        n_accepted: int,
        draft_seconds: float,
        batch: int,
        verify_seconds: float,
    ) -> None:
        """One round: what was drafted (by `source`) and accepted, what drafting cost, and the target's decode of
        `batch` tokens that verified it (or, with nothing drafted, that was a plain step)."""
        if self._prices is not None:
            verify_seconds, draft_seconds = self._prices.v(batch), n_drafted * self._prices.draft
        self.verify.observe(batch, verify_seconds)
        self.written += n_accepted + 1
        if source is None or not n_drafted:
            return
        cm = self.cost(source)
        cm.observe_draft(n_drafted, draft_seconds)
        cm.observe_acceptance(n_drafted, n_accepted)
        if self.policy == "adaptive":
            self.k = min(self.k + 2, self.k_max) if n_accepted == n_drafted else max(self.k - 1, self.k_min)

    @property
    def plain_tokens_per_second_est(self) -> float:
        """1 / the target's seconds for a one-token decode, only where this engine timed one; 0 otherwise (a rate
        read off the fitted curve would be a prior shown as a measurement)."""
        return 1.0 / self.verify.seconds(1) if self.verify.measured_at(1) else 0.0


def accept_prior(settings) -> float:
    """The acceptance a policy assumes before evidence under `settings`: a lossy rule's (a tau-moded rule with a
    positive tau or a quality budget) or a lossless one's (sd, or tau 0)."""
    lossy = settings.mode in TAU_MODES and (settings.tau > 0 or settings.quality_budget is not None)
    return ACCEPT_PRIOR_LOSSY if lossy else ACCEPT_PRIOR_LOSSLESS
