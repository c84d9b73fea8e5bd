"""The statistics every generation returns (docs/generation.md, "Statistics")."""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from fsd_local.kernels.names import CAPPED, REFUSED, ROUNDS, TAU, TAU_MAX, TAU_MIN, TAU_SUM  # no numba there

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
PHASES = ("draft", "verify", "policy", "advance")


@dataclass
class Stats:
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted_sd: int = 0
    accepted_fuzzy: int = 0
    forced: int = 0  # tokens the grammar forced, proposed without a drafter (not in drafted) and verified
    forced_accepted: int = 0  # of those, the tokens the target's verification kept in the reply
    target_calls: int = 0
    prompt_tokens: int = 0
    prompt_evaluated: int = 0  # prompt tokens actually decoded (the rest came from the reused prefix)
    seconds_draft: float = 0.0
    seconds_target: float = 0.0
    seconds_total: float = 0.0  # from the end of prompt processing to the last token
    prompt_seconds: float = 0.0
    logprob_sum: float = 0.0
    logprob_count: int = 0
    by_position_drafted: list = field(default_factory=list)
    by_position_accepted: list = field(default_factory=list)
    divergences: list = field(default_factory=list)
    k_histogram: list = field(default_factory=list)  # rounds by the draft length chosen (0 = a plain step)
    probed: int = 0  # positions of skipped text the draft model was scored on when it caught up (drafting/length.py)
    loss_sum: float = 0.0  # target log-probability given up (kernels/budget.py), over the emitted tokens
    not_chosen: int = 0  # rescued tokens with a positive loss (or NaN): the target would not have chosen them
    loss_unknown: bool = False  # a rescue whose loss is NaN (a NaN row): loss_sum is then unknown
    # wall seconds of each phase of the speculative rounds (drafting, verifying, the policy's bookkeeping) and of
    # the loop's work after every round (advance): with the seconds inside each model, the loop's own time
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    verify_by_batch: dict = field(default_factory=dict)  # target batch size n -> [decodes, seconds] (the oracle's)

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds

    def start_clock(self, target, draft) -> _Clock:
        """Time the loop from now: wall seconds, and those inside each model's decodes (their own counters)."""
        return _Clock(self, target, draft)

    def record_verify(self, n: int, seconds: float) -> None:
        """One target decode of n tokens in the loop (a verification, or a plain step for n = 1)."""
        c = self.verify_by_batch.setdefault(int(n), [0, 0.0])
        c[0] += 1
        c[1] += float(seconds)

    def record_k(self, k: int) -> None:
        if k >= len(self.k_histogram):
            self.k_histogram.extend([0] * (k + 1 - len(self.k_histogram)))
        self.k_histogram[k] += 1

    def record(self, step, kept: int) -> None:
        """One round (round.py `Step`) of which the first `kept` emitted tokens are the reply's (a round may
        accept drafts after the token that ends it)."""
        p, out = step.proposal, step.out
        if p is None:  # a plain step: ar (the target decided) or draft-only
            self.rounds += 1
            self.tokens += 1
            if step.decoder == "draft":
                return
            self.target_calls += 1
            self.record_verify(step.batch, step.seconds)
            if out.logprob.shape[0]:
                self.logprob_sum += float(out.logprob[0])
                self.logprob_count += 1
            return
        self.record_verify(step.batch, step.seconds)
        self.record_k(p.k)
        self.probed += p.probed
        ph = self.phases
        ph["draft"], ph["verify"] = ph["draft"] + p.seconds, ph["verify"] + step.wall
        emitted = min(step.accepted + 1, kept)
        self.record_round(p.n, out.reason, out.divergence, out.logprob, emitted, step.loss, p.forced)

    def record_round(self, n_drafts, reasons, divs, logprobs, emitted, losses, forced=None):
        """One round: reasons/divs are the kernel's per-slot arrays, logprobs (empty: not computed) and losses
        the emitted tokens'; `forced` flags the slots the grammar forced (None: none), counted apart from the
        drafter's (their acceptance is not the drafter's)."""
        self.rounds += 1
        self.target_calls += 1
        for i in range(n_drafts):
            r = reasons[i]
            if forced is not None and forced[i]:
                self.forced += 1
                self.forced_accepted += bool(r) and i < emitted
                continue
            if i >= len(self.by_position_drafted):
                grow = i + 1 - len(self.by_position_drafted)
                self.by_position_drafted.extend([0] * grow)
                self.by_position_accepted.extend([0] * grow)
            self.drafted += 1
            self.by_position_drafted[i] += 1
            if r:
                self.by_position_accepted[i] += 1
                if r == 1:
                    self.accepted_sd += 1
                else:
                    self.accepted_fuzzy += 1
            d = divs[i]
            if d == d:
                self.divergences.append(float(d))
        if len(logprobs):
            self.logprob_sum += float(np.sum(logprobs[:emitted]))
            self.logprob_count += emitted
        for j in range(emitted):
            loss = float(losses[j])
            if loss == loss:
                self.loss_sum += loss
            else:
                self.loss_unknown = True
            # a rescue's token; under a sampled budget every slot where it may rescue costs, whatever it emits
            self.not_chosen += j < n_drafts and reasons[j] == 2 and not loss <= 0.0  # (the extra token: REJECTED)
        self.tokens += emitted

    @property
    def accepted(self) -> int:
        return self.accepted_sd + self.accepted_fuzzy

    def budget_dict(self, b=None) -> dict:
        """The budget B (None: none), the loss spent per token, the share of tokens the target would not have
        chosen, and how the budget `b` (a kernels.budget.Budget) moved its threshold (None without a budget)."""
        n = self.tokens
        on = b is not None and b.bound >= 0.0
        st = b.state if on else None
        rounds = st[ROUNDS] if st is not None else 0.0
        return {
            "quality_budget": float(b.bound) if on else None,
            "loss_per_token": None if self.loss_unknown else (self.loss_sum / n if n else 0.0),
            "loss_sum": None if self.loss_unknown else self.loss_sum,
            "not_chosen_share": self.not_chosen / n if n else 0.0,
            "threshold": {
                "mean": float(st[TAU_SUM] / rounds),
                "min": float(st[TAU_MIN]),
                "max": float(st[TAU_MAX]),
                "last": float(st[TAU]),
            }
            if st is not None and rounds
            else None,
            "rescues_refused": int(st[REFUSED]) if st is not None else 0,
            "rescues_capped": int(st[CAPPED]) if st is not None else 0,
        }

    def to_dict(self, budget=None) -> dict:
        """Plain numbers; `budget`: the reply's kernels.budget.Budget, if it ran under one."""
        other = max(0.0, self.seconds_total - self.seconds_draft - self.seconds_target)
        divs = np.asarray(self.divergences, dtype=np.float64)
        finite = divs[np.isfinite(divs)]
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted_sd": self.accepted_sd,
            "accepted_fuzzy": self.accepted_fuzzy,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "fuzzy_share": self.accepted_fuzzy / self.accepted if self.accepted else 0.0,
            "mean_tokens_per_round": self.tokens / self.rounds if self.rounds else 0.0,
            "target_calls": self.target_calls,
            "forced": self.forced,
            "forced_accepted": self.forced_accepted,
            "forced_share": self.forced_accepted / self.tokens if self.tokens else 0.0,
            "acceptance_by_position": [
                a / d if d else 0.0 for a, d in zip(self.by_position_accepted, self.by_position_drafted)
            ],
            "drafted_by_position": list(self.by_position_drafted),
            "accepted_by_position": list(self.by_position_accepted),
            "k_histogram": list(self.k_histogram),
            "probed": self.probed,
            "verify_by_batch": [[n, c, t] for n, (c, t) in sorted(self.verify_by_batch.items())],
            "divergence_quantiles": {f"q{int(q * 100)}": float(np.quantile(finite, q)) for q in QUANTILES}
            if finite.size
            else {},
            "divergences_computed": int(divs.size),
            # the target's log-probability of the emitted tokens, where it was computed (logprobs asked)
            "target_logprob_mean": self.logprob_sum / self.logprob_count if self.logprob_count else None,
            "target_logprob_sum": self.logprob_sum if self.logprob_count else None,
            "seconds": {"draft": self.seconds_draft, "target": self.seconds_target, "other": other},
            "phase_seconds": dict(self.phases),
            "seconds_total": self.seconds_total,
            "prompt_tokens": self.prompt_tokens,
            "prompt_evaluated": self.prompt_evaluated,
            "prompt_seconds": self.prompt_seconds,
            "tokens_per_second": self.tokens / self.seconds_total if self.seconds_total > 0 else 0.0,
            **self.budget_dict(budget),
        }


class _Clock:
    """The generation's seconds since the loop began: in all, and inside each model's llama.cpp calls (the rest,
    `other`, is the loop's own time)."""

    def __init__(self, stats: Stats, target, draft) -> None:
        self.stats, self.target, self.draft = stats, target, draft
        self.t0 = perf_counter()
        self.target0 = target.decode_seconds
        self.draft0 = draft.decode_seconds if draft is not None else 0.0

    def tick(self, advance: float) -> None:
        """A round and its bookkeeping are done (advance: the seconds of Generation.advance)."""
        st = self.stats
        st.phases["advance"] += advance
        st.seconds_total = perf_counter() - self.t0
        st.seconds_target = self.target.decode_seconds - self.target0
        st.seconds_draft = self.draft.decode_seconds - self.draft0 if self.draft is not None else 0.0
