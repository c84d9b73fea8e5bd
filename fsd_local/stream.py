"""Token bytes -> text that is safe to show now: never half a UTF-8 character, never part of a stop string."""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stop: tuple[str, ...] = ()):
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.stop = tuple(stop)
        self._held = ""  # decoded text not yet released: it could be the start of a stop string
        self.stopped = False
        self.text = ""  # everything released so far

    def push(self, data: bytes, final: bool = False) -> str:
        """Feed token bytes; returns the text that can be released. After a stop string: nothing more.
        final=True (see flush) releases everything: an incomplete character becomes U+FFFD."""
        if self.stopped:
            return ""
        pending = self._held + self._utf8.decode(data, final=final)
        self._held = ""
        hit = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            return self._release(pending[:hit])
        if final:
            return self._release(pending)
        keep = 0  # longest tail of pending that is a proper prefix of some stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, len(pending)), keep, -1):
                if pending.endswith(s[:n]):
                    keep = n
                    break
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._release(pending[: len(pending) - keep])

    def stop_index(self, pieces: list[bytes]) -> int | None:
        """The index of the first of these token pieces whose text would complete a stop string if they were
        pushed next (None: none would); nothing is consumed."""
        if not self.stop:
            return None
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.setstate(self._utf8.getstate())
        pending = self._held  # released text cannot hold the start of a stop string: only what is held can
        for i, data in enumerate(pieces):
            pending += dec.decode(data)
            if any(s in pending for s in self.stop):
                return i
        return None

    def flush(self) -> str:
        """At the end of generation: release whatever is held, still honouring the stop strings."""
        return self.push(b"", final=True)

    def _release(self, s: str) -> str:
        self.text += s
        return s
