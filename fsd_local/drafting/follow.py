"""A draft model of another vocabulary follows the accepted text, not its ids: the text (the target's tokens
rendered to bytes) is tokenised by the draft, and after each change only a short tail around it is tokenised
again; the draft's cache keeps its longest common prefix with the result and decodes the rest."""

from __future__ import annotations

import ctypes
from bisect import bisect_right
from time import perf_counter

from fsd_local.errors import ContextOverflowError
from fsd_local.llama.bindings import lc
from fsd_local.llama.model import Model

BACK = 2  # draft tokens before the change tokenised again (text the draft would split differently)
BACK_MAX = 8  # how far back a tail may start when looking for a word start
WORD_START = frozenset(b" \t\n\r")


def _utf8_start(b: int) -> bool:
    return b < 0x80 or b >= 0xC0


def _complete_utf8(text: bytes | bytearray) -> int:
    """The length of the longest prefix of text that does not end inside a UTF-8 character."""
    n = len(text)
    i = n - 1
    while i >= 0 and n - i <= 4 and not _utf8_start(text[i]):
        i -= 1
    if i < 0 or text[i] < 0xC0:
        return n
    need = 2 if text[i] < 0xE0 else 3 if text[i] < 0xF0 else 4
    return n if n - i >= need else i


class Renderer:
    """A model's tokens as the bytes they stand for in the text: special tokens as their text, cached."""

    def __init__(self, model: Model):
        self.vocab = model.vocab
        self._cache: dict[int, bytes] = {}
        self._buf = ctypes.create_string_buffer(512)

    def __call__(self, token: int) -> bytes:
        b = self._cache.get(token)
        if b is None:
            n = lc.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, True)
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self.vocab, token, big, -n, 0, True)
                b = big.raw[:n]
            else:
                b = self._buf.raw[:n]
            self._cache[token] = b
        return b


