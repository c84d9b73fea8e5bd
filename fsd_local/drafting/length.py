"""How many tokens to draft each round, under the settings' `draft_policy` (FSD.md, "Drafters and draft length").

- `fixed`: draft_max every round (llama.cpp's draft_p_min may still stop the model drafter early).
- `adaptive`: HF's rule: +2 after a fully accepted round, -1 after a rejection, within [draft_min, draft_max].
- `auto`: the k in [0, draft_max] that maximises expected tokens per second under the measured costs
  (cost_model.py); k = 0 is a plain target step, and the cost model re-probes so it can come back.

One `DraftLength` lives as long as its engine: the target's costs are measured on every target decode whatever
the policy (so every generation can report the measured plain-decoding rate), each drafter (`model`, `ngram`)
has its own acceptance and drafting costs, and a change of tau, mode, divergence or temperature between calls
discounts the old acceptance evidence but keeps the costs.
"""

from __future__ import annotations

from fsd_local.drafting.cost_model import MODEL_DRAFT_COST_PRIOR, CostModel, VerifyCost

K_LIMIT = 64  # settings' largest draft_max


class DraftLength:
    def __init__(self) -> None:
        self.verify = VerifyCost(K_LIMIT + 1)
        self.costs: dict[str, CostModel] = {}
        self._acceptance_key: tuple | None = None
        self.policy, self.k, self.k_min, self.k_max = "fixed", 4, 1, 4

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
            for cm in self.costs.values():
                cm.settings_changed()
        self._acceptance_key = key
        self.policy, self.k = settings.draft_policy, settings.draft_max
        self.k_min, self.k_max = settings.draft_min, settings.draft_max

    def cost(self, drafter: str) -> CostModel:
        cm = self.costs.get(drafter)
        if cm is None:  # prompt lookup costs nothing to draft; the model's cost is learned from the first rounds
            prior = 0.0 if drafter == "ngram" else MODEL_DRAFT_COST_PRIOR
            cm = CostModel(self.k_max, verify=self.verify, draft_cost_prior=prior)
            self.costs[drafter] = cm
        if cm.k_max != self.k_max:
            cm.set_k_max(self.k_max)
        return cm

    def choose(self, drafter: str, limit: int) -> int:
        """The k for this round, at most `limit` (tokens still wanted, room in the context)."""
        if self.policy == "auto":
            return self.cost(drafter).choose_k(max(0, limit))
        return max(0, min(self.k, limit))

    def observe(
        self, drafter: str | None, n_drafted: int, n_accepted: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        """One round: what was drafted and accepted, and what the draft and the verification cost."""
        self.verify.observe(n_drafted + 1, verify_seconds)
        if drafter is None or not n_drafted:
            return
        cm = self.cost(drafter)
        cm.observe_draft(n_drafted, draft_seconds)
        cm.observe_acceptance(n_drafted, n_accepted)
        if self.policy == "adaptive":
            self.k = min(self.k + 2, self.k_max) if n_accepted == n_drafted else max(self.k - 1, self.k_min)

    @property
    def plain_tokens_per_second_est(self) -> float:
        """1 / the target's seconds for a one-token decode: measured where the loop took plain steps, else read
        off the fitted verification-cost curve. 0 before any target decode."""
        return 1.0 / self.verify.seconds(1) if self.verify.measured else 0.0
