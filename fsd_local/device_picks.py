"""Which of a generation's picks llama.cpp's backend samplers make (llama/samplers.py): those of which the round
reads nothing but the token, decided once at the generation's start (docs/design.md, "Where the time goes")."""

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
