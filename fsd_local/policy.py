"""The policy state an engine keeps across calls, with one owner: the draft length's evidence and measured costs
(DraftLength), those costs on disk (CostStore) and the gains quality budgets settled on (Budgets)."""

from __future__ import annotations

from fsd_local.drafting.calibration import CostStore, measure_costs, snapshot
from fsd_local.drafting.length import DraftLength
from fsd_local.kernels.budget import Budget, Budgets
from fsd_local.kernels.names import SPECULATIVE_MODES
from fsd_local.llama.model import Model
from fsd_local.round import Step, slots
from fsd_local.settings import Settings


class Policy:
    """Built, updated (`observe`, every round), saved and restored here. Drafting asks `length` for each
    round's k and tells it what a catch-up measured; nothing else reads or writes the state."""

    def __init__(self, store: CostStore | None = None, redecode: bool = False) -> None:
        """redecode: the target goes back to a checkpoint after a rejection (priced: VerifyCost.rework)."""
        self.length = DraftLength()
        self.length.verify.redecode = redecode
        self._budgets = Budgets()
        self._store = store
        if store is not None:
            store.load(self.length)

    def start(self, s: Settings) -> Budget:
        """A new generation under `s`: the draft length takes its settings; returns the reply's budget."""
        if s.mode in SPECULATIVE_MODES:
            self.length.start(s)
        return self._budgets.start(s, slots(s))

    def observe(self, step: Step) -> None:
        """A round: the target's decode it timed (a plain step, or the verification of what was drafted) and
        what drafting cost and accepted. A draft-only step tells nothing."""
        if step.decoder != "target":
            return
        p = step.proposal
        if p is None:
            self.length.observe(None, 0, 0, 0.0, step.batch, step.seconds)
        else:
            n, accepted = p.drafter_counts(step.accepted)  # what the grammar forced is no drafter's evidence
            self.length.observe(p.source, n, accepted, p.seconds - p.catch_up, step.batch, step.seconds)

    def observe_prompt(self, n_tokens: int, seconds: float) -> None:
        """The draft model evaluated a prompt of n_tokens in one go: its batches price its tokens before it drafts."""
        self.length.observe_catch_up(n_tokens, seconds)

    def draft_follows_prompt(self) -> bool:
        """Whether the draft model evaluates a new prompt at once (DraftLength.follows_prompt)."""
        return self.length.follows_prompt(("model", 0))

    @property
    def plain_rate(self) -> float:
        """Tokens per second of a timed one-token target decode (0: none timed)."""
        return self.length.plain_tokens_per_second_est

    def evidence(self) -> dict:
        """A copy of what was learned about acceptance under each setting and the budgets' gains (`restore`)."""
        return {"lengths": self.length.evidence(), "budgets": self._budgets.copy()}

    def restore(self, evidence: dict | None) -> None:
        """Put back an `evidence` copy, or with None forget it all as a fresh engine would; costs stay."""
        self.length.restore(None if evidence is None else evidence["lengths"])
        self._budgets = Budgets() if evidence is None else evidence["budgets"].copy()

    def costs(self) -> dict:
        """The measured costs as the store keeps them: seconds per batch size, per draft and caught-up token."""
        return snapshot(self.length)

    def measure(self, target: Model, draft: Model | None, n_hi: int, token: int) -> float:
        """Time what is not measured yet (calibration.py `measure_costs`) and save it; returns the seconds."""
        seconds = measure_costs(self.length, target, draft, n_hi, token)
        self.save()
        return seconds

    def save(self) -> None:
        """Write the measured costs to the store (it writes only what is new, or now and then)."""
        if self._store is not None:
            self._store.save(self.length)
