"""Drafting: who proposes a round's tokens (the draft model, prompt lookup, or lookup first), how many (length.py),
written into the context's draft buffers as a `Proposal` (round.py); the draft model's catch-up after plain steps,
which scores what it skipped (docs/design.md, "Drafting and the draft length")."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from fsd_local.drafting.length import PENDING_MAX, DraftLength, Source
from fsd_local.drafting.ngram import NgramDrafter, match_class
from fsd_local.kernels.accept import Drafts
from fsd_local.kernels.budget import threshold
from fsd_local.kernels.names import DIVERGENCE_MODES
from fsd_local.kernels.sampling import pick_kept, pick_kept_copy
from fsd_local.kernels.score import score_slots
from fsd_local.llama.model import Model
from fsd_local.round import Proposal, RoundContext, Step

MODEL: Source = ("model", 0)
# the target's rows of the latest plain steps kept for scoring the draft model's catch-up (length.py): a probe
# after a long plain streak scores its last ROWS_KEPT positions (it catches up on all of them)
ROWS_KEPT = 16


def rows_needed(ctx: RoundContext) -> bool:
    """Whether the kernel reads the draft's rows: sampled (the SD test's residual), or a rule with a divergence
    that may rescue (a tau, or a budget that moves one)."""
    s = ctx.settings
    lossy = s.tau > 0 or s.quality_budget is not None
    return ctx.sampling.temperature > 0 or (s.mode in DIVERGENCE_MODES and lossy)


class DraftPicks:
    """One sequence's draws from the draft model in one round: `pick(row)` takes the model's row for the next
    slot and returns the token to decode next (None: drafting stops); `n` drafts are in the buffers."""

    __slots__ = ("chain", "copy", "drafts", "k", "n", "n_vocab", "p_min", "sampled", "us")

    def __init__(self, ctx: RoundContext, n_vocab: int, k: int) -> None:
        s = ctx.sampling
        self.chain, self.drafts, self.n_vocab, self.k, self.n = ctx.chain, ctx.buffers.drafts, n_vocab, k, 0
        self.copy = rows_needed(ctx)
        self.us = ctx.random.take(k)
        self.p_min = ctx.settings.draft_p_min
        self.sampled = (s.temperature, s.top_k, s.top_p, s.min_p)

    def pick(self, row: np.ndarray) -> int | None:
        i, d = self.n, self.drafts
        self.chain.draft_row(row, i)
        want_top = self.p_min > 0
        if self.copy:  # the kernel reads the row after the draft's next decode has overwritten llama.cpp's buffer
            tok, p_tok, p_top, d.kept_n[i] = pick_kept_copy(
                row, self.n_vocab, *self.sampled, self.us[i], d.stats[i], d.kept[i], want_top, d.rows[i]
            )
        else:
            tok, p_tok, p_top, d.kept_n[i] = pick_kept(
                row, self.n_vocab, *self.sampled, self.us[i], d.stats[i], d.kept[i], want_top
            )
        if p_top < self.p_min:
            return None
        d.tokens[i], d.prob[i], d.onehot[i] = tok, p_tok, 0
        self.n = i + 1
        if not self.chain.push(tok) or self.n == self.k:  # a complete grammar: only the reply's end may follow
            return None
        return int(tok)


class Proposer:
    """The drafters of one engine: `propose` fills a sequence's draft buffers, sized by the policy's
    DraftLength (which drafting asks for k and tells what a catch-up measured)."""

    def __init__(self, draft: Model | None, n_vocab: int, lengths: DraftLength) -> None:
        self.draft, self.n_vocab, self.lengths = draft, n_vocab, lengths
        self.ngram: NgramDrafter | None = None
        self._kept: np.ndarray | None = None  # (ROWS_KEPT, n_vocab): target rows of plain steps, by position
        self._kept_pos = np.full(ROWS_KEPT, -1, np.int64)
        self.keeps_rows = False

    def start(self, ctx: RoundContext) -> None:
        """A new generation: no kept row applies to its text; keep rows only where a probe may use them."""
        s = ctx.settings
        self._kept_pos[:] = -1
        drafting = self.draft is not None and s.drafter != "ngram"
        self.keeps_rows = drafting and s.draft_policy == "auto" and ctx.chain.constraint is None

    # ------------------------------------------------------------------ one round
    def propose(self, ctx: RoundContext) -> Proposal:
        """This round's drafts: prompt lookup first where the drafter allows it (free, and its match class says
        how far to trust it), then the draft model unless the drafter is `ngram` alone."""
        t0 = perf_counter()
        s, seq, room = ctx.settings, ctx.seq, ctx.room
        if s.drafter != "model":
            if self.ngram is None or (self.ngram.ngram_min, self.ngram.ngram_max) != (s.ngram_min, s.ngram_max):
                self.ngram = NgramDrafter(s.ngram_min, s.ngram_max)
            self.lengths.score_shadow(seq)
            tokens = self.ngram.propose(seq, min(room, self.lengths.k_max))
            source: Source = ("ngram", match_class(self.ngram.match_length))
            k = self.lengths.choose(source, room) if tokens else 0
            if tokens and not k:
                self.lengths.shadow(source, tokens, len(seq))
            del tokens[k:]
            ctx.chain.admit(tokens)  # only what the grammar allows
            if tokens or s.drafter == "ngram":
                _one_hot(ctx.buffers.drafts, tokens)
                return Proposal(len(tokens), source if tokens else None, k, perf_counter() - t0)
        return self._draft_model(ctx, t0)

    def _draft_model(self, ctx: RoundContext, t0: float) -> Proposal:
        d, seq = self.draft, ctx.seq
        assert d is not None, "the model drafter has a draft (Settings.check_draft)"
        caught_up, probed = 0.0, 0
        behind = len(seq) - len(d.tokens)
        if self.keeps_rows and self.lengths.probe(MODEL, behind, len(self._scorable(seq)), ctx.room + 1):
            caught_up, probed = self.catch_up(ctx)  # what the skipped text says is worth its catch-up
            behind = 0
        k = self.lengths.choose(MODEL, ctx.room, behind=behind)
        n = 0
        if k > 0:
            if len(seq) - len(d.tokens) > PENDING_MAX:  # it skipped rounds: catch up, scoring them
                seconds, scored = self.catch_up(ctx)
                caught_up, probed = caught_up + seconds, probed + scored
            else:
                d.decode(seq[len(d.tokens) :], "last")
            picks = DraftPicks(ctx, self.n_vocab, k)  # the draft's last row is the first slot's
            while (tok := picks.pick(d.logits(1)[0])) is not None:
                d.decode_one(tok)
            n = picks.n
        return Proposal(n, MODEL if n else None, k, perf_counter() - t0, caught_up, probed)

    def observe(self, ctx: RoundContext, step: Step) -> None:
        """After a verified round that drafted nothing: keep the target's row for the draft model's catch-up."""
        p = step.proposal
        if p is not None and not p.n and self.keeps_rows:
            self._keep_row(len(ctx.seq), step.rows[0])

    # ------------------------------------------------------------------ catching up, and probes
    def _keep_row(self, pos: int, row: np.ndarray) -> None:
        """The target's (processed) row for text position pos, from a plain step."""
        if self._kept is None:
            self._kept = np.empty((ROWS_KEPT, self.n_vocab), np.float32)
        i = pos % ROWS_KEPT
        self._kept[i] = row[: self.n_vocab]
        self._kept_pos[i] = pos

    def _scorable(self, seq) -> list[int]:
        """Positions the draft model skipped that a kept target row can score (each emitted: p < len(seq))."""
        lo = max(len(self.draft.tokens) + 1 if self.draft else 0, len(seq) - ROWS_KEPT)
        return [p for p in range(lo, len(seq)) if self._kept_pos[p % ROWS_KEPT] == p]

    def catch_up(self, ctx: RoundContext) -> tuple[float, int]:
        """Decode the text the draft model skipped in one batch, scoring every position a kept target row can
        score as the round would have (`score_slots`: the policy's evidence); its last row is the first draft's.
        Returns (seconds of the decode, positions scored)."""
        d = self.draft
        assert d is not None, "only the draft model catches up"
        base, todo = len(d.tokens), ctx.seq[len(d.tokens) :]
        scored = self._scorable(ctx.seq)
        first = scored[0] - base - 1 if scored else len(todo) - 1  # output rows from the first scored position
        t = perf_counter()
        d.decode(todo, f"from:{first}")
        d.synchronize()
        seconds = perf_counter() - t
        self.lengths.observe_catch_up(len(todo), seconds)
        if not scored:
            return seconds, 0
        rows = d.logits(len(todo) - first)  # row r: position base + first + r + 1
        q_idx = np.array([p - base - first - 1 for p in scored], np.int64)
        if not all(ctx.chain.past_row(rows[i], p) for i, p in zip(q_idx, scored)):
            return seconds, 0  # a grammar: the draft's rows of the past cannot be processed as they were
        n = len(scored)
        us, out = ctx.random.pairs(n), np.zeros(n, np.uint8)
        p_idx = np.array([p % ROWS_KEPT for p in scored], np.int64)
        assert self._kept is not None, "scored positions have kept rows"
        tau = _threshold(ctx)
        stats = ctx.buffers.row_stats
        score_slots(self._kept, p_idx, rows, q_idx, self.n_vocab, ctx.rule, ctx.sampling, tau, us, stats, out)
        self.lengths.observe_stream(MODEL, out)
        return seconds, n


def _one_hot(drafts: Drafts, tokens: list[int]) -> None:
    """Prompt-lookup drafts: q is one-hot on each proposed token, so the kernels need no row for it."""
    for i, tok in enumerate(tokens):
        drafts.tokens[i], drafts.prob[i], drafts.onehot[i] = tok, 1.0, 1
        drafts.stats[i] = 0.0  # processed one-hot row: max 0, only logits >= 0 kept, log-normaliser 0


def _threshold(ctx: RoundContext) -> float:
    """The rule's threshold this round: tau, or the one a quality budget set (B = 0: exactly sd)."""
    if ctx.budget.bound < 0.0:
        return ctx.rule.tau
    return threshold(ctx.budget) if ctx.budget.bound > 0.0 else 0.0
