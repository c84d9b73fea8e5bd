"""One round of one sequence: its `RoundContext` in, a `Proposal` verified in one target decode, a `Step` out
(docs/design.md, "One round"). A batch of sequences calls the pieces: `target_input`, its own decode, `judge`
(`judge_tops` where the device picked each row's argmax)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fsd_local.chain import Chain
from fsd_local.kernels.accept import (
    BY_FUZZY,
    FORCED,
    Drafts,
    RoundOut,
    Rule,
    Sampling,
    accept_round,
    round_out,
    rule_of,
    sampling_of,
)
from fsd_local.kernels.budget import Budget, stop_at
from fsd_local.kernels.dense import new_summaries
from fsd_local.kernels.emit import accept_tops, emit_one
from fsd_local.kernels.sampling import KEPT_MAX
from fsd_local.kernels.typed import Typed
from fsd_local.results import Emitted
from fsd_local.settings import Settings

if TYPE_CHECKING:
    from fsd_local.llama.model import Model

ORIGINS = ("target", "sd", "fuzzy")  # why each emitted token is there, by the kernel's reason code
NO_LOSS = np.zeros(0)
NO_ROWS = np.zeros((0, 0), np.float32)  # a step whose token was picked on the device read no row
# tokens a grammar forces that one round may propose besides its drafts: a long literal is verified over several
# rounds, each target decode at most draft_max + FORCED_MAX tokens past the pending text
FORCED_MAX = 16


def slots(s: Settings) -> int:
    """The most slots a round of these settings proposes: its drafts, and under a constraint with jump_forward
    the tokens the grammar forces."""
    jump = s.jump_forward and (s.grammar is not None or s.json_schema is not None)
    return s.draft_max + (FORCED_MAX if jump else 0)


def rewind_options(s: Settings) -> tuple[dict, dict]:
    """How the target and the draft ask to rewind a recurrent state (ModelOptions): the target's snapshots hold its
    largest verify batch (its slots and one); either takes a checkpoint where it gets none."""
    return {"n_rs_seq": slots(s) + 1, "checkpoint": True}, {"checkpoint": True}


class Buffers(NamedTuple):
    """A round's arrays, made once for a draft length and reused: the drafts the kernel reads, what it writes,
    and a plain step's row statistics."""

    drafts: Drafts
    out: RoundOut
    row_stats: np.ndarray


def new_buffers(k: int, n_vocab: int, n_top: int = 0, logprobs: bool = True) -> Buffers:
    """Buffers for up to k drafts over n_vocab tokens, reporting n_top alternatives and (logprobs) each emitted
    token's log-probability."""
    drafts = Drafts(
        rows=np.empty((k, n_vocab), np.float32),
        tokens=np.empty(k, np.int32),
        prob=np.empty(k),
        stats=np.zeros((k + 1, 3), np.float32),
        onehot=np.zeros(k, np.uint8),
        kept=np.empty((k, KEPT_MAX), np.int64),
        kept_n=np.full(k, -1, np.int64),
        summary=new_summaries(1)[0],
        lossless=np.zeros(k, np.uint8),
    )
    return Buffers(drafts, round_out(k, n_top, logprobs), np.zeros(3, np.float32))


