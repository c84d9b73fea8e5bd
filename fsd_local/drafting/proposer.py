"""Drafting: who proposes a round's tokens (the draft model, prompt lookup, or lookup first), how many (length.py),
written into the context's draft buffers as a `Proposal` (round.py); the draft model's catch-up after plain steps,
which scores what it skipped (docs/design.md, "Drafting and the draft length")."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from fsd_local.drafting.across import Across
from fsd_local.drafting.follow import Following
from fsd_local.drafting.length import ACCEPT_PRIOR_LOSSY, PENDING_MAX, DraftLength, Source, accept_prior
from fsd_local.drafting.ngram import NgramDrafter, match_class
from fsd_local.drafting.text_draft import TextDraft
from fsd_local.kernels.accept import ONE_HOT, Drafts
from fsd_local.kernels.budget import threshold
from fsd_local.kernels.names import DIVERGENCE_MODES
from fsd_local.kernels.sampling import pick_kept, pick_kept_copy
from fsd_local.kernels.score import score_slots
from fsd_local.llama.model import Model
from fsd_local.round import Proposal, RoundContext, Step, force, forced_flags

MODEL: Source = ("model", 0)
# the target's rows of the latest plain steps kept for scoring the draft model's catch-up (length.py): a probe
# after a long plain streak scores its last ROWS_KEPT positions (it catches up on all of them)
ROWS_KEPT = 16
NOTHING: list[int] = []  # no forced token (never written)


def rows_needed(ctx: RoundContext) -> bool:
    """Whether the kernel reads the draft's rows: sampled (the SD test's residual), or a rule with a divergence
    that may rescue (a tau, or a budget that moves one)."""
    s = ctx.settings
    lossy = s.tau > 0 or s.quality_budget is not None
    return ctx.sampling.temperature > 0 or (s.mode in DIVERGENCE_MODES and lossy)


class DraftPicks:
    """One sequence's draws from the draft model in one round: `pick(row)` / `picked(token)` / `put(token)` return
    the token drafted at slot `n` (None: none); `n` slots are in the buffers (`made` by the model, the rest forced);
    `done`: no further draft may follow."""

    __slots__ = (
        "chain",
        "copy",
        "done",
        "drafts",
        "jump",
        "k",
        "made",
        "n",
        "n_vocab",
        "p_min",
        "past_runs",
        "run",
        "sampled",
        "typed",
        "us",
    )

    def __init__(self, ctx: RoundContext, n_vocab: int, k: int, n: int = 0) -> None:
        self.chain, self.drafts, self.n_vocab, self.k, self.n = ctx.chain, ctx.buffers.drafts, n_vocab, k, n
        self.made, self.done, self.typed = 0, False, ctx.typed
        self.run: list[int] = NOTHING  # what the grammar forced after the latest draw
        if ctx.draws is None:  # what every round of this context reads alike, read from its settings once
            s = ctx.sampling
            # a lossy rule keeps most drafts (its acceptance prior, length.py): drafting on behind a run is a good
            # bet there; under a lossless one the draft a run follows closed a free stretch, the round's least sure
            lossy = accept_prior(ctx.settings) == ACCEPT_PRIOR_LOSSY
            sampled = (s.temperature, s.top_k, s.top_p, s.min_p)
            ctx.draws = (rows_needed(ctx), float(ctx.settings.draft_p_min), sampled, lossy)
        self.copy, self.p_min, self.sampled, self.past_runs = ctx.draws
        self.jump = ctx.chain.jump
        self.us = ctx.random.take(k)  # one per draw (forced slots draw nothing)

    @property
    def bare(self) -> bool:
        """Greedy, no row kept, no chain, no confidence floor: a draft is its row's argmax and nothing else."""
        return not self.copy and self.sampled[0] <= 0 and self.p_min <= 0 and not self.chain.active

    def pick(self, row: np.ndarray, kept: bool = False) -> int | None:
        """`kept`: row is the buffer's row for this slot already (a carried row), so it is not copied there."""
        i, d, u = self.n, self.drafts, self.us[self.made]
        if self.chain.active:
            self.chain.draft_row(row, i)
        want_top = self.p_min > 0
        # the kernel reads the row after the draft's next decode has overwritten llama.cpp's buffer
        if self.copy and not kept:
            tok, p_tok, p_top, d.kept_n[i] = self.typed.call(
                pick_kept_copy,
                row,
                self.n_vocab,
                *self.sampled,
                u,
                d.stats[i],
                d.kept[i],
                want_top,
                d.rows[i],
                d.summary,
            )
        else:
            tok, p_tok, p_top, d.kept_n[i] = self.typed.call(
                pick_kept, row, self.n_vocab, *self.sampled, u, d.stats[i], d.kept[i], want_top, d.summary
            )
        if p_top < self.p_min:
            self.done = True
            return None
        return self.put(tok, p_tok)

    def picked(self, tok: int) -> int | None:
        """A greedy pick made on the device (device_picks.py: only where no draft row and no p_min is read)."""
        if self.p_min > 1.0:
            self.done = True
            return None
        return self.put(tok, 1.0)

    def ends(self, ctx: RoundContext) -> bool:
        """After a draw: the run the grammar then forces joins the proposal (`run`); drafting ends there under a
        lossless rule, and at k drafts, the grammar's end, or the round's room (design.md, "Forced tokens")."""
        self.run = force(ctx, self.n, self.n - self.made) if self.jump else NOTHING
        self.n += len(self.run)
        return (bool(self.run) and not self.past_runs) or self.done or self.n >= ctx.room

    def put(self, tok: int, p_tok: float = 1.0) -> int | None:
        i, d = self.n, self.drafts
        d.tokens[i], d.prob[i], d.onehot[i] = tok, p_tok, 0
        if self.bare:
            d.kept_n[i] = -1
        self.n, self.made = i + 1, self.made + 1
        # a complete grammar: only the reply's end may follow
        self.done = not self.chain.push(tok) or self.made == self.k
        return int(tok)


