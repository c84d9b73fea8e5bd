"""Drafting: who proposes this round's tokens (the draft model, prompt lookup, or lookup first) and how many
(drafting/length.py), written into the round buffers the acceptance kernel reads (kernels/accept.py `Drafts`),
returned as a `Proposal` (round.py) with the seconds drafting took.

The draft model's rows are copied only where the rule reads them (a divergence, a sampled SD test or residual);
greedy lossless drafting keeps no row and picks each token with an argmax at memory speed. Prompt lookup writes
no row at all: its q is one-hot on the proposed token, which the kernels read from the token alone.

After plain steps the draft model is behind the text. Catching it up is also how the policy learns what drafting
would buy (length.py): the target's rows of the latest plain steps are kept (`observe`), the catch-up decodes
the skipped text with a row for every kept position, and each is scored as the round would have scored it.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np

from fsd_local.drafting.length import PENDING_MAX, DraftLength, Source
from fsd_local.drafting.ngram import NgramDrafter, match_class
from fsd_local.kernels.accept import Drafts
from fsd_local.kernels.dense import new_summaries
from fsd_local.kernels.names import DIVERGENCE_MODES
from fsd_local.kernels.sampling import KEPT_MAX, pick_kept, pick_kept_copy
from fsd_local.kernels.score import score_slots
from fsd_local.llama.model import Model
from fsd_local.round import Proposal

if TYPE_CHECKING:
    from fsd_local.generation import Generation
    from fsd_local.round import Step

MODEL: Source = ("model", 0)
# the target's rows of the latest plain steps kept for scoring the draft model's catch-up (length.py): a probe
# after a long plain streak scores its last ROWS_KEPT positions (it catches up on all of them)
ROWS_KEPT = 16


def new_drafts(k: int, n_vocab: int) -> Drafts:
    """Round buffers for up to k drafts over a vocabulary of n_vocab (the engine owns them)."""
    return Drafts(
        rows=np.empty((k, n_vocab), np.float32),
        tokens=np.empty(k, np.int32),
        prob=np.empty(k),
        stats=np.zeros((k + 1, 3), np.float32),
        onehot=np.zeros(k, np.uint8),
        kept=np.empty((k, KEPT_MAX), np.int64),
        kept_n=np.full(k, -1, np.int64),
        summary=new_summaries(1)[0],
    )


def rows_needed(g: Generation) -> bool:
    """Whether the kernel reads the draft's rows: sampled (the SD test's residual), or a rule with a divergence
    that may rescue (a tau, or a budget that moves one)."""
    lossy = g.s.tau > 0 or g.s.quality_budget is not None
    return g.sampling.temperature > 0 or (g.s.mode in DIVERGENCE_MODES and lossy)


class Proposer:
    """The drafters of one engine and the policy that sizes their drafts; `propose` fills the round buffers."""

    def __init__(self, draft: Model | None, n_vocab: int) -> None:
        self.draft, self.n_vocab = draft, n_vocab
        self.lengths = DraftLength()  # measured costs and acceptance: how many tokens a round should draft
        self.ngram: NgramDrafter | None = None
        self._kept: np.ndarray | None = None  # (ROWS_KEPT, n_vocab): target rows of plain steps, by position
        self._kept_pos = np.full(ROWS_KEPT, -1, np.int64)
        self.keeps_rows = False

    def start(self, g: Generation) -> None:
        """A new generation: its text is new, so no kept row applies; keep rows only where a probe may use them."""
        self._kept_pos[:] = -1
        self.lengths.start(g.s)
        drafting = self.draft is not None and g.s.drafter != "ngram"
        self.keeps_rows = drafting and g.s.draft_policy == "auto" and g.chain.constraint is None
        self.keeps_rows = self.keeps_rows and not g.target.sampler.active  # plain steps picked on the device

    # ------------------------------------------------------------------ one round
    def propose(self, g: Generation, drafts: Drafts) -> Proposal:
        """This round's drafts, by the settings' drafter and draft-length policy.

        Prompt lookup goes first when the drafter allows it: the lookup is free, and the match it finds says how
        far it can be trusted (its class), so k is chosen after it. With `ngram+model` the model drafts when
        lookup finds nothing or its class is not worth drafting from; with `ngram` such a round is a plain step."""
        t0 = perf_counter()
        if g.s.drafter != "model":
            s = g.s
            if self.ngram is None or (self.ngram.ngram_min, self.ngram.ngram_max) != (s.ngram_min, s.ngram_max):
                self.ngram = NgramDrafter(s.ngram_min, s.ngram_max)
            self.lengths.score_shadow(g.seq)
            tokens = self.ngram.propose(g.seq, min(g.room, self.lengths.k_max))
            source: Source = ("ngram", match_class(self.ngram.match_length))
            k = self.lengths.choose(source, g.room) if tokens else 0
            if tokens and not k:
                self.lengths.shadow(source, tokens, len(g.seq))
            del tokens[k:]
            g.chain.admit(tokens)  # only what the grammar allows
            if tokens or s.drafter == "ngram":
                _one_hot(drafts, tokens)
                return Proposal(len(tokens), drafts, source if tokens else None, k, perf_counter() - t0)
        return self._draft_model(g, drafts, t0)

    def _draft_model(self, g: Generation, drafts: Drafts, t0: float) -> Proposal:
        assert self.draft is not None, "the model drafter has a draft (Settings.check_draft)"
        caught_up, probed = 0.0, 0
        behind = len(g.seq) - len(self.draft.tokens)
        if self.keeps_rows and self.lengths.probe(MODEL, behind, len(self._scorable(g.seq)), g.room + 1):
            caught_up, probed = self.catch_up(g)  # what the skipped text says is worth its catch-up
            behind = 0
        k = self.lengths.choose(MODEL, g.room, behind=behind)
        n = 0
        if k > 0:
            if len(g.seq) - len(self.draft.tokens) > PENDING_MAX:  # it skipped rounds: catch up, scoring them
                seconds, scored = self.catch_up(g)
                caught_up, probed = caught_up + seconds, probed + scored
            else:
                self.draft.decode(g.seq[len(self.draft.tokens) :], "last")
            n = self._sample(g, drafts, k)
        return Proposal(n, drafts, MODEL if n else None, k, perf_counter() - t0, caught_up, probed)

    def _sample(self, g: Generation, drafts: Drafts, k: int) -> int:
        """Draw up to k tokens from the draft model (its cache holds the text; its last row is the first's)."""
        d, nv, s = self.draft, self.n_vocab, g.sampling
        assert d is not None, "speculative modes have a draft (Settings.check_draft)"
        copy = rows_needed(g)
        us = g.uniforms(k)
        p_min = g.s.draft_p_min
        sampled = (s.temperature, s.top_k, s.top_p, s.min_p)
        n = 0
        for i in range(k):
            if d.sampler.active:  # greedy on the device, no draft row read (device_picks.py)
                tok, p_tok, p_top = d.sampler.take(), 1.0, 1.0
            else:
                row = d.logits(1)[0]
                g.chain.draft_row(row, i)
                if copy:  # the kernel reads the row after the draft's next decode has overwritten llama.cpp's buffer
                    tok, p_tok, p_top, drafts.kept_n[i] = pick_kept_copy(
                        row,
                        nv,
                        *sampled,
                        us[i],
                        drafts.stats[i],
                        drafts.kept[i],
                        p_min > 0,
                        drafts.rows[i],
                        drafts.summary,
                    )
                else:
                    tok, p_tok, p_top, drafts.kept_n[i] = pick_kept(
                        row, nv, *sampled, us[i], drafts.stats[i], drafts.kept[i], p_min > 0, drafts.summary
                    )
            if p_top < p_min:
                break
            drafts.tokens[i], drafts.prob[i], drafts.onehot[i] = tok, p_tok, 0
            n = i + 1
            if not g.chain.push(tok):  # the grammar is complete: only the end of the reply may follow
                break
            if n < k:
                d.decode_one(int(tok))
        return n

    def observe(self, g: Generation, step: Step) -> None:
        """After the round's verification: the policy learns what it cost and accepted; a plain step's target
        row is kept for scoring the draft model when it catches up."""
        p = step.proposal
        assert p is not None, "observe follows a verified proposal"
        if not p.n and self.keeps_rows:
            self._keep_row(len(g.seq), step.rows[0])
        self.lengths.observe(p.source, p.n, step.accepted, p.seconds - p.catch_up, step.batch, step.seconds)

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

    def catch_up(self, g: Generation) -> tuple[float, int]:
        """Decode the text the draft model skipped in one batch, with a row for every position a kept target row
        can score, and score each as the round would have (kernels/score.py `score_slots`): the outcomes are
        the policy's evidence under the current settings (length.py). The draft's last row (for the next
        position) is left as the first draft's row. Returns (seconds of the decode, positions scored)."""
        d = self.draft
        assert d is not None, "only the draft model catches up"
        base, todo = len(d.tokens), g.seq[len(d.tokens) :]
        scored = self._scorable(g.seq)
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
        if not all(g.chain.past_row(rows[i], p) for i, p in zip(q_idx, scored)):
            return seconds, 0  # a grammar: the draft's rows of the past cannot be processed as they were
        n = len(scored)
        us = g.rng.random((n, 2)) if g.sampling.temperature > 0 else np.zeros((n, 2))
        out = np.zeros(n, np.uint8)
        p_idx = np.array([p % ROWS_KEPT for p in scored], np.int64)
        assert self._kept is not None, "scored positions have kept rows"
        tau = _threshold(g)
        scratch = g.out.kept[0], g.out.summaries[0]  # the round's buffers: free while it drafts
        score_slots(
            self._kept, p_idx, rows, q_idx, self.n_vocab, g.rule, g.sampling, tau, us, g.row_stats, *scratch, out
        )
        self.lengths.observe_stream(MODEL, out)
        return seconds, n


def _one_hot(drafts: Drafts, tokens: list[int]) -> None:
    """Prompt-lookup drafts: q is one-hot on each proposed token (docs/design.md, "The acceptance rules"), so the
    SD test accepts with probability p(d) and the sampled replacement comes from p without d; the kernels need no
    row for it."""
    for i, tok in enumerate(tokens):
        drafts.tokens[i], drafts.prob[i], drafts.onehot[i] = tok, 1.0, 1
        drafts.stats[i] = 0.0  # processed one-hot row: max 0, only logits >= 0 kept, log-normaliser 0


def _threshold(g: Generation) -> float:
    """The rule's threshold this round: tau, or the one a quality budget set (B = 0: exactly sd)."""
    from fsd_local.kernels.budget import threshold

    if g.budget.bound < 0.0:
        return g.rule.tau
    return threshold(g.budget) if g.budget.bound > 0.0 else 0.0
