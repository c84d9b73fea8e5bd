"""A draft of another vocabulary proposing the target's tokens (docs/design.md, "Drafting across tokenizers"): its
cache follows the accepted text (follow.py), each of its rows is carried onto the target's vocabulary through
the map (kernels/carry.py), and a proposed target token is decoded as the draft token of the same bytes."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from fsd_local.drafting.follow import Following
from fsd_local.kernels.carry import carried_argmax, carry_row, prepare
from fsd_local.llama.model import Model
from fsd_local.llama.vocab_map import VocabMap


class Across(Following):
    """One draft/target pair of different tokenizers: `sync` brings the draft's cache to the accepted text,
    `carry` gives a draft row as logits on the target's ids (q'), `draft_token` the draft's id of a target token
    (-1: the target's alone)."""

    def __init__(self, draft: Model, target: Model, vm: VocabMap) -> None:
        super().__init__(draft, target)
        self.shared_t, self.shared_d = vm.shared
        self.extra = np.ascontiguousarray(vm.extra, np.int32)
        self.draft_of = vm.draft_of
        self.primary = vm.primary
        self.row = np.empty(target.n_vocab, np.float32)
        # -inf on the target's own tokens, written once; carry_row writes the shared ones
        prepare(self.row)
        self.seconds = 0.0  # time spent carrying rows (`carry`, `argmax`): the map's own cost
        self._prepared: np.ndarray | None = None  # the round's draft rows whose target-only entries are -inf

    def carry(self, row: np.ndarray) -> np.ndarray:
        """The draft's row carried onto the target's vocabulary (valid until the next carry)."""
        t = perf_counter()
        carry_row(row, self.shared_t, self.shared_d, self.extra, self.row)
        self.seconds += perf_counter() - t
        return self.row

    def carry_into(self, row: np.ndarray, rows: np.ndarray, i: int) -> np.ndarray:
        """The draft's row carried onto the target's vocabulary straight into rows[i], the round's buffer the
        acceptance kernel reads (no carried copy copied again); `rows` prepared once, then only shared ids written."""
        t = perf_counter()
        if rows is not self._prepared:  # only carried rows are ever written into an across engine's draft rows
            for r in rows:
                prepare(r)
            self._prepared = rows
        carry_row(row, self.shared_t, self.shared_d, self.extra, rows[i])
        self.seconds += perf_counter() - t
        return rows[i]

    def argmax(self, row: np.ndarray) -> int:
        """The target token `carry` would rank first, without writing the carried row (-1: nothing shared)."""
        t = perf_counter()
        tok = int(carried_argmax(row, self.primary, self.draft_of, self.extra))
        self.seconds += perf_counter() - t
        return tok

    def draft_token(self, token: int) -> int:
        return int(self.draft_of[token])
