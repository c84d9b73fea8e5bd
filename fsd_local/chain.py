"""The logit-processing chain: logit bias, repetition penalties, then a grammar's mask, applied alike to the
draft's and the target's rows of a round, each row as if the drafts before it had been accepted
(docs/design.md, "The chain, and what tau = 0 guarantees")."""

from __future__ import annotations

import numpy as np

from fsd_local.constrain import Constraint, compile_grammar
from fsd_local.kernels.penalties import (
    Penalties,
    apply_bias,
    apply_mask,
    apply_penalties,
    new_window,
    penalise_row,
    window_move,
)
from fsd_local.kernels.typed import Typed
from fsd_local.settings import Settings


class Chain:
    """The processing of one generation's rows. The round's protocol (drafters and verify): `draft_row(row, j)`
    then `push(d_j)` per draft (`admit` for prompt lookup); `target_rows(P, n)` on the target's n + 1 rows;
    `settle(n_accepted, token)` once the round's text is known. `force(limit)` pushes what the grammar forces."""

    def __init__(self, s: Settings, n_vocab: int, model=None):
        self.n = n_vocab
        self.bias_ids = np.array([t for t, _ in s.logit_bias], np.int32)
        self.bias_values = np.array([b for _, b in s.logit_bias], np.float64)
        self.pen = Penalties(float(s.repeat_penalty), float(s.frequency_penalty), float(s.presence_penalty))
        penalised = s.repeat_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
        self.last_n = s.repeat_last_n if penalised else 0
        self.window = new_window(n_vocab) if self.last_n else None
        self.constraint = None
        if s.grammar is not None or s.json_schema is not None:
            self.constraint = Constraint(model, compile_grammar(s.grammar, s.json_schema), n_vocab)
        self.jump = self.constraint is not None and s.jump_forward  # forced tokens are proposed (`force`)
        self.text = np.zeros(0, np.int32)  # the accepted text (prompt and output), self.size long
        self.size = 0
        self.pending = np.zeros(64, np.int32)  # this round's drafts pushed so far
        self.n_pending = 0
        self._past_counts: np.ndarray | None = None  # scratch of past_row
        self.active = bool(len(self.bias_ids) or self.last_n or self.constraint)
        self.typed = Typed()  # the row kernels, typed at their first call (numba's dispatch types named tuples)

    def start(self, text) -> Chain:
        """The accepted text the first round follows (the prompt)."""
        if self.active:
            self.size = 0
            self._append(np.asarray(text, np.int32))
        return self

    def _append(self, tokens: np.ndarray) -> None:
        """Extend the accepted text, and move the penalties' window with it."""
        old, new = self.size, self.size + len(tokens)
        if new > len(self.text):
            self.text = np.resize(self.text, max(2 * len(self.text), new, 64))
        self.text[old:new] = tokens
        self.size = new
        if self.window is not None:
            keep = new if self.last_n < 0 else self.last_n
            window_move(self.window, self.text, old, new, max(0, old - keep), max(0, new - keep))

    def _row(self, row: np.ndarray, j: int) -> None:
        """Process one row in place as position j of this round (after the accepted text and drafts[:j])."""
        if len(self.bias_ids):
            self.typed.call(apply_bias, row, self.bias_ids, self.bias_values)
        if self.window is not None:
            lo, drop, p_lo = self.size, 0, 0  # the whole text (repeat_last_n -1): nothing leaves the window
            if self.last_n >= 0:  # drafts[:j] push the oldest tokens out of a full window (and, past it, each other)
                held = min(self.size, self.last_n)
                lo, drop, p_lo = self.size - held, min(held, max(0, held + j - self.last_n)), max(0, j - self.last_n)
            self.typed.call(penalise_row, row, self.pen, self.window, self.text, lo, lo + drop, self.pending, p_lo, j)
        if self.constraint is not None:
            bits = self.constraint.mask(j)
            n = min(row.shape[0], 32 * bits.shape[0])
            apply_mask(row, n, bits)
            row[n:] = -np.inf  # padding entries past the grammar's vocabulary

    def draft_row(self, row: np.ndarray, j: int) -> None:
        """The draft's row for draft position j (drafts[:j] already pushed)."""
        if self.active:
            self._row(row, j)

    def past_row(self, row: np.ndarray, pos: int) -> bool:
        """Process a row in place as it was (or would have been) processed at text position pos, after text[:pos]:
        the draft's rows of text it skipped, scored after the fact (drafting/proposer.py `catch_up`). False, and
        the row untouched, under a grammar: its state has moved past that position."""
        if not self.active:
            return True
        if self.constraint is not None:
            return False
        if len(self.bias_ids):
            apply_bias(row, self.bias_ids, self.bias_values)
        if self.window is not None:
            if self._past_counts is None:
                self._past_counts = np.zeros(self.n, np.int32)
            lo = 0 if self.last_n < 0 else max(0, pos - self.last_n)
            apply_penalties(row, self.text[lo:pos], self.pen, self._past_counts)
        return True

    def allows(self, j: int, token: int) -> bool:
        """Whether `token` may be the draft at position j (prompt lookup proposes without a row)."""
        return self.constraint is None or self.constraint.allows(j, token)

    def admit(self, tokens: list[int]) -> None:
        """Prompt-lookup drafts: keep (and push) the longest prefix the grammar allows, in place."""
        if not self.active:
            return
        for j, tok in enumerate(tokens):
            if not self.allows(j, tok):
                del tokens[j:]
                return
            if not self.push(tok):
                del tokens[j + 1 :]
                return

    def push(self, token: int) -> bool:
        """Draft token d_j proposed: later rows see it. False when the grammar is complete (draft no further)."""
        if not self.active:
            return True
        if self.n_pending == len(self.pending):
            self.pending = np.resize(self.pending, 2 * len(self.pending))
        self.pending[self.n_pending] = token
        self.n_pending += 1
        if self.constraint is None:
            return True
        self.constraint.push(token)
        return not self.constraint.finished

    def force(self, limit: int) -> list[int]:
        """Push the tokens the grammar forces after the accepted text and this round's drafts (at most `limit`,
        none past the grammar's end) and return them: [] without jump_forward or where the grammar leaves a
        choice. They are drafts like any other: verified by the target, rolled back by `settle` if rejected."""
        if not self.jump:
            return []
        assert self.constraint is not None, "jump_forward acts under a constraint"
        forced = self.constraint.forced(limit)
        for i, tok in enumerate(forced):
            if not self.push(tok):  # the grammar is complete after it: nothing may follow but the end
                del forced[i + 1 :]
                break
        return forced

    def target_rows(self, rows: np.ndarray, n_drafts: int) -> None:
        """The target's rows 0..n_drafts of this round, in place (row j scores the slot after drafts[:j])."""
        if self.active:
            self.n_pending = min(self.n_pending, n_drafts)
            for j in range(n_drafts + 1):
                self._row(rows[j], j)

    def settle(self, accepted: int, token: int) -> None:
        """The round kept `accepted` drafts and emitted `token`: the chain's text moves on by those tokens."""
        if self.active:
            emitted = np.append(self.pending[: min(accepted, self.n_pending)], np.int32(token))
            self.n_pending = 0
            self._append(emitted)
            if self.constraint is not None:
                self.constraint.settle(accepted, token)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the reply may follow."""
        return self.constraint is not None and self.constraint.finished