class Proposer:
    """The drafters of one engine: `propose` fills a sequence's draft buffers, sized by the policy's
    DraftLength (which drafting asks for k and tells what a catch-up measured). `across`: the draft model is of
    another vocabulary (drafting/across.py: through the map; text_draft.py: as text)."""

    def __init__(
        self, draft: Model | None, n_vocab: int, lengths: DraftLength, across: Following | None = None
    ) -> None:
        self.draft, self.n_vocab, self.lengths, self.across = draft, n_vocab, lengths, across
        self.ngram: NgramDrafter | None = None
        self._kept: np.ndarray | None = None  # (ROWS_KEPT, n_vocab): target rows of plain steps, by position
        self._kept_pos = np.full(ROWS_KEPT, -1, np.int64)
        self.keeps_rows = False

    def start(self, ctx: RoundContext, target_rows: bool = True) -> None:
        """A new generation: no kept row applies to its text; keep rows only where a probe may use them (and
        `target_rows`: the target's plain steps bring their rows to the host, not picked on its device)."""
        s = ctx.settings
        self._kept_pos[:] = -1
        drafting = self.draft is not None and s.drafter != "ngram"
        # a probe scores the draft's rows of skipped positions against the target's: one vocabulary only
        self.keeps_rows = (
            drafting and s.draft_policy == "auto" and ctx.chain.constraint is None and target_rows and not self.across
        )
        if self.across is not None:
            self.across.start()

    # ------------------------------------------------------------------ one round
    def propose(self, ctx: RoundContext) -> Proposal:
        """This round's drafts: prompt lookup first where the drafter allows it (free, and its match class says
        how far to trust it), then the draft model unless the drafter is `ngram` alone."""
        t0 = perf_counter()
        s, seq, room = ctx.settings, ctx.seq, ctx.room
        forced = force(ctx, 0, 0)  # what the grammar forces first: no drafter proposes it
        if forced and s.drafter == "ngram":
            return Proposal(len(forced), None, 0, perf_counter() - t0, forced=forced_flags(ctx, len(forced)))
        if s.drafter != "model" and not forced:  # a lookup follows the text, not text still unverified
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
                n = len(tokens) + len(force(ctx, len(tokens), 0)) if tokens else 0  # and what it forces after them
                return Proposal(n, source if tokens else None, k, perf_counter() - t0, forced=forced_flags(ctx, n))
        return self._draft_model(ctx, t0, forced)

    def _draft_model(self, ctx: RoundContext, t0: float, forced: list[int]) -> Proposal:
        """The draft model's drafts after the `forced` slots, each followed by what the grammar then forces; under a
        lossless rule the first such run ends them (DraftPicks.ends). The model never draws a forced token; it
        decodes a run with its next draw, or with the next round's pending text."""
        if isinstance(self.across, Across):
            return self._draft_across(ctx, self.across, t0, forced)
        if isinstance(self.across, TextDraft):
            return self._draft_text(ctx, self.across, t0, forced)
        d, seq = self.draft, ctx.seq
        assert d is not None, "the model drafter has a draft (Settings.check_draft)"
        caught_up, probed = 0.0, 0
        behind = len(seq) - len(d.tokens)
        if self.keeps_rows and self.lengths.probe(MODEL, behind, len(self._scorable(seq)), ctx.room + 1):
            caught_up, probed = self.catch_up(ctx)  # what the skipped text says is worth its catch-up
            behind = 0
        n, made = len(forced), 0
        k = self.lengths.choose(MODEL, ctx.room - n, behind=behind)
        if k > 0:
            if len(seq) - len(d.tokens) > PENDING_MAX:  # it skipped rounds: catch up, scoring them
                seconds, scored = self.catch_up(ctx)
                caught_up, probed = caught_up + seconds, probed + scored
                if forced:
                    d.decode(forced, "last")
            else:
                d.decode([*seq[len(d.tokens) :], *forced], "last")
            if k > 1:  # it decodes its drafts one a call: a recurrent state goes back here after a rejection
                d.checkpoint()
            picks = DraftPicks(ctx, self.n_vocab, k, n)  # the draft's last row is the first draw's
            device = d.sampler.active  # greedy picks made on the device, no draft row read (device_picks.py)
            while (tok := picks.picked(d.sampler.take()) if device else picks.pick(d.logits(1)[0])) is not None:
                if picks.ends(ctx):
                    break
                if picks.run:  # drafting on behind a run: the draft model decodes it with its draft
                    d.decode([tok, *picks.run], "last")
                else:
                    d.decode_one(tok)
            n, made = picks.n, picks.made
        flags = forced_flags(ctx, n)
        return Proposal(n, MODEL if made else None, k, perf_counter() - t0, caught_up, probed, flags)

    def _draft_across(self, ctx: RoundContext, a: Across, t0: float, forced: list[int]) -> Proposal:
        """The draft model of another vocabulary: its cache brought to the text, its rows carried onto the
        target's ids, each proposed target token decoded as its own token of the same bytes. A round the grammar
        opens with forced tokens proposes them alone (the draft follows them as text next round)."""
        if forced:
            return Proposal(len(forced), None, 0, perf_counter() - t0, forced=forced_flags(ctx, len(forced)))
        d = a.draft
        k = self.lengths.choose(MODEL, ctx.room, behind=max(0, len(ctx.seq) - a.followed))
        n = 0
        if k > 0 and a.sync(ctx.seq):
            if k > 1:  # as _draft_model: a recurrent state goes back here after a rejection
                d.checkpoint()
            picks = DraftPicks(ctx, self.n_vocab, min(k, a.room() + 1))  # the last draft is not decoded
            # greedy with nothing reading the row: the argmax of the carried row without writing it (the draft's
            # row read once, not the target's vocabulary written and read)
            bare = picks.bare
            while True:
                row = d.logits(1)[0]
                if bare:
                    tok = None if (t := a.argmax(row)) < 0 else picks.put(t)
                elif picks.copy:  # a row the kernel reads: carried into its buffer, not copied after
                    tok = picks.pick(a.carry_into(row, picks.drafts.rows, picks.n), kept=True)
                else:
                    tok = picks.pick(a.carry(row))
                if tok is None or picks.done or a.draft_token(tok) < 0:
                    break
                d.decode_one(a.draft_token(tok))
            n = picks.n
            if n and a.draft_token(int(ctx.buffers.drafts.tokens[n - 1])) < 0:
                n -= 1  # drawn from a row with no shared token left (a grammar allowing only the target's own)
        return Proposal(n, MODEL if n else None, k, perf_counter() - t0, forced=forced_flags(ctx, n))

    def _draft_text(self, ctx: RoundContext, a: TextDraft, t0: float, forced: list[int]) -> Proposal:
        """The text path: the draft's greedy text after the accepted text, the target's tokens of it proposed
        one-hot (and the target's end of reply where the draft ended its own), cut to k and to the grammar."""
        if forced:
            return Proposal(len(forced), None, 0, perf_counter() - t0, forced=forced_flags(ctx, len(forced)))
        k = self.lengths.choose(MODEL, ctx.room, behind=max(0, len(ctx.seq) - a.followed))
        tokens: list[int] = []
        if k > 0 and a.sync(ctx.seq):
            text, ended = a.draft_text(min(k, a.room() + 1))
            tokens = a.target_tokens(ctx.seq, text)[:k]
            if ended and len(tokens) < k and a.spells(tokens, text):
                tokens.append(a.end)
            ctx.chain.admit(tokens)  # only what the grammar allows
        _one_hot(ctx.buffers.drafts, tokens)
        n = len(tokens) + len(force(ctx, len(tokens), 0)) if tokens else 0  # and what the grammar forces after them
        return Proposal(n, MODEL if tokens else None, k, perf_counter() - t0, forced=forced_flags(ctx, n))

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
        if len(todo) > d.n_batch:  # a skipped prompt: the rows must come from one batch (Model.decode)
            d.decode(todo[:first], "none")
            d.decode(todo[first:], "from:0")
        else:
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
        out_ = ctx.buffers.out  # its kept tokens and summaries are free scratch while the round drafts
        scratch = (ctx.buffers.row_stats, out_.kept[0], out_.summaries[0])
        score_slots(self._kept, p_idx, rows, q_idx, self.n_vocab, ctx.rule, ctx.sampling, tau, us, *scratch, out)
        self.lengths.observe_stream(MODEL, out)
        return seconds, n


def _one_hot(drafts: Drafts, tokens: list[int]) -> None:
    """Prompt-lookup drafts: q is one-hot on each proposed token, so the kernels need no row for it."""
    for i, tok in enumerate(tokens):
        drafts.tokens[i], drafts.prob[i], drafts.onehot[i] = tok, 1.0, ONE_HOT
        drafts.stats[i] = 0.0  # processed one-hot row: max 0, only logits >= 0 kept, log-normaliser 0


def _threshold(ctx: RoundContext) -> float:
    """The rule's threshold this round: tau, or the one a quality budget set (B = 0: exactly sd)."""
    if ctx.budget.bound < 0.0:
        return ctx.rule.tau
    return threshold(ctx.budget) if ctx.budget.bound > 0.0 else 0.0
