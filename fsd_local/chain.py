"""The logit-processing chain: logit bias, repetition penalties and a grammar's mask, applied identically to the
draft's and the target's rows before any acceptance test (llama.cpp's order: bias, then penalties; the mask
last, so a banned token stays at -inf).

Every row is processed as if the drafts before it had been accepted: row j of a round (the draft's row for d_j,
the target's row j) sees the accepted text plus d_1..d_{j-1}, both for the penalties' window and for the
grammar's state. So the SD test, the divergences and the replacement all read the same processed rows, and
tau = 0 is exactly the target's processed distribution. A rejected draft penalises nothing: `settle` drops the
round's drafts and only the emitted text stays.

A chain with nothing to do (the default settings) is `None`-cheap: `active` is False and every hook returns at
once.
"""

from __future__ import annotations

import numpy as np

from fsd_local.constrain import Constraint, compile_grammar
from fsd_local.kernels.penalties import Penalties, apply_bias, apply_mask, apply_penalties
from fsd_local.settings import Settings


class Chain:
    """The processing of one generation's rows. The round's protocol (engine and proposer):
    `draft_row(row, j)` then `push(d_j)` per draft; `target_rows(P, n)` on the target's n + 1 rows;
    `settle(n_accepted, token)` once the round's text is known."""

    def __init__(self, s: Settings, seq: list[int], n_vocab: int, model=None):
        self.seq, self.n = seq, n_vocab  # the engine's accepted text (prompt and output), extended in place
        self.bias_ids = np.array([t for t, _ in s.logit_bias], np.int32)
        self.bias_values = np.array([b for _, b in s.logit_bias], np.float64)
        self.pen = Penalties(float(s.repeat_penalty), float(s.frequency_penalty), float(s.presence_penalty))
        penalised = s.repeat_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
        self.last_n = s.repeat_last_n if penalised else 0
        self.counts = np.zeros(n_vocab, np.int32) if self.last_n else None
        self.constraint = None
        if s.grammar is not None or s.json_schema is not None:
            self.constraint = Constraint(model, compile_grammar(s.grammar, s.json_schema), n_vocab)
        self.pending: list[int] = []  # this round's drafts pushed so far
        self.active = bool(len(self.bias_ids) or self.last_n or self.constraint)

    def _row(self, row: np.ndarray, j: int) -> None:
        """Process one row in place as position j of this round (after the accepted text and drafts[:j])."""
        if len(self.bias_ids):
            apply_bias(row, self.bias_ids, self.bias_values)
        if self.counts is not None:
            text = self.seq if self.last_n < 0 else self.seq[-self.last_n :]
            window = np.array(text + self.pending[:j], np.int32)
            if self.last_n > 0:
                window = window[-self.last_n :]
            apply_penalties(row, window, self.pen, self.counts)
        if self.constraint is not None:
            bits = self.constraint.mask(j)
            n = min(row.shape[0], 32 * bits.shape[0])
            apply_mask(row, n, bits)
            row[n:] = -np.inf  # padding entries past the grammar's vocabulary

    def past_row(self, row: np.ndarray, pos: int) -> bool:
        """Process a row in place as it was (or would have been) processed at text position pos, after seq[:pos]:
        the draft's rows of text it skipped, scored after the fact (drafting/proposer.py `catch_up`). False, and
        the row untouched, under a grammar: its state has moved past that position."""
        if not self.active:
            return True
        if self.constraint is not None:
            return False
        if len(self.bias_ids):
            apply_bias(row, self.bias_ids, self.bias_values)
        if self.counts is not None:
            lo = 0 if self.last_n < 0 else max(0, pos - self.last_n)
            apply_penalties(row, np.array(self.seq[lo:pos], np.int32), self.pen, self.counts)
        return True

    def draft_row(self, row: np.ndarray, j: int) -> None:
        """The draft's row for draft position j (drafts[:j] already pushed)."""
        if self.active:
            self._row(row, j)

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
        self.pending.append(int(token))
        if self.constraint is None:
            return True
        self.constraint.push(token)
        return not self.constraint.finished

    def target_rows(self, rows: np.ndarray, n_drafts: int) -> None:
        """The target's rows 0..n_drafts of this round, in place (row j scores the slot after drafts[:j])."""
        if self.active:
            del self.pending[n_drafts:]
            for j in range(n_drafts + 1):
                self._row(rows[j], j)

    def settle(self, accepted: int, token: int) -> None:
        """The round kept `accepted` drafts and emitted `token`: the chain's text moves on (the engine's seq is
        extended after this call or before it; the penalties read it at the next row)."""
        if self.active:
            self.pending.clear()
            if self.constraint is not None:
                self.constraint.settle(accepted, token)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the reply may follow."""
        return self.constraint is not None and self.constraint.finished
