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
        if m.recurrent and not m.rewinds:
            if m.n_seq > 1:
                why = f"with {m.n_seq} sequences at once (--parallel), which fsd-local cannot yet rewind"
                fix = "--parallel 1, or decode it plainly with --mode ar"
            else:  # a Model loaded by hand with neither (the engine asks for one or the other)
                why = "loaded with neither snapshots nor a checkpoint (ModelOptions n_rs_seq, checkpoint)"
                fix = "load it with checkpoint=True, or decode it plainly with --mode ar"
            raise CacheTruncationError(
                f"{m.role} model {m.path} ({m.architecture}) keeps a recurrent state, {why}; mode {mode!r} rewinds "
                f"it after every rejection: {fix}"
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
    # how a recurrent state rewinds (docs/design.md, "Models with a recurrent state"): n_rs_seq, the trailing tokens
    # of its last decode call llama.cpp keeps snapshots for; _spare, the sequence holding sequence 0's checkpoint
    # (-1: none), _mark the tokens it holds (-1: none kept); _call, (end, tokens) of sequence 0's last decode call
    # of several tokens, (0, 0) once anything shortened it
    n_rs_seq: int
    rewinds: bool  # a round can rewind it: no recurrent state, snapshots, or a spare
    _spare: int
    _mark: int
    _call: tuple[int, int]
    _saved: list[tuple[int, Any]]  # host copies of sequence 0's recurrent state, oldest first: (tokens, bytes)

    @property
    def redecodes(self) -> bool:
        """Whether a rejection sends sequence 0 back to a checkpoint, so that the accepted text is decoded again."""
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
        end, count = self._call
        self._call = (0, 0)  # one rollback a decode call: llama.cpp keeps its pending snapshot index until the next
        r = len(toks) - n
        if seq_id == SEQ and r <= self.n_rs_seq and end == len(toks) and count > r:
            # every dropped token came in the last decode call, and it had more: its snapshots hold the state at n.
            # Past that call, or all of it, seq_rm answers True on a wrong state (llama-cpp-notes.md)
            if not lc.llama_memory_seq_rm(self.mem, seq_id, n, -1):
                raise CacheTruncationError(
                    f"{self.role} model {self.path} ({self.architecture}): llama.cpp refused to roll its recurrent "
                    f"state back by {r} tokens within its {self.n_rs_seq} snapshots; decode it plainly with --mode ar"
                )
            del toks[n:]  # (a model with snapshots has no checkpoint: Model._create_context)
            self._forget_past(n)
            return n
        return self._go_back(n) if seq_id == SEQ else self._emptied(seq_id)

    def _go_back(self, n: int) -> int:
        """Sequence 0 back to its newest checkpoint or host copy of at most n tokens, or emptied; returns its
        length. Those holding more are forgotten: the text past n may change."""
        saved = max((m for m, _ in self._saved if m <= n), default=-1)
        if 0 <= self._mark <= n and self._mark >= saved:
            kept = self._restore()
        elif saved < 0 or not self._load(saved):
            return self._emptied(SEQ)
        else:
            kept = saved
        self._forget_past(kept)
        return kept

    def _emptied(self, seq_id: int) -> int:
        self.drop(seq_id)
        return 0

    def keep_state(self) -> None:
        """Copy sequence 0's recurrent state, as it is now, to the host (a transformer, or several sequences:
        nothing): a later truncate to at least its length may go back to it. The newest SAVED_MAX are kept."""
        n = len(self.tokens)
        if not self.recurrent or self.n_seq > 1 or n == 0 or any(m == n for m, _ in self._saved):
            return
        size = lc.llama_state_seq_get_size_ext(self.ctx, SEQ, PARTIAL)
        buf = (ctypes.c_uint8 * size)()
        if size and lc.llama_state_seq_get_data_ext(self.ctx, buf, size, SEQ, PARTIAL) == size:
            self._saved = [*self._saved, (n, buf)][-SAVED_MAX:]

    def _load(self, n: int) -> bool:
        """Sequence 0 back to its host copy of n tokens, the attention past them dropped; False where llama.cpp
        refuses (the caller then empties it)."""
        buf = next(b for m, b in self._saved if m == n)
        if lc.llama_state_seq_set_data_ext(self.ctx, buf, len(buf), SEQ, PARTIAL) != len(buf):
            return False
        if not lc.llama_memory_seq_rm(self.mem, SEQ, n, -1):  # the recurrent state now ends at n: only attention
            return False
        del self.tokens[n:]
        return True

    def _forget_past(self, n: int) -> None:
        """Forget the checkpoint and host copies of sequence 0 that hold more than n tokens."""
        self._saved = [(m, b) for m, b in self._saved if m <= n]
        if self._mark > n:
            self._forget_checkpoint()

    def checkpoint(self) -> None:
        """Keep sequence 0's state as it is now, where the model has a spare sequence (ModelOptions.checkpoint on a
        recurrent model; elsewhere this does nothing): a truncate to at least this length goes back to it."""
        if self._spare < 0 or self._mark == len(self.tokens):
            return
        lc.llama_memory_seq_rm(self.mem, self._spare, -1, -1)
        lc.llama_memory_seq_cp(self.mem, SEQ, self._spare, -1, -1)  # cells shared: copied when sequence 0 decodes
        self._mark = len(self.tokens)

    def _restore(self) -> int:
        """Sequence 0 back to its checkpoint (kept: a later rewind may go back to it again); returns its length."""
        lc.llama_memory_seq_rm(self.mem, SEQ, -1, -1)
        lc.llama_memory_seq_cp(self.mem, self._spare, SEQ, -1, -1)
        del self.tokens[self._mark :]
        return self._mark

    def _forget_checkpoint(self) -> None:
        if self._mark >= 0:
            lc.llama_memory_seq_rm(self.mem, self._spare, -1, -1)
            self._mark = -1

    def forget_unknown_tail(self, seq_id: int = SEQ) -> None:
        """After an interruption: drop any cache positions beyond what the sequence's mirror records (a recurrent
        state cannot drop them alone: it goes back to its checkpoint, or the sequence is emptied)."""
        if self._pos_max(seq_id) < len(self.seqs[seq_id]):
            return
        if self.recurrent:
            self._call = (0, 0)
            if seq_id == SEQ:
                self._go_back(len(self.tokens))
            else:
                self.drop(seq_id)
        else:
            lc.llama_memory_seq_rm(self.mem, seq_id, len(self.seqs[seq_id]), -1)

    def leave(self, seq) -> None:
        """After a call, whatever ended it (Ctrl-C, errors): sequence 0 a prefix of seq (`forget_unknown_tail`,
        `keep_common_prefix`), its recurrent state kept there for a next turn (`keep_state`)."""
        self.forget_unknown_tail()
        self.keep_common_prefix(seq)
        self.keep_state()

    def clear(self) -> None:
        """Empty every sequence."""
        lc.llama_memory_clear(self.mem, True)
        for toks in self.seqs:
            toks.clear()
        self._mark, self._call, self._saved = -1, (0, 0), []

    def drop(self, seq_id: int) -> None:
        """Empty one sequence (llama.cpp never refuses to remove a whole sequence); the others stay."""
        lc.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        self.seqs[seq_id].clear()
        if seq_id == SEQ:
            self._forget_past(0)
            self._call = (0, 0)

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
