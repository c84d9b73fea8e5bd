"""What each KV sequence of a model holds, mirrored in Python lists: rewinding a sequence, reusing its longest
common prefix, the room left. A base of `Model` (model.py), which owns the context these act on."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from fsd_local.errors import CacheTruncationError, ContextOverflowError
from fsd_local.llama.bindings import lc

SEQ = 0  # the sequence of single-sequence callers
# host copies of a recurrent state kept (`keep_state`): a reply's end, the next prompt's end and that reply's end,
# so a regenerated reply, an edited last message or a reformatted reply goes back to one of them
SAVED_MAX = 3
PARTIAL = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # a hybrid's recurrent part alone: its attention drops positions


def check_rewindable(models, mode: str) -> None:
    """Raise CacheTruncationError naming the first of `models`, those `mode` rewinds within a reply, whose recurrent
    state this engine cannot rewind (`SequenceCache.rewinds`)."""
    for m in models:
        if m.recurrent and not m.rewinds:  # a Model loaded by hand (the engine asks for one or the other)
            raise CacheTruncationError(
                f"{m.role} model {m.path} ({m.architecture}) keeps a recurrent state, loaded with neither snapshots "
                f"nor a checkpoint (ModelOptions n_rs_seq, checkpoint); mode {mode!r} rewinds it after every "
                "rejection: load it with checkpoint=True, or decode it plainly with --mode ar"
            )


class SequenceCache:
    """`seqs[s]` is the token at each position 0..len-1 of sequence s's cache (`tokens` is seqs[0]); every method
    keeps the lists and the cache equal, editing the lists in place."""

    ctx: Any
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
    recurrent: bool  # part of its state is recurrent (llama_model_is_recurrent / is_hybrid): no plain suffix drops
    # how a recurrent state rewinds (docs/design.md, "Models with a recurrent state"), per sequence s: n_rs_seq, the
    # trailing tokens of its last decode call llama.cpp keeps snapshots for; sequence _spare + s holds its
    # checkpoint (_spare -1: none), _mark[s] the tokens it holds (-1: none kept); _call[s], (end, tokens) of its last
    # decode call, (0, 0) once anything shortened it
    n_rs_seq: int
    rewinds: bool  # a round can rewind it: no recurrent state, snapshots, or spares
    _spare: int
    _mark: list[int]
    _call: list[tuple[int, int]]
    _saved: list[list[tuple[int, Any]]]  # each sequence's host copies of its recurrent state, oldest first

    @property
    def redecodes(self) -> bool:
        """Whether a rejection sends a sequence back to a checkpoint, so that the accepted text is decoded again."""
        return self._spare >= 0

    @property
    def rollback_max(self) -> int:
        """The most tokens a round may propose past the text: what a recurrent state's snapshots drop, else any."""
        return self.n_rs_seq if self.recurrent and self.n_rs_seq > 0 else self.n_ctx

    def truncate(self, n: int, seq_id: int = SEQ) -> int:
        """Drop every position >= n of a sequence; returns how many it keeps. A recurrent state may keep fewer (its
        checkpoint's, or none): the caller decodes the text past what is kept (`_rewind_state`)."""
        toks = self.seqs[seq_id]
        if n >= len(toks):
            return len(toks)
        if self.recurrent:
            return self._rewind_state(n, seq_id)
        if not lc.llama_memory_seq_rm(self.mem, seq_id, n, -1):
            raise CacheTruncationError(
                f"{self.role} model {self.path}: llama.cpp refused to drop KV positions >= {n}; this model's "
                "cache cannot be rewound, so it cannot be used for speculative decoding"
            )
        del toks[n:]
        return n

    def _rewind_state(self, n: int, seq_id: int) -> int:
        """truncate for a recurrent state: by its snapshots where they hold position n, else back to the newest
        checkpoint or host copy of at most n tokens, else by emptying the sequence; returns how many it keeps."""
        toks = self.seqs[seq_id]
        end, count = self._call[seq_id]
        self._call[seq_id] = (0, 0)  # one rollback a decode call: llama.cpp keeps its pending snapshot index
        r = len(toks) - n
        if r <= self.n_rs_seq and end == len(toks) and count > r:
            # every dropped token came in the last decode call, and it had more: its snapshots hold the state at n.
            # Past that call, or all of it, seq_rm answers True on a wrong state (llama-cpp-notes.md)
            if not lc.llama_memory_seq_rm(self.mem, seq_id, n, -1):
                raise CacheTruncationError(
                    f"{self.role} model {self.path} ({self.architecture}): llama.cpp refused to roll its recurrent "
                    f"state back by {r} tokens within its {self.n_rs_seq} snapshots; decode it plainly with --mode ar"
                )
            del toks[n:]  # (a model with snapshots has no checkpoint: Model._create_context)
            self._forget_past(n, seq_id)
            return n
        return self._go_back(n, seq_id)

    def _go_back(self, n: int, s: int) -> int:
        """Sequence s back to its newest checkpoint or host copy of at most n tokens, or emptied; returns its
        length. Those holding more are forgotten: the text past n may change."""
        saved = max((m for m, _ in self._saved[s] if m <= n), default=-1)
        if 0 <= self._mark[s] <= n and self._mark[s] >= saved:
            kept = self._restore(s)
        elif saved < 0 or not self._load(saved, s):
            return self._emptied(s)
        else:
            kept = saved
        self._forget_past(kept, s)
        return kept

    def _emptied(self, seq_id: int) -> int:
        self.drop(seq_id)
        return 0

    def keep_state(self, s: int = SEQ) -> None:
        """Copy sequence s's recurrent state, as it is now, to the host (a transformer: nothing): a later truncate
        to at least its length may go back to it. The newest SAVED_MAX of each sequence are kept."""
        n = len(self.seqs[s])
        if not self.recurrent or n == 0 or any(m == n for m, _ in self._saved[s]):
            return
        size = lc.llama_state_seq_get_size_ext(self.ctx, s, PARTIAL)
        buf = (ctypes.c_uint8 * size)()
        if size and lc.llama_state_seq_get_data_ext(self.ctx, buf, size, s, PARTIAL) == size:
            self._saved[s] = [*self._saved[s], (n, buf)][-SAVED_MAX:]

    def _load(self, n: int, s: int) -> bool:
        """Sequence s back to its host copy of n tokens, the attention past them dropped; False where llama.cpp
        refuses (the caller then empties it)."""
        buf = next(b for m, b in self._saved[s] if m == n)
        if lc.llama_state_seq_set_data_ext(self.ctx, buf, len(buf), s, PARTIAL) != len(buf):
            return False
        if not lc.llama_memory_seq_rm(self.mem, s, n, -1):  # the recurrent state now ends at n: only attention
            return False
        del self.seqs[s][n:]
        return True

    def _forget_past(self, n: int, s: int) -> None:
        """Forget the checkpoint and host copies of sequence s that hold more than n tokens."""
        self._saved[s] = [(m, b) for m, b in self._saved[s] if m <= n]
        if self._mark[s] > n:
            self._forget_checkpoint(s)

    def checkpoint(self, s: int = SEQ) -> None:
        """Keep sequence s's state as it is now, where the model has spare sequences (ModelOptions.checkpoint on a
        recurrent model; elsewhere this does nothing): a truncate to at least this length goes back to it."""
        if self._spare < 0 or self._mark[s] == len(self.seqs[s]):
            return
        spare = self._spare + s
        lc.llama_memory_seq_rm(self.mem, spare, -1, -1)
        lc.llama_memory_seq_cp(self.mem, s, spare, -1, -1)  # cells shared: the state copied when s decodes on
        self._mark[s] = len(self.seqs[s])

    def _restore(self, s: int) -> int:
        """Sequence s back to its checkpoint (kept: a later rewind may go back to it again); returns its length."""
        lc.llama_memory_seq_rm(self.mem, s, -1, -1)
        lc.llama_memory_seq_cp(self.mem, self._spare + s, s, -1, -1)
        del self.seqs[s][self._mark[s] :]
        return self._mark[s]

    def _forget_checkpoint(self, s: int) -> None:
        if self._mark[s] >= 0:
            lc.llama_memory_seq_rm(self.mem, self._spare + s, -1, -1)
            self._mark[s] = -1

    def forget_unknown_tail(self, seq_id: int = SEQ) -> None:
        """After an interruption: drop any cache positions beyond what the sequence's mirror records (a recurrent
        state cannot drop them alone: it goes back to its checkpoint, or the sequence is emptied)."""
        if self._pos_max(seq_id) < len(self.seqs[seq_id]):
            return
        if self.recurrent:
            self._call[seq_id] = (0, 0)
            self._go_back(len(self.seqs[seq_id]), seq_id)
        else:
            lc.llama_memory_seq_rm(self.mem, seq_id, len(self.seqs[seq_id]), -1)

    def leave(self, seq, seq_id: int = SEQ) -> None:
        """After a call, whatever ended it (Ctrl-C, errors): sequence seq_id a prefix of seq (`forget_unknown_tail`,
        `keep_common_prefix`), its recurrent state kept there for a next turn (`keep_state`)."""
        self.forget_unknown_tail(seq_id)
        self.keep_common_prefix(seq, 0, seq_id)
        self.keep_state(seq_id)

    def forget_states(self) -> None:
        """No sequence has a checkpoint, a decode call to roll back or a host copy (a new context, or all emptied)."""
        self._mark, self._call = [-1] * self.n_seq, [(0, 0)] * self.n_seq
        self._saved = [[] for _ in range(self.n_seq)]

    def clear(self) -> None:
        """Empty every sequence."""
        lc.llama_memory_clear(self.mem, True)
        for toks in self.seqs:
            toks.clear()
        self.forget_states()

    def drop(self, seq_id: int) -> None:
        """Empty one sequence (llama.cpp never refuses to remove a whole sequence); the others stay."""
        lc.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        self.seqs[seq_id].clear()
        if self.recurrent:
            self._forget_past(0, seq_id)
            self._call[seq_id] = (0, 0)

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
