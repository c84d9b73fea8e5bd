"""Prompt lookup (the `ngram` drafter): the tokens that followed the most recent earlier occurrence of the
longest n-gram ending the text, over an index that is extended and rewound, never rebuilt (docs/design.md,
"Prompt lookup")."""

from __future__ import annotations

from collections.abc import Sequence

NGRAM_MIN_DEFAULT = 1
NGRAM_MAX_DEFAULT = 3
MATCH_LENGTH_CAP = 32
MATCH_CLASS_BOUNDS = (1, 2, 4, 8, 16)  # class c: match length in (bounds[c-1], bounds[c]]; beyond the last: 5


def match_class(length: int) -> int:
    """The bucket of a match length: 0 for 1 token, 1 for 2, 2 for 3-4, 3 for 5-8, 4 for 9-16, 5 beyond."""
    for c, bound in enumerate(MATCH_CLASS_BOUNDS):
        if length <= bound:
            return c
    return len(MATCH_CLASS_BOUNDS)


class NgramDrafter:
    """Prompt lookup over an incrementally indexed token history: `propose(seq, k)` each round ([] when nothing
    matches), the whole history given each time and only what is new indexed."""

    def __init__(self, ngram_min: int = NGRAM_MIN_DEFAULT, ngram_max: int = NGRAM_MAX_DEFAULT, periodic: bool = True):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        # A match whose continuation runs into the end of the text (a repeating pattern such as "a b a b")
        # is continued with the tokens it has just proposed, as if they were already in the text.
        self.periodic = periodic
        self._sizes = range(ngram_min, ngram_max + 1)
        self.reset()

    # ------------------------------------------------------------------ index maintenance
    def reset(self) -> None:
        """Forget everything (the next `sync` indexes its history from scratch)."""
        self._tokens: list[int] = []
        # per n: n-gram -> latest start s with a follower (s + n < len(tokens))
        self._last: dict[int, dict[tuple, int]] = {n: {} for n in self._sizes}
        # per n: prev[s] = the start of the previous occurrence of the n-gram starting at s, or -1
        self._prev: dict[int, list[int]] = {n: [] for n in self._sizes}
        self.last_match: tuple[int, int] | None = None  # (n, start) of the latest proposal's match
        self.match_length = 0  # how many tokens before the latest proposal agree with the text before its match

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the indexed history. Each appended token gives every n-gram ending just before it
        a follower, which is what makes that n-gram findable."""
        hist = self._tokens
        for t in tokens:
            end = len(hist)  # position of the follower t
            hist.append(int(t))
            for n in self._sizes:
                s = end - n
                if s < 0:
                    break
                key = tuple(hist[s:end])
                last = self._last[n]
                self._prev[n].append(last.get(key, -1))
                last[key] = s

    def truncate(self, length: int) -> None:
        """Cut the indexed history to its first `length` tokens, restoring each n-gram's latest start to the
        occurrence before the removed ones (the index then equals a fresh build of the shorter history)."""
        hist = self._tokens
        length = max(0, length)
        if length >= len(hist):
            return
        for n in self._sizes:
            prev, last = self._prev[n], self._last[n]
            # starts s with s + n < length keep their follower; pop the rest, latest first
            for s in range(len(prev) - 1, max(0, length - n) - 1, -1):
                key = tuple(hist[s : s + n])
                p = prev.pop()
                if p >= 0:
                    last[key] = p
                else:
                    del last[key]
        del hist[length:]

    def sync(self, history: Sequence[int]) -> None:
        """Make the index describe exactly `history`: append what is new, rewinding first if `history` is not
        an extension of what was indexed. The prefix check is one C-level list comparison."""
        hist = self._tokens
        n_old = len(hist)
        if len(history) >= n_old and (n_old == 0 or history[n_old - 1] == hist[-1]):
            head = history[:n_old]
            if not isinstance(head, list):
                head = [int(t) for t in head]
            if head == hist:
                if len(history) > n_old:
                    self.extend(history[n_old:])
                return
        common = 0
        limit = min(n_old, len(history))
        while common < limit and hist[common] == history[common]:
            common += 1
        self.truncate(common)
        self.extend(history[common:])

    # ------------------------------------------------------------------ drafting
    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest n-gram ending
        `history`; [] when none occurred before or k <= 0. With `periodic` a match running into the end of the
        history goes on with the proposal itself, so it always has k tokens."""
        self.sync(history)
        return self.draft(k)

    def draft(self, k: int) -> list[int]:
        """`propose` on the history as indexed now, without the prefix check of `sync`: for a caller that
        keeps the index current itself with `extend` / `truncate` (saves an O(len) list comparison a round)."""
        self.last_match = None
        self.match_length = 0
        hist = self._tokens
        size = len(hist)
        if k <= 0 or size < 2:
            return []
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            s = self._last[n].get(tuple(hist[size - n :]))
            if s is None:
                continue
            self.last_match = (n, s)
            length = n  # extend the agreement backwards: hist[s + n - length - 1] vs hist[size - length - 1]
            top = min(MATCH_LENGTH_CAP, s + n)
            while length < top and hist[s + n - length - 1] == hist[size - length - 1]:
                length += 1
            self.match_length = length
            c = s + n  # first follower; c <= size - 1 because every indexed n-gram has a follower
            if not self.periodic:
                return hist[c : c + k]
            out = hist[c : c + k]
            while len(out) < k:  # position c + j lies past the end: it is proposal token c + j - size
                out.append(out[c + len(out) - size])
            return out
        return []

    # ------------------------------------------------------------------ tests and debugging
    def snapshot(self) -> tuple:
        """The whole index as plain data (tests compare a rewound index with a fresh one)."""
        return (
            list(self._tokens),
            {n: dict(d) for n, d in self._last.items()},
            {n: list(p) for n, p in self._prev.items()},
        )
