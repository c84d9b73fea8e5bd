"""What each KV sequence of a model holds, mirrored in Python lists: rewinding a sequence, reusing its longest
common prefix, the room left. A base of `Model` (model.py), which owns the context these act on."""

from __future__ import annotations

from typing import Any

import numpy as np

from fsd_local.errors import CacheTruncationError, ContextOverflowError
from fsd_local.llama.bindings import lc

SEQ = 0  # the sequence of single-sequence callers


def check_rewindable(models, mode: str) -> None:
    """Raise CacheTruncationError naming the first of `models`, those `mode` rewinds within a reply, that keeps a
    recurrent state."""
    for m in models:
        if m.recurrent:
            raise CacheTruncationError(
                f"{m.role} model {m.path} ({m.architecture}) keeps a recurrent state, which fsd-local cannot yet "
                f"rewind to the accepted text after a rejection, as mode {mode!r} needs: decode it plainly with "
                "--mode ar (a target alone: --draft none)"
            )


class SequenceCache:
    """`seqs[s]` is the token at each position 0..len-1 of sequence s's cache (`tokens` is seqs[0]); every method
    keeps the lists and the cache equal, editing the lists in place."""

    mem: Any
    role: str
    path: str
    tokens: list[int]
    seqs: list[list[int]]
    n_ctx: int  # the most one sequence holds
    n_cells: int  # every sequence's together
    n_seq: int
    _shared: bool  # a unified cache: the sequences share its cells
    architecture: str
    recurrent: bool  # part of its state is recurrent (llama_model_is_recurrent / is_hybrid): no suffix drops

    def truncate(self, n: int, seq_id: int = SEQ) -> int:
        """Drop every position >= n of a sequence; returns how many it keeps. A recurrent state cannot drop a
        suffix: the sequence is emptied (0 kept) and the next decode evaluates its text again."""
        toks = self.seqs[seq_id]
        if n >= len(toks):
            return len(toks)
        if self.recurrent and n > 0:
            # llama_memory_seq_rm would refuse, or answer True on a wrong state (llama-cpp-notes.md)
            self.drop(seq_id)
            return 0
        if not lc.llama_memory_seq_rm(self.mem, seq_id, n, -1):
            raise CacheTruncationError(
                f"{self.role} model {self.path}: llama.cpp refused to drop KV positions >= {n}; this model's "
                "cache cannot be rewound, so it cannot be used for speculative decoding"
            )
        del toks[n:]
        return n

    def forget_unknown_tail(self, seq_id: int = SEQ) -> None:
        """After an interruption: drop any cache positions beyond what the sequence's mirror records (a recurrent
        state cannot drop them alone: the sequence is emptied)."""
        if self._pos_max(seq_id) < len(self.seqs[seq_id]):
            return
        if self.recurrent:
            self.drop(seq_id)
        else:
            lc.llama_memory_seq_rm(self.mem, seq_id, len(self.seqs[seq_id]), -1)

    def clear(self) -> None:
        """Empty every sequence."""
        lc.llama_memory_clear(self.mem, True)
        for toks in self.seqs:
            toks.clear()

    def drop(self, seq_id: int) -> None:
        """Empty one sequence (llama.cpp never refuses to remove a whole sequence); the others stay."""
        lc.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        self.seqs[seq_id].clear()

    def keep_common_prefix(self, seq, start: int = 0, seq_id: int = SEQ) -> int:
        """Truncate sequence seq_id's cache to its longest common prefix with seq[:-1] (known equal below
        `start`); returns how many tokens it keeps. The last token of seq is never kept: its logits are what the
        next decode must produce."""
        toks = self.seqs[seq_id]
        n = min(len(toks), len(seq) - 1)
        i = min(start, n)
        while i < n and toks[i] == seq[i]:
            i += 1
        return self.truncate(i, seq_id)

    def reuse_after_cut(self, seq, min_reuse: int = 8, seq_id: int = SEQ) -> int:
        """Where seq is the cached text with a span cut out after their common prefix, remove that span and shift what
        follows back; returns how many cached tokens now match seq. Nothing changes when under `min_reuse` tokens would
        be saved or the cache cannot shift. Approximate, hence opt-in (context_shift)."""
        toks = np.asarray(self.seqs[seq_id], dtype=np.int64)
        want = np.asarray(seq[:-1], dtype=np.int64)
        n = min(len(toks), len(want))
        diff = np.flatnonzero(toks[:n] != want[:n])
        a = int(diff[0]) if diff.size else n
        if a >= len(want) or a >= len(toks) - min_reuse or self.recurrent or not lc.llama_memory_can_shift(self.mem):
            return a
        best_b, best_m = 0, 0
        for b in a + 1 + np.flatnonzero(toks[a + 1 :] == want[a]):  # where the rest of seq could resume
            m = min(len(toks) - b, len(want) - a)
            miss = np.flatnonzero(toks[b : b + m] != want[a : a + m])
            m = int(miss[0]) if miss.size else m
            if m > best_m:
                best_b, best_m = int(b), m
        if best_m < min_reuse:
            return a
        if not lc.llama_memory_seq_rm(self.mem, seq_id, a, best_b):
            return a
        lc.llama_memory_seq_add(self.mem, seq_id, best_b, -1, a - best_b)
        del self.seqs[seq_id][a:best_b]
        return a + best_m

    def _check_room(self, n: int, seq_id: int = SEQ, others: int = 0) -> None:
        """Raise ContextOverflowError unless n more tokens fit sequence seq_id and, in a unified cache, the shared
        cells beside `others` tokens the same decode adds to other sequences."""
        if len(self.tokens if seq_id == SEQ else self.seqs[seq_id]) + n > self.n_ctx:
            whose = f"sequence {seq_id} of the {self.role}" if self.n_seq > 1 else self.role
            raise ContextOverflowError(
                f"{whose} context is full ({self.n_ctx} tokens); start a new conversation or raise --ctx"
            )
        if self._shared and sum(map(len, self.seqs)) + others + n > self.n_cells:
            raise ContextOverflowError(
                f"{self.role} context is full ({self.n_cells} tokens shared by {self.n_seq} sequences); "
                "wait for a conversation to end, or raise --ctx"
            )

    def _pos_max(self, seq_id: int = SEQ) -> int:
        return lc.llama_memory_seq_pos_max(self.mem, seq_id)
