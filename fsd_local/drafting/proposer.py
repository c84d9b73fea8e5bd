"""This round's drafts: who proposes them (the draft model, prompt lookup, or lookup first) and how many
(drafting/length.py), written into the buffers the acceptance kernel reads (kernels/accept.py `Drafts`)."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from fsd_local.chain import Chain
from fsd_local.drafting.length import PENDING_MAX, DraftLength, Source
from fsd_local.drafting.ngram import NgramDrafter, match_class
from fsd_local.kernels.accept import Drafts, RoundOut, round_out, rule_of, sampling_of, score_slots
from fsd_local.kernels.sampling import pick
from fsd_local.llama.model import Model
from fsd_local.settings import Settings

MODEL: Source = ("model", 0)
# the target's rows of the latest plain steps kept for scoring the draft model's catch-up (length.py): a probe
# after a long plain streak scores its last ROWS_KEPT positions (it catches up on all of them)
ROWS_KEPT = 16
CALIBRATE_CATCH_UP = 8  # the catch-up batch the draft model's calibration times
SECOND_PASS_MAX = 9  # calibration times batches up to this size twice (the tiles of 4 and 8 rows, and one more)


class Proposer:
    """Owns the per-round buffers and the drafters of one engine. `propose` fills `drafts` for the kernel."""

    def __init__(self, draft: Model | None, n_vocab: int, k: int) -> None:
        self.draft, self.n_vocab = draft, n_vocab
        self.lengths = DraftLength()  # measured costs and acceptance: how many tokens a round should draft
        self.chain = Chain(Settings(), [], n_vocab)  # the generation's logit processing (the engine sets it per call)
        self.ngram: NgramDrafter | None = None
        self._catch_up_seconds = 0.0
        self._kept: np.ndarray | None = None  # (ROWS_KEPT, n_vocab): target rows of plain steps, by position
        self._kept_pos = np.full(ROWS_KEPT, -1, np.int64)
        self.keeps_rows = False  # this generation keeps them (auto with the draft model, no grammar)
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

    def start(self, s: Settings) -> None:
        """A new generation: its text is new, so no kept row applies; keep rows only where a probe may use them."""
        self._kept_pos[:] = -1
        self.rule, self.sampling = rule_of(s), sampling_of(s)
        self.keeps_rows = (
            self.draft is not None
            and s.draft_policy == "auto"
            and s.drafter != "ngram"
            and self.chain.constraint is None
        )

    def keep_target_row(self, pos: int, row: np.ndarray) -> None:
        """The target's (processed) row for text position pos, from a plain step: the draft may be scored on it."""
        if self._kept is None:
            self._kept = np.empty((ROWS_KEPT, self.n_vocab), np.float32)
        i = pos % ROWS_KEPT
        self._kept[i] = row[: self.n_vocab]
        self._kept_pos[i] = pos

    def _scorable(self, seq) -> list[int]:
        """Positions the draft model skipped that a kept target row can score (each emitted: p < len(seq))."""
        lo = max(len(self.draft.tokens) + 1 if self.draft else 0, len(seq) - ROWS_KEPT)
        return [p for p in range(lo, len(seq)) if self._kept_pos[p % ROWS_KEPT] == p]

    def catch_up(self, seq, s: Settings, tau: float, rng, stats) -> None:
        """Decode the text the draft model skipped in one batch, with a row for every position a kept target row
        can score, and score each as the round would have (kernels/accept.py `score_slots`): the outcomes are
        the policy's evidence under the current settings (length.py). The draft's last row (for the next
        position) is left as the first draft's row."""
        d = self.draft
        assert d is not None, "only the draft model catches up"
        base, todo = len(d.tokens), seq[len(d.tokens) :]
        scored = self._scorable(seq)
        first = scored[0] - base - 1 if scored else len(todo) - 1  # output rows from the first scored position
        t = perf_counter()
        d.decode(todo, f"from:{first}")
        d.synchronize()
        dt = perf_counter() - t
        stats.seconds_draft += dt
        self._catch_up_seconds += dt
        self.lengths.observe_catch_up(len(todo), dt)
        if not scored:
            return
        rows = d.logits(len(todo) - first)  # row r: position base + first + r + 1
        q_idx = np.array([p - base - first - 1 for p in scored], np.int64)
        if not all(self.chain.past_row(rows[i], p) for i, p in zip(q_idx, scored)):
            return  # a grammar: the draft's rows of the past cannot be processed as they were
        n = len(scored)
        us = rng.random((n, 2)) if s.temperature > 0 else np.zeros((n, 2))
        out = np.zeros(n, np.uint8)
        p_idx = np.array([p % ROWS_KEPT for p in scored], np.int64)
        assert self._kept is not None, "scored positions have kept rows"
        score_slots(
            self._kept, p_idx, rows, q_idx, self.n_vocab, self.rule, self.sampling, tau, us, self.drafts.stats[0], out
        )
        self.lengths.observe_stream(MODEL, out)
        stats.probed += n

    def calibrate_draft(self, seq, passes: int = 3) -> None:
        """Time the draft model's one-token decode and a catch-up batch of CALIBRATE_CATCH_UP tokens (the fastest
        of `passes` each), once per engine: what drafting and catching up cost is then known before the first
        probe or draft, instead of a prior. The cache must hold seq[:-1]; the timed rows are dropped again."""
        d = self.draft
        cm = self.lengths.cost(MODEL)
        if d is None or cm.draft_measured or len(d.tokens) != len(seq) - 1 or len(seq) + CALIBRATE_CATCH_UP > d.n_ctx:
            return
        base, one, batch = len(d.tokens), float("inf"), float("inf")
        filler = [int(seq[-1])] * CALIBRATE_CATCH_UP
        try:
            for _ in range(passes):
                for n in (1, CALIBRATE_CATCH_UP):
                    t = perf_counter()
                    d.decode(filler[:n], "last" if n == 1 else "from:0")
                    d.synchronize()
                    dt = perf_counter() - t
                    one, batch = (min(one, dt), batch) if n == 1 else (one, min(batch, dt))
                    d.truncate(base)
        finally:
            d.truncate(base)
        cm.observe_draft(1, one)
        self.lengths.observe_catch_up(CALIBRATE_CATCH_UP, batch)

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

    def propose(self, seq, limit: int, s: Settings, tau: float, rng, stats) -> tuple[int, Source | None, int, float]:
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
        before = stats.seconds_draft
        self._catch_up_seconds = 0.0
        behind = len(seq) - len(self.draft.tokens)
        if self.keeps_rows and self.lengths.probe(MODEL, behind, len(self._scorable(seq)), limit + 1):
            self.catch_up(seq, s, tau, rng, stats)  # what the skipped text says is worth its catch-up
            behind = 0
        k = self.lengths.choose(MODEL, limit, behind=behind)
        n = self._draft(seq, k, s, tau, rng, stats)
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

    def _draft(self, seq, k, s: Settings, tau: float, rng, stats) -> int:
        """Propose up to k tokens; keep each raw row (the draft context overwrites its buffer)."""
        if k <= 0:
            return 0

        d, nv, q = self.draft, self.n_vocab, self.drafts.rows
        assert d is not None, "speculative modes have a draft (Settings.check_draft)"
        us = rng.random(k) if s.temperature > 0 else np.zeros(k)
        if len(seq) - len(d.tokens) > PENDING_MAX:  # it skipped rounds (plain steps): catch up, scoring them
            self.catch_up(seq, s, tau, rng, stats)
        else:
            t = perf_counter()
            d.decode(seq[len(d.tokens) :], "last")
            d.synchronize()
            stats.seconds_draft += perf_counter() - t
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