class TextFollower:
    """Keeps `ids`, the draft's tokens of the text the target's tokens render to, and brings the draft's cache
    to them (`sync`); the BOS the target adds renders as nothing, and a space-prefixing tokenizer reads ' ' + text."""

    def __init__(self, draft: Model, target: Model, back: int = BACK):
        self.draft, self.target = draft, target
        self.back = back  # draft tokens before a change tokenised again
        self.target_text = Renderer(target)
        self.draft_text = Renderer(draft)
        self._tok_buf = (lc.llama_token * 256)()
        self.head: list[int] = [draft.bos] if draft.add_bos and draft.bos >= 0 else []
        self.lead = b""
        self._special = True
        self.lead = b" " if self._render(self._tokenize(b"a")) == b" a" else b""
        # such a tokenizer also writes a space after every special token it parses (llama.cpp follows the
        # original SentencePiece there), so it reads special tokens' text as plain text
        self._special = not self.lead
        self.seconds = 0.0  # time spent here outside llama.cpp's decode (tokenising, comparing)
        self.retokenised = 0  # draft tokens produced by tokenising tails
        self.far_back = 0  # tails that had to start more than BACK + BACK_MAX tokens before the change
        self.misaligned = 0  # tails the draft's tokens did not render exactly (bytes it has no token for)
        self.redecoded = 0  # cached draft tokens of the text a tail replaced: decoded again (one vocabulary never is)
        self.sync_tokens = 0  # draft tokens decoded here (the new text's, and the re-decoded)
        self.sync_seconds = 0.0  # llama.cpp's decode time here
        self.reset()

    def reset(self) -> None:
        self.followed: list[int] = []  # the target tokens whose text `text` holds
        self.ends: list[int] = []  # byte offset in `text` after each of them
        self.text = bytearray(self.lead)  # the text as the draft reads it
        self.ids: list[int] = list(self.head)  # the draft's tokens of text[:settled]
        self.id_ends: list[int] = [0] * len(self.head)  # byte offset in `text` after each draft token
        self.exact: list[bool] = [True] * len(self.head)  # whether that offset is exact (_tail_tokens)

    # ------------------------------------------------------------------ text
    def _render_target(self, token: int, at: int) -> bytes:
        # only the BOS the target's tokenizer adds at the start is the draft's own (`head`); elsewhere the token is
        # text (SmolLM2's BOS is <|im_start|>, which its chat template writes before every message)
        first = at == 0 and token == self.target.bos and self.target.add_bos
        return b"" if first else self.target_text(token)

    def _render(self, ids) -> bytes:
        return b"".join(self.draft_text(t) for t in ids)

    def _tokenize(self, data: bytes) -> list[int]:
        cap = len(self._tok_buf)
        if len(data) + 8 > cap:
            cap = len(data) + 8
            self._tok_buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.draft.vocab, data, len(data), self._tok_buf, cap, False, self._special)
        return list(self._tok_buf[:n]) if n > 0 else []

    def _tail_tokens(self, start: int, end: int) -> tuple[list[int], list[int], list[bool]]:
        """The draft's tokens of text[start:end] with the byte offset after each and whether it is exact. A
        byte-level BPE vocabulary without a token for some byte leaves it out: the tokens before and after such
        a gap still end where their bytes do; only those inside it have an offset estimated (not exact)."""
        if end - start <= len(self.lead):
            return [], [], []
        ids = self._tokenize(
            bytes(self.text[start + len(self.lead) : end]) if self.lead else bytes(self.text[start:end])
        )
        pieces = [self.draft_text(t) for t in ids]
        ends, exact = [0] * len(ids), [True] * len(ids)
        at, i = start, 0
        while i < len(ids) and self.text.startswith(pieces[i], at):  # bytearray.startswith(prefix, at)
            at += len(pieces[i])
            ends[i] = at
            i += 1
        back, k = end, len(ids) - 1
        while k >= i and back - len(pieces[k]) >= at and self.text.startswith(pieces[k], back - len(pieces[k])):
            ends[k] = back
            back -= len(pieces[k])
            k -= 1
        self.misaligned += at != back or k >= i
        if k >= i:  # the gap: what the tokens left out is somewhere in text[at:back]
            for j in range(i, k + 1):
                at = min(at + len(pieces[j]), back)
                ends[j], exact[j] = at, j == k
            ends[k] = back
        return ids, ends, exact

    # ------------------------------------------------------------------ following
    def _follow(self, seq, start: int) -> int:
        """Make `followed` seq (known equal below `start`); returns the byte offset where the text changed."""
        a = min(start, len(self.followed), len(seq))
        n = min(len(self.followed), len(seq))
        while a < n and self.followed[a] == seq[a]:
            a += 1
        at = self.ends[a - 1] if a else len(self.lead)
        del self.followed[a:], self.ends[a:], self.text[at:]
        for i in range(a, len(seq)):
            t = seq[i]
            self.text += self._render_target(t, i)
            self.followed.append(t)
            self.ends.append(len(self.text))
        return at

    def _start_of(self, j: int) -> int:
        return self.id_ends[j - 1] if j > 0 else 0

    def _exact(self, j: int) -> bool:
        """Whether ids[:j] end exactly at _start_of(j) (not inside a tail the draft could not render exactly)."""
        return j == 0 or self.exact[j - 1]

    def _good_start(self, j: int) -> bool:
        """Whether a tail may start at ids[j]: at a UTF-8 character, at a space for a space-prefix tokenizer,
        else preferably after whitespace (where a BPE pre-tokenizer splits the text anyway)."""
        s = self._start_of(j)
        if j == len(self.head):
            return True
        if not self._exact(j) or not _utf8_start(self.text[s] if s < len(self.text) else 0):
            return False
        if s >= len(self.text):
            return True
        b = self.text[s]
        return b == 32 if self.lead else b in WORD_START

    def _boundary(self, changed: int) -> int:
        """How many of `ids` to keep: those ending at or before `changed`, less `back`, then back to a word start
        (at most BACK_MAX back; a space-prefix tokenizer keeps looking, as far as the text's start). back 0: the
        draft's tokens before the change stay as they are."""
        h = len(self.head)
        j = max(h, bisect_right(self.id_ends, changed, lo=h) - self.back)
        for k in range(j, max(h, j - BACK_MAX) - 1 if self.back or self.lead else j, -1):
            if self._good_start(k):
                return k
        if self.lead:
            self.far_back += 1
            return next((k for k in range(j - BACK_MAX - 1, h, -1) if self._good_start(k)), h)
        k = j  # no word start near: any character start that ends an exact reading
        while k > h and not (self._exact(k) and _utf8_start(self.text[self._start_of(k)])):
            k -= 1
        self.far_back += j - k > BACK_MAX
        return k

    def sync(self, seq, start: int = 0) -> bool:
        """Bring the draft's cache to the text of the target tokens seq (known followed below `start`), its last
        row the next token's. False when the text ends inside a UTF-8 character (the draft cannot read it yet).
        Only this and the draft's proposals write the draft's cache."""
        t0 = perf_counter()
        decode0 = self.draft.decode_seconds
        settled = len(self.ids)
        changed = self._follow(seq, start)
        end = _complete_utf8(self.text)
        j = self._boundary(min(changed, end))
        tail, ends, exact = self._tail_tokens(self._start_of(j), end)
        del self.ids[j:], self.id_ends[j:], self.exact[j:]
        self.ids += tail
        self.id_ends += ends
        self.exact += exact
        self.retokenised += len(tail)
        ok = end == len(self.text) and len(self.ids) > 0
        if ok:
            d = self.draft
            # the cache is known to hold ids[:j] when its token there is ours; else it is compared whole
            known = min(j, len(d.tokens))
            known = known if known == 0 or d.tokens[known - 1] == self.ids[known - 1] else 0
            before = len(d.tokens)
            d.keep_common_prefix(self.ids, known)
            self.redecoded += max(0, min(settled, before) - len(d.tokens))
            self.sync_tokens += len(self.ids) - len(d.tokens)
            d.decode(self.ids[len(d.tokens) :], "last")
        self.sync_seconds += self.draft.decode_seconds - decode0
        self.seconds += perf_counter() - t0 - (self.draft.decode_seconds - decode0)
        return ok


class Following:
    """A draft of another vocabulary whose cache follows the accepted text: `sync` brings it to a text, `room` says
    what its context still holds (the base of the map's and the text path's drafts: across.py, text_draft.py)."""

    def __init__(self, draft: Model, target: Model) -> None:
        self.draft = draft
        self.follower = TextFollower(draft, target)
        self.synced = 0  # target tokens of the current text known followed (a generation's start resets it)
        self.full = False  # the draft's context is full: this generation drafts no further

    def start(self) -> None:
        """A new generation: its text is compared with what the follower holds from the start."""
        self.synced, self.full = 0, False

    @property
    def followed(self) -> int:
        """Target tokens of the text the draft's cache follows."""
        return len(self.follower.followed)

    def sync(self, seq) -> bool:
        """Make the draft's cache hold its tokens of seq's text, its last row the next token's. False: nothing
        can be drafted now (the text ends inside a character, or the draft's context is full)."""
        if self.full:
            return False
        try:
            ok = self.follower.sync(seq, self.synced)
        except ContextOverflowError:  # the draft's context cannot hold the text: the target goes on alone
            self.full = True
            return False
        self.synced = len(seq)
        return ok

    def room(self) -> int:
        """Drafts the draft's context still holds."""
        return self.draft.n_ctx - len(self.draft.tokens)
