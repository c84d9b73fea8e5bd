"""One call's state around its rounds: the accepted text, the models it runs, its `RoundContext`, statistics and
released text; `advance` does everything after a round (engine.py runs the loop)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsd_local.chain import Chain
from fsd_local.kernels.budget import Budget
from fsd_local.kernels.names import SPECULATIVE_MODES
from fsd_local.results import Completion, Emitted, Piece, length_detail
from fsd_local.round import Buffers, RoundContext, Step
from fsd_local.settings import Settings
from fsd_local.stats import Stats
from fsd_local.stream import TextStream

if TYPE_CHECKING:
    from fsd_local.llama.model import Model


@dataclass
class Generation:
    """One call: its settings, the accepted text, the models it runs, the context its rounds read and move on,
    its statistics and the text released so far."""

    s: Settings
    seq: list[int]  # the accepted text: prompt, then every emitted token
    models: list[Model]  # the models this call runs (models[0] decides: the target, or the draft for draft-only)
    target: Model
    n_vocab: int
    budget: Budget
    buffers: Buffers  # the engine's, lent for this call
    chain: Chain
    dropped: int = 0  # chat: the oldest messages left out to fit the context
    seq_id: int = 0  # the KV sequence of each model that holds this call's text (several at once: batching.py)
    ctx: RoundContext = field(init=False)
    stats: Stats = field(init=False)
    text: TextStream = field(init=False)
    reply: Emitted = field(default_factory=Emitted)  # the tokens shown so far, with their origins

    def __post_init__(self) -> None:
        self.ctx = RoundContext.start(
            self.s, self.seq, self.n_vocab, self.chain, self.budget, self.buffers, self.ends_reply
        )
        self.stats = Stats(prompt_tokens=len(self.seq))
        self.text = TextStream(self.s.stop)
        self.n_ctx = min(m.n_ctx for m in self.models)
        self.speculative = self.s.mode in SPECULATIVE_MODES
        self.ctx.room = self.room

    def ends_reply(self, drafts: Sequence[int]) -> int | None:
        """The first of these drafts that would end the reply if emitted: end of generation or a stop string."""
        tgt = self.target
        eog = None if self.s.ignore_eos else next((j for j, t in enumerate(drafts) if tgt.is_eog(t)), None)
        stop = self.text.stop_index([tgt.piece(t) for t in drafts[:eog]]) if self.text.stop else None
        return stop if stop is not None else eog

    def stop_reason(self, *cancels) -> str | None:
        """Why no further round may run: cancelled, or the length (max_tokens, a full context)."""
        if any(c is not None and c.is_set() for c in cancels):
            return "cancelled"
        if self.s.max_tokens - self.stats.tokens <= 0 or len(self.seq) > self.n_ctx:
            return "length"
        return None

    @property
    def room(self) -> int:
        """How many drafts the next round may propose: tokens still wanted after one, context left, and what the
        target can roll back (Model.rollback_max)."""
        return min(self.s.max_tokens - self.stats.tokens - 1, self.n_ctx - len(self.seq), self.target.rollback_max)

    def advance(self, step: Step) -> tuple[str | None, Piece | None]:
        """Everything after a round: (why the reply ended, or None; the piece to stream, or None)."""
        new = step.emitted.tokens
        finish = None
        shown = len(new)
        if not self.s.ignore_eos:
            shown = next((i for i, t in enumerate(new) if self.target.is_eog(t)), len(new))
            finish = "stop" if shown < len(new) else None
        # the reply ends at its end-of-generation token: what the round accepted after it is not the reply's
        self.stats.record(step, shown + 1 if finish else len(new))
        start = len(self.seq)
        self.seq.extend(new)
        self.ctx.room = self.room
        for m in self.models:  # trim: each cache keeps its longest common prefix with the accepted text
            m.keep_common_prefix(self.seq, start - 1, self.seq_id)
        emitted = step.emitted if shown == len(new) else step.emitted.head(shown)
        self.reply.extend(emitted)
        released = self.text.push(b"".join(self.target.piece(t) for t in emitted.tokens))
        if self.text.stopped or self.chain.finished:  # a stop string, or the grammar is complete
            finish = "stop"
        if not (released or emitted.tokens):
            return finish, None
        return finish, emitted.piece(released, self.s.logprobs, self.s.top_logprobs > 0)

    def completion(self, finish: str, plain_rate: float) -> Completion:
        """The call's result; plain_rate: the measured plain-decoding rate of this machine (0: none timed)."""
        s, st = self.s, self.stats
        out = Completion(
            text=self.text.text,
            token_ids=self.reply.tokens,
            finish_reason=finish,
            stats=st.to_dict(self.budget),
            settings=s.to_dict(),
            prompt_tokens=st.prompt_tokens,
            origins=self.reply.origins,
            finish_detail=length_detail(finish, st.tokens, s.max_tokens),
            dropped_messages=self.dropped,
        )
        out.logprobs, out.top_logprobs = self.reply.logprob_fields(s.logprobs, s.top_logprobs > 0)
        if s.mode == "draft-only":
            out.stats["target_logprob_mean"] = out.stats["loss_per_token"] = None
        out.stats["plain_tokens_per_second_est"] = plain_rate
        out.stats["speedup_vs_plain_est"] = out.stats["tokens_per_second"] / plain_rate if plain_rate else None
        return out
