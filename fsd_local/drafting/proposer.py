"""This round's drafts: who proposes them (the draft model, prompt lookup, or lookup first) and how many
(drafting/length.py), written into the buffers the acceptance kernel reads (kernels/accept.py `Drafts`)."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from fsd_local.chain import Chain
from fsd_local.drafting.length import PENDING_MAX, DraftLength, Source
from fsd_local.drafting.ngram import NgramDrafter, match_class
from fsd_local.kernels.accept import Drafts, RoundOut, round_out
from fsd_local.kernels.sampling import pick
from fsd_local.llama.model import Model
from fsd_local.settings import Settings

MODEL: Source = ("model", 0)
SECOND_PASS_MAX = 9  # calibration times batches up to this size twice (the tiles of 4 and 8 rows, and one more)


class Proposer:
    """Owns the per-round buffers and the drafters of one engine. `propose` fills `drafts` for the kernel."""

    def __init__(self, draft: Model | None, n_vocab: int, k: int) -> None:
        self.draft, self.n_vocab = draft, n_vocab
        self.lengths = DraftLength()  # measured costs and acceptance: how many tokens a round should draft
        self.chain = Chain(Settings(), [], n_vocab)  # the generation's logit processing (the engine sets it per call)
        self.ngram: NgramDrafter | None = None
        self._catch_up_seconds = 0.0
        self._k_alloc = 0
        self.out: RoundOut
        self.reserve(k)

    def reserve(self, k: int, n_top: int = 0) -> None:
        """Buffers for up to k drafts a round, and for n_top alternatives of each emitted token."""
        if k <= self._k_alloc:
            if n_top != self.out.top_ids.shape[1]:
                self.out = round_out(self._k_alloc, n_top)
            return
        nv = self.draft.n_vocab if self.draft else self.n_vocab
        # the draft's raw rows are copied: its logits buffer is reused per token (one-hot rows for prompt lookup)
        self.drafts = Drafts(
            rows=np.empty((k, nv), np.float32),
            tokens=np.empty(k, np.int32),
            prob=np.empty(k),
            stats=np.empty((k + 1, 3), np.float32),
            onehot=np.zeros(k, np.uint8),
        )
        self.out = round_out(k, n_top)
        self._k_alloc = k

    def calibrate(self, target: Model, seq, n_hi: int, passes: int = 2) -> float:
        """Time target decodes of every batch size 1..n_hi not measured yet (once per engine, at the first use
        of auto; a larger draft_max later measures only the new sizes), so the policy reads the target's real
        cost curve, CPU tiles included (cost_model.py), instead of guessing the sizes it never used. Each size up
        to SECOND_PASS_MAX is timed `passes` times, up then down, and the fastest kept: other jobs on the machine
        only ever slow a decode down, and one slowed sample would distort the curve's shape (the level follows
        the load later).
        The cache must hold seq[:-1]; the timed rows are dropped again. Returns the seconds it took."""
        todo = [n for n in range(1, n_hi + 1) if not self.lengths.verify.measured_at(n)]
        todo = [n for n in todo if len(seq) - 1 + n <= target.n_ctx]
        if not todo or len(target.tokens) != len(seq) - 1:
            return 0.0
        t0 = perf_counter()
        base = len(target.tokens)
        filler = [int(seq[-1])] * max(todo)
        best = dict.fromkeys(todo, float("inf"))
        try:
            target.decode(filler, "from:0")  # the largest batch first: llama.cpp sizes its buffers for it
            target.synchronize()
            target.truncate(base)
            for p in range(passes):  # later passes only for the small sizes, where the tiles decide (cost: ~9 s
                # once per engine on the wide demo target idle, ~0.5 s on the Q4_1 demo)
                sizes = todo if p == 0 else [n for n in todo if n <= SECOND_PASS_MAX]
                for n in sizes if p % 2 == 0 else sizes[::-1]:
                    t = perf_counter()
                    target.decode(filler[:n], "from:0")
                    target.synchronize()
                    best[n] = min(best[n], perf_counter() - t)
                    target.truncate(base)
        finally:
            target.truncate(base)
        for n in todo:
            self.lengths.verify.observe(n, best[n])
        return perf_counter() - t0

    def propose(self, seq, limit: int, s: Settings, rng, stats) -> tuple[int, Source | None, int, float]:
        """This round's drafts, by the settings' drafter and draft-length policy. Returns (how many were
        drafted, their source for `DraftLength.observe`, the k chosen, seconds spent drafting).

        Prompt lookup goes first when the drafter allows it: the lookup is free, and the match it finds says how
        far it can be trusted (its class), so k is chosen after it. With `ngram+model` the model drafts when
        lookup finds nothing or its class is not worth drafting from; with `ngram` such a round is a plain step."""
        if s.drafter != "model":
            t = perf_counter()
            if self.ngram is None or (self.ngram.ngram_min, self.ngram.ngram_max) != (s.ngram_min, s.ngram_max):
                self.ngram = NgramDrafter(s.ngram_min, s.ngram_max)
            self.lengths.score_shadow(seq)
            tokens = self.ngram.propose(seq, min(limit, self.lengths.k_max))
            source: Source = ("ngram", match_class(self.ngram.match_length))
            k = self.lengths.choose(source, limit) if tokens else 0
            if tokens and not k:
                self.lengths.shadow(source, tokens, len(seq))
            del tokens[k:]
            self.chain.admit(tokens)  # only what the grammar allows
            if tokens or s.drafter == "ngram":
                self._one_hot(tokens)
                dt = perf_counter() - t
                stats.seconds_draft += dt
                return len(tokens), source if tokens else None, k, dt
        assert self.draft is not None, "the model drafter has a draft (Settings.check_draft)"
        k = self.lengths.choose(MODEL, limit, behind=len(seq) - len(self.draft.tokens))
        before = stats.seconds_draft
        self._catch_up_seconds = 0.0
        n = self._draft(seq, k, s, rng, stats)
        # catching up after plain steps is not the price of drafting these tokens (the budget pays for it)
        return n, MODEL, k, stats.seconds_draft - before - self._catch_up_seconds

    def _one_hot(self, tokens: list[int]) -> None:
        """Prompt-lookup drafts: q is one-hot on each proposed token (FSD.md), so the SD test accepts with
        probability p(d) and the sampled replacement comes from p without d."""
        d, nv = self.drafts, self.n_vocab
        for i, tok in enumerate(tokens):
            d.tokens[i], d.prob[i], d.onehot[i] = tok, 1.0, 1
            d.stats[i] = (0.0, 0.0, 0.0)  # processed one-hot row: max 0, only logits >= 0 kept, log-normaliser 0
            d.rows[i, :nv] = -np.inf
            d.rows[i, tok] = 0.0

    def _draft(self, seq, k, s: Settings, rng, stats) -> int:
        """Propose up to k tokens; keep each raw row (the draft context overwrites its buffer)."""
        if k <= 0:
            return 0

        d, nv, q = self.draft, self.n_vocab, self.drafts.rows
        assert d is not None, "speculative modes have a draft (Settings.check_draft)"
        us = rng.random(k) if s.temperature > 0 else np.zeros(k)
        t = perf_counter()
        behind = seq[len(d.tokens) :]
        d.decode(behind, "last")
        d.synchronize()
        dt = perf_counter() - t
        stats.seconds_draft += dt
        self._catch_up_seconds = 0.0
        if len(behind) > PENDING_MAX:  # more than the round's own pending tokens: it skipped rounds (plain steps)
            self._catch_up_seconds = dt
            self.lengths.observe_catch_up(len(behind), dt)
        n = 0
        for i in range(k):
            q[i, :nv] = d.logits(1)[0, :nv]
            self.chain.draft_row(q[i], i)
            tok, p_tok, p_top = pick(
                q[i], nv, s.temperature, s.top_k, s.top_p, s.min_p, us[i], self.drafts.stats[i], s.draft_p_min > 0
            )
            if p_top < s.draft_p_min:
                break
            self.drafts.tokens[i] = tok
            self.drafts.prob[i] = p_tok
            self.drafts.onehot[i] = 0
            n = i + 1
            if not self.chain.push(tok):  # the grammar is complete: only the end of the reply may follow
                break
            if n < k:
                t = perf_counter()
                d.decode([int(tok)], "last")
                d.synchronize()
                stats.seconds_draft += perf_counter() - t
        return n
