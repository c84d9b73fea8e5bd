"""One round of the loop: a proposal in, the emitted tokens out, each half with its own seconds (docs/design.md,
"One round").

A round is drafting (drafting/proposer.py returns a `Proposal`), then `verify`: the target scores [pending, d_1..d_n]
in ONE decode, the chain processes its rows as the draft's were, and `accept_round` keeps the longest acceptable
prefix and picks one more token. `plain_step` is the round of the baselines (ar, draft-only): one token from one
model. Both return a `Step`, and neither touches anything the engine's loop owns (the text, the caches beyond
their own decode, the statistics, the policy): the loop does that with what the Step says (generation.py).
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fsd_local.kernels.accept import BY_FUZZY, Drafts, RoundOut, accept_round
from fsd_local.kernels.budget import stop_at
from fsd_local.kernels.emit import accept_tops, emit_one
from fsd_local.results import Emitted

if TYPE_CHECKING:
    from fsd_local.drafting.length import Source
    from fsd_local.generation import Generation
    from fsd_local.llama.model import Model

ORIGINS = ("target", "sd", "fuzzy")  # why each emitted token is there, by the kernel's reason code
NO_ROWS = np.zeros((0, 0), np.float32)  # a step whose token was picked on the device read no row


class Proposal(NamedTuple):
    """What drafting produced: `n` drafts in the round buffers `drafts` (the kernel's Drafts), who proposed them
    (a Source of drafting/length.py, None when nothing was drafted), the k the policy chose, the seconds drafting
    took (wall time: what the policy prices), of those the seconds spent catching up on skipped text (a probe's
    price, not the drafts'), and how many skipped positions that catch-up scored."""

    n: int
    drafts: Drafts
    source: Source | None
    k: int
    seconds: float
    catch_up: float = 0.0
    probed: int = 0


class Step(NamedTuple):
    """What a round did: the tokens it emitted (with their origins, log-probabilities, rescues), how many drafts
    were accepted, the batch the deciding model decoded and its seconds, that model's logit rows and the kernel's
    RoundOut (valid until that model's next decode), and the proposal verified (None for a plain step)."""

    emitted: Emitted
    accepted: int
    batch: int
    seconds: float
    rows: np.ndarray
    out: RoundOut
    proposal: Proposal | None = None


def verify(target: Model, g: Generation, proposal: Proposal) -> Step:
    """Score the proposal in one target decode and apply the acceptance rule."""
    n = proposal.n
    pending = g.seq[len(target.tokens) :]
    drafts = proposal.drafts.tokens[:n].tolist()
    if g.budget.bound > 0.0 and g.sampling.temperature <= 0.0:  # where a greedy round is decided whole, the
        stop_at(g.budget, g.ends_reply(drafts))  # budget's cap also holds at a draft that would end the reply
    t = perf_counter()
    target.decode(pending + drafts, f"from:{len(pending) - 1}")
    target.synchronize()
    seconds = perf_counter() - t
    if target.sampler.active:  # a greedy lossless round: each row's argmax, picked on the device (device_picks.py)
        for j in range(n + 1):
            g.out.top[j] = target.sampler.token(j - n - 1)
        rows = NO_ROWS
        accepted, nxt = accept_tops(proposal.drafts.tokens, n, g.out, g.budget)
    else:
        rows = target.logits(n + 1)
        g.chain.target_rows(rows, n)  # the same processing as the draft's rows had
        accepted, nxt = accept_round(
            rows, proposal.drafts, n, g.n_vocab, g.rule, g.sampling, g.uniforms(n + 1), g.out, g.budget
        )
    g.chain.settle(accepted, nxt)
    emitted = _emitted(drafts[:accepted] + [int(nxt)], g.out, accepted, n, g.want_logprobs)
    return Step(emitted, accepted, len(pending) + n, seconds, rows, g.out, proposal)


def plain_step(model: Model, g: Generation, origin: str) -> Step:
    """The baselines: one token from one model (the target for ar, the draft for draft-only)."""
    todo = g.seq[len(model.tokens) :]
    t = perf_counter()
    model.decode(todo, "last")
    model.synchronize()
    seconds = perf_counter() - t
    if model.sampler.active:  # picked on the device: no row comes to the host (device_picks.py)
        rows, tok = NO_ROWS, model.sampler.take()
    else:
        rows = model.logits(1)
        g.chain.target_rows(rows, 0)  # the same processing as every target row
        tok, _ = emit_one(rows[0], model.n_vocab, g.sampling, g.uniforms(1)[0], g.row_stats, g.out)
    g.chain.settle(0, tok)
    emitted = _emitted([int(tok)], g.out, 0, 0, g.want_logprobs)
    emitted.origins[0] = origin
    return Step(emitted, 0, len(todo), seconds, rows, g.out)


def _emitted(tokens: list[int], out: RoundOut, accepted: int, n_drafts: int, logprobs: bool) -> Emitted:
    """The round's tokens with what rides along: origins from the kernel's reasons, log-probabilities and top
    alternatives where asked, and (divergence, gap) for each rescued token."""
    reasons = out.reason[:accepted].tolist()
    origins = [ORIGINS[r] for r in reasons] + ["target"]
    rescues: list[tuple[float, float] | None] = [None] * len(tokens)
    for i, r in enumerate(reasons):
        if r == BY_FUZZY:
            rescues[i] = (float(out.divergence[i]), float(out.gap[i]))
    if not logprobs:
        return Emitted(tokens, origins, [], [], rescues, n_drafts)
    m = len(tokens)
    ids, top = out.top_ids[:m].tolist(), out.top_logprob[:m].tolist()
    tops = [[(i, v) for i, v in zip(ri, rv) if i >= 0] for ri, rv in zip(ids, top)]
    return Emitted(tokens, origins, out.logprob[:m].tolist(), tops, rescues, n_drafts)
