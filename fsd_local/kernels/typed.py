"""Kernels called through entry points typed once per owner (a round's context, a chain), without numba's
dispatcher, which types every argument of every call (docs/design.md, "Typed entry points")."""

from __future__ import annotations

import numpy as np

F32 = np.dtype(np.float32)


def entry(kernel, *args):
    """`kernel` compiled (or loaded from numba's cache) for the exact types of `args`: called directly it unboxes
    without checking, so call it only with arguments of those types."""
    return kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))


def decoded(rows: np.ndarray) -> bool:
    """Whether `rows` has the type of logit rows a model's decode gives (float32, C-contiguous, writable; any
    number of dimensions): the rows typed entry points are typed for."""
    f = rows.flags
    return rows.dtype == F32 and f.c_contiguous and f.writeable


class Typed:
    """`call(kernel, rows, *args)`: kernel(rows, *args), through an entry point typed at its first call here when
    `rows` are decoded rows (else through numba's dispatcher). Its owner passes every other argument with the
    same types on every call (its own buffers, settings, Python ints and floats, float64 scalars)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict = {}

    def __len__(self) -> int:
        """How many entry points were typed here."""
        return len(self._entries)

    def call(self, kernel, rows, *args):
        f = self._entries.get((kernel, rows.ndim))
        if f is None:
            if not decoded(rows):
                return kernel(rows, *args)
            f = self._entries[(kernel, rows.ndim)] = entry(kernel, rows, *args)
        elif not decoded(rows):
            return kernel(rows, *args)
        return f(rows, *args)
