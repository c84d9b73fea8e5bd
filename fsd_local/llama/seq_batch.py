"""One llama_decode whose entries come from several sequences of a Model (ModelOptions.n_seq > 1): each sequence
one contiguous run after what its cache holds, output rows on a tail of it; `rows(seq_id)` is its slice, read in
batch order through llama_get_logits (docs/design.md, "Several sequences in one context")."""

from __future__ import annotations

import ctypes
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np

from fsd_local.llama.bindings import lc

if TYPE_CHECKING:
    from fsd_local.llama.model import Model

_INT_P = ctypes.POINTER(ctypes.c_int)


def first_row(n: int, logits: str) -> int:
    """The first of n tokens given an output row: logits 'last', 'none' or 'from:J' (rows for tokens[J:])."""
    j = n - 1 if logits == "last" else (n if logits == "none" else int(logits[5:]) if logits[:5] == "from:" else -1)
    if not 0 <= j <= n:
        raise ValueError(f"logits must be 'last', 'none' or 'from:J' with 0 <= J <= {n}, got {logits!r}")
    return j


class SeqBatch:
    """Entries of one decode from several sequences of `model`, filled by vector writes into arrays it owns (the
    llama_batch points at them; llama.cpp never frees them). Reusable: `decode` empties it for the next one."""

    def __init__(self, model: Model) -> None:
        nb = model.n_batch
        self.model = model
        self._token = np.zeros(nb, np.int32)
        self._pos = np.zeros(nb, np.int32)
        self._n_seq_id = np.ones(nb, np.int32)  # one sequence an entry
        self._seq_id = np.zeros(nb, np.int32)
        self._want = np.zeros(nb, np.int8)
        # entry j's sequence list is the one element _seq_id[j], so writing sequence ids is one slice assignment
        base = self._seq_id.ctypes.data
        self._seq_ptrs = (_INT_P * nb)(*(ctypes.cast(base + 4 * j, _INT_P) for j in range(nb)))
        self._at = np.arange(model.n_ctx, dtype=np.int32)  # each position a sequence can reach, to copy from
        b: Any = lc.llama_batch()
        self._batch = b
        b.token = self._token.ctypes.data_as(_INT_P)
        b.pos = self._pos.ctypes.data_as(_INT_P)
        b.n_seq_id = self._n_seq_id.ctypes.data_as(_INT_P)
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(_INT_P))
        b.logits = self._want.ctypes.data_as(ctypes.POINTER(ctypes.c_byte))
        # (seq_id, first entry, entries, first output row, output rows)
        self._groups: list[tuple[int, int, int, int, int]] = []
        self._rows: dict[int, tuple[int, int]] = {}  # the last decode's output rows: seq_id -> (first row, count)
        self.n = 0  # entries so far
        self.n_rows = 0  # output rows so far

    def add(self, seq_id: int, tokens, logits: str = "last") -> None:
        """Sequence seq_id's next tokens, with output rows as Model.decode's `logits` says. One run per sequence
        per decode; the room in its cache (and, unified, in the shared cells) is checked here."""
        m, n = self.model, len(tokens)
        if not 0 <= seq_id < m.n_seq:
            raise ValueError(f"{m.role} model: sequence {seq_id} asked; its context holds sequences 0..{m.n_seq - 1}")
        if any(g[0] == seq_id for g in self._groups):
            raise ValueError(f"{m.role} model: sequence {seq_id} already has tokens in this batch (one run each)")
        j = first_row(n, logits)
        if n == 0:
            return
        if self.n + n > m.n_batch:
            raise ValueError(f"{m.role} model: {self.n + n} batch entries; a decode takes at most {m.n_batch}")
        m._check_room(n, seq_id, others=self.n)
        at, base = slice(self.n, self.n + n), len(m.seqs[seq_id])
        self._token[at] = tokens
        self._pos[at] = self._at[base : base + n]
        self._seq_id[at] = seq_id
        self._want[at] = 0
        self._want[self.n + j : self.n + n] = 1
        self._groups.append((seq_id, self.n, n, self.n_rows, n - j))
        self.n += n
        self.n_rows += n - j

    def decode(self) -> None:
        """One llama_decode of every entry added; then each sequence's mirror holds its tokens and `rows` maps
        its output rows. On failure llama.cpp restores the cache and every mirror is set back to match it."""
        m, groups = self.model, self._groups
        self._groups = []
        n, self.n, n_rows, self.n_rows = self.n, 0, self.n_rows, 0
        if not n:
            return
        assert m.ctx, f"{m.role} model is closed"
        self._batch.n_tokens = n
        t = perf_counter()
        rc = lc.llama_decode(m.ctx, self._batch)
        m.decode_seconds += perf_counter() - t
        self._rows = {}
        if rc != 0:
            m._failed(rc, [g[0] for g in groups])
        for seq_id, start, count, row, n_out in groups:
            m.seqs[seq_id].extend(self._token[start : start + count].tolist())
            self._rows[seq_id] = (row, n_out)
            m._call[seq_id] = (len(m.seqs[seq_id]), count)  # what a recurrent state's snapshots can roll back
        m.n_outputs = n_rows
        m._view_rows = 0  # read the rows through llama_get_logits: batch order (module docstring)

    def row_range(self, seq_id: int) -> tuple[int, int]:
        """(first, count) of sequence seq_id's rows among the last decode's output rows."""
        rows = self._rows.get(seq_id)
        if rows is None:
            raise ValueError(f"{self.model.role} model: sequence {seq_id} had no tokens in the last batch decode")
        return rows

    def rows(self, seq_id: int) -> np.ndarray:
        """Zero-copy view of sequence seq_id's output rows of the last decode, shape (count, n_vocab), in the
        order of its tokens; valid until the model's next decode."""
        first, count = self.row_range(seq_id)
        if not count:
            raise ValueError(f"{self.model.role} model: sequence {seq_id} asked no logit rows in the last decode")
        return self.model.logits()[first : first + count]