class Uniforms:
    """A sequence's random stream: the uniforms each draw of a round reads (zeros when greedy: never read)."""

    def __init__(self, seed: int | None, size: int, sampled: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.sampled = sampled
        self._buf = np.zeros(size)

    def take(self, n: int) -> np.ndarray:
        """n uniforms, valid until the next take."""
        u = self._buf[:n]
        if self.sampled:
            self.rng.random(out=u)
        return u

    def pairs(self, n: int) -> np.ndarray:
        """(n, 2) uniforms: a scored slot's SD test and rescue."""
        return self.rng.random((n, 2)) if self.sampled else np.zeros((n, 2))


@dataclass(eq=False)
class RoundContext:
    """What a round reads of one sequence and the state it moves on (chain, budget, random stream, buffers).
    Its owner keeps `seq` (the accepted text) and `room` (drafts this round may propose) current."""

    settings: Settings
    seq: Sequence[int]
    n_vocab: int  # the vocabulary the rule works on (shared by both models)
    rule: Rule
    sampling: Sampling
    chain: Chain
    budget: Budget
    buffers: Buffers
    random: Uniforms
    logprobs: bool  # the request asked for each emitted token's log-probability
    ends_reply: Callable[[Sequence[int]], int | None]  # the first of these drafts that would end the reply
    room: int = 0
    draws: tuple | None = None  # drafting's reading of the settings for its draws, made at its first round
    typed: Typed = field(default_factory=Typed, init=False, repr=False)  # the round's kernels, typed once

    @classmethod
    def start(cls, s: Settings, seq, n_vocab: int, chain: Chain, budget: Budget, buffers: Buffers, ends_reply):
        sampling = sampling_of(s)
        uniforms = Uniforms(s.seed, len(buffers.out.gap), sampling.temperature > 0)
        logprobs = buffers.out.logprob.shape[0] > 0
        return cls(s, seq, n_vocab, rule_of(s), sampling, chain, budget, buffers, uniforms, logprobs, ends_reply)


class Proposal(NamedTuple):
    """What drafting wrote into the context's draft buffers: n drafts by `source` (None: no drafter proposed), the
    k chosen, drafting's and catch-up's wall seconds, how many positions catch-up scored, and which slots the
    grammar forced (None: none)."""

    n: int
    source: tuple[str, int] | None
    k: int
    seconds: float
    catch_up: float = 0.0
    probed: int = 0
    forced: np.ndarray | None = None

    def drafter_counts(self, accepted: int) -> tuple[int, int]:
        """(slots the drafter proposed, of them those among the first `accepted`): forced slots aside."""
        if self.forced is None:
            return self.n, accepted
        return self.n - int(self.forced.sum()), accepted - int(self.forced[:accepted].sum())


def force(ctx: RoundContext, at: int, used: int) -> list[int]:
    """Write the tokens the grammar forces after this round's first `at` slots into slots at.. of the draft
    buffers (pushed into the chain), at most FORCED_MAX - `used` and never past the round's room: [] without
    jump_forward or where the grammar leaves a choice. The target judges them exactly (kernels/accept.py)."""
    run = ctx.chain.force(min(FORCED_MAX - used, ctx.room - at))
    d = ctx.buffers.drafts
    for j, tok in enumerate(run, at):
        d.tokens[j], d.prob[j], d.onehot[j] = tok, 1.0, FORCED
        d.stats[j] = 0.0  # a one-hot row's (max, cut-off, log-normaliser), as prompt lookup's
    return run


def forced_flags(ctx: RoundContext, n: int) -> np.ndarray | None:
    """Which of a proposal's n slots the grammar forced (None: no jump_forward)."""
    return ctx.buffers.drafts.onehot[:n] == FORCED if ctx.chain.jump else None


def forced_run(ctx: RoundContext) -> Proposal | None:
    """`ar`'s proposal: the tokens the grammar forces, verified as a batch of their own (None: nothing forced)."""
    t0 = perf_counter()
    n = len(force(ctx, 0, 0))
    return Proposal(n, None, 0, perf_counter() - t0, forced=forced_flags(ctx, n)) if n else None


class Step(NamedTuple):
    """What a round did: the emitted tokens (origins, log-probabilities, rescues), the drafts accepted, each
    emitted token's loss, the batch decoded, its seconds and the round's wall seconds, the deciding model's rows
    and the kernel's output (valid until that model's next decode), and the proposal (None: a plain step)."""

    emitted: Emitted
    accepted: int
    loss: np.ndarray
    batch: int
    seconds: float
    wall: float
    rows: np.ndarray
    out: RoundOut
    proposal: Proposal | None = None
    decoder: str = "target"  # the model that decided: the target, or the draft (draft-only)


class TargetInput(NamedTuple):
    """What one sequence adds to a target decode: the pending text, then the drafts, from position `pos`;
    its rows are those from tokens[first_row] on (the last pending token's, then each draft's)."""

    tokens: list[int]
    pos: int
    first_row: int

    @property
    def rows(self) -> int:
        return len(self.tokens) - self.first_row


def target_input(ctx: RoundContext, cached: int, proposal: Proposal) -> TargetInput:
    """The target's input for this proposal, its cache holding the first `cached` tokens of the text."""
    pending = list(ctx.seq[cached:])
    return TargetInput(pending + ctx.buffers.drafts.tokens[: proposal.n].tolist(), cached, len(pending) - 1)


def judge(ctx: RoundContext, proposal: Proposal, rows: np.ndarray, batch: int, seconds: float, t0: float) -> Step:
    """The acceptance rule on the target's rows for this proposal (decoded in a batch of `batch` tokens in
    `seconds`, the round's verification begun at perf_counter() t0)."""
    n, drafts, out = proposal.n, ctx.buffers.drafts, ctx.buffers.out
    tokens = drafts.tokens[:n].tolist()
    end = ctx.ends_reply(tokens)
    # only the lossless test may end a reply: a rescued end of generation (or stop string) would cut it where
    # the target writes on (docs/design.md, "The acceptance rules")
    drafts.lossless[:n] = 0
    if end is not None:
        drafts.lossless[end] = 1
    if ctx.budget.bound > 0.0 and ctx.sampling.temperature <= 0.0:  # a greedy round is decided whole: the
        stop_at(ctx.budget, end)  # budget's cap also holds at a draft that would end the reply
    ctx.chain.target_rows(rows, n)  # the same processing as the draft's rows had
    u = ctx.random.take(n + 1)
    accepted, nxt = ctx.typed.call(
        accept_round, rows, drafts, n, ctx.n_vocab, ctx.rule, ctx.sampling, u, out, ctx.budget
    )
    ctx.chain.settle(accepted, nxt)
    emitted = _emitted(tokens[:accepted] + [int(nxt)], out, accepted, n, ctx.logprobs)
    if proposal.forced is not None:
        for i in np.flatnonzero(proposal.forced[:accepted]):
            emitted.origins[i] = "forced"
    loss = ctx.budget.loss[: accepted + 1]
    return Step(emitted, accepted, loss, batch, seconds, perf_counter() - t0, rows, out, proposal)


def judge_tops(ctx: RoundContext, proposal: Proposal, tops: list[int], batch: int, seconds: float, t0: float) -> Step:
    """judge for a greedy round of the lossless rule whose rows stayed on the device: `tops`, each row's argmax
    (picked by the target's backend sampler), decide it (kernels/emit.py `accept_tops`)."""
    n, drafts, out = proposal.n, ctx.buffers.drafts, ctx.buffers.out
    out.top[: n + 1] = tops
    accepted, nxt = accept_tops(drafts.tokens, n, out, ctx.budget)
    ctx.chain.settle(accepted, nxt)
    emitted = _emitted(drafts.tokens[:accepted].tolist() + [int(nxt)], out, accepted, n, ctx.logprobs)
    loss = ctx.budget.loss[: accepted + 1]
    return Step(emitted, accepted, loss, batch, seconds, perf_counter() - t0, NO_ROWS, out, proposal)


def verify(target: Model, ctx: RoundContext, proposal: Proposal) -> Step:
    """One sequence's verification: the proposal decoded by the target alone, then judged."""
    t0 = perf_counter()
    part = target_input(ctx, len(target.tokens), proposal)
    t = perf_counter()
    target.checkpoint()  # a recurrent target without snapshots goes back here after a rejection (else: nothing)
    target.decode(part.tokens, f"from:{part.first_row}")
    target.synchronize()
    seconds = perf_counter() - t
    if target.sampler.active:  # a greedy lossless round: each row's argmax, picked on the device (device_picks.py)
        tops = [target.sampler.token(j - part.rows) for j in range(part.rows)]
        return judge_tops(ctx, proposal, tops, len(part.tokens), seconds, t0)
    return judge(ctx, proposal, target.logits(part.rows), len(part.tokens), seconds, t0)


def plain_step(model: Model, ctx: RoundContext, decoder: str) -> Step:
    """The baselines: one token from one model (the target for ar, the draft for draft-only)."""
    t0 = perf_counter()
    todo = list(ctx.seq[len(model.tokens) :])
    t = perf_counter()
    model.decode(todo, "last")
    model.synchronize()
    seconds = perf_counter() - t
    if model.sampler.active:  # picked on the device: no row comes to the host (device_picks.py)
        return _emit(ctx, NO_ROWS, model.sampler.take(), decoder, len(todo), seconds, t0)
    return plain_emit(ctx, model.logits(1), model.n_vocab, decoder, len(todo), seconds, t0)


def plain_emit(
    ctx: RoundContext, rows: np.ndarray, n_vocab: int, decoder: str, batch: int, seconds: float, t0: float
) -> Step:
    """A plain step's token from the deciding model's one row over its n_vocab, on the host (decoded in a batch
    of `batch` tokens in `seconds`, the round begun at perf_counter() t0)."""
    ctx.chain.target_rows(rows, 0)  # the same processing as every target row
    out = ctx.buffers.out
    # within the vocabulary the pair shares: a target with padding entries past the draft's never emits them,
    # so every id of the text is one a next turn's prompt check accepts
    n = min(n_vocab, ctx.n_vocab)
    u = float(ctx.random.take(1)[0])
    tok, _ = ctx.typed.call(emit_one, rows[0], n, ctx.sampling, u, ctx.buffers.row_stats, out)
    return _emit(ctx, rows, tok, decoder, batch, seconds, t0)


def _emit(ctx: RoundContext, rows: np.ndarray, tok: int, decoder: str, batch: int, seconds: float, t0: float) -> Step:
    """A plain step's Step for its token `tok`."""
    out = ctx.buffers.out
    ctx.chain.settle(0, tok)
    emitted = _emitted([int(tok)], out, 0, 0, ctx.logprobs)
    emitted.origins[0] = decoder
    return Step(emitted, 0, NO_LOSS, batch, seconds, perf_counter() - t0, rows, out, None, decoder)


def _emitted(tokens: list[int], out: RoundOut, accepted: int, n_drafts: int, logprobs: bool) -> Emitted:
    """The round's tokens with their origins, log-probabilities and top alternatives where asked, and
    (divergence, gap) for each rescued token."""
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
