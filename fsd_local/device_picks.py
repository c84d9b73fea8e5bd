"""Which of a generation's picks llama.cpp's backend samplers make (llama/samplers.py): those the round reads
nothing of but the token, where the model samples on its device (samplers.wanted: a GPU build's default).

- ar and draft-only: every round is one model's plain step; greedy or a draw at the temperature on the device.
- a speculative greedy round of the lossless rule (sd, or a lossy mode at tau 0): the target's argmax of every
  row is the whole round (kernels/emit.py `accept_tops`), and its plain steps are argmaxes too; the draft's greedy
  picks wherever the kernel reads no draft row (drafting/proposer.py `rows_needed`).

Everything else reads rows on the host: a sampled SD test (p~ and q~ at the drafted token, the residual on a
rejection: kernels/dense.py), a divergence or a target rule's rescue, log-probabilities, and the chain's
penalties, bias and grammar (chain.py), whose processing the device's chain does not repeat. A generation's
choice is made once, at its start: attaching a sampler rebuilds the decode graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsd_local.drafting.proposer import rows_needed

if TYPE_CHECKING:
    from fsd_local.llama.model import Model
    from fsd_local.round import RoundContext


def plan(ctx: RoundContext, target: Model, draft: Model | None) -> None:
    """Attach each model's backend sampler for a generation's context, or detach it where the host reads rows."""
    s = ctx.settings
    host = ctx.chain.active or s.logprobs or s.top_logprobs > 0
    target_t = draft_t = None
    if s.mode == "ar":
        target_t = None if host else s.temperature
    elif s.mode == "draft-only":
        draft_t = None if host else s.temperature
    elif s.temperature <= 0.0 and not host:
        lossless = s.mode == "sd" or (s.mode != "fsd-paper" and s.tau == 0 and s.quality_budget is None)
        target_t = 0.0 if lossless else None
        draft_t = 0.0 if s.draft_p_min <= 0 and not rows_needed(ctx) else None
    target.sampler.use(target_t, s.seed)
    if draft is not None:
        draft.sampler.use(draft_t, s.seed)
