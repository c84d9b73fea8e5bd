"""The text path across tokenizers (docs/design.md, "The text path"): the draft follows the accepted text
(follow.py), writes its own greedy tokens, and the target's tokens of that text are proposed one-hot, judged as
prompt lookup's are (exact under the lossless rule at any temperature)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fsd_local.drafting.follow import Following, _complete_utf8
from fsd_local.llama.bindings import lc
from fsd_local.llama.model import Model

TAIL = 2  # accepted target tokens tokenised again with the draft's text, so a word they begin can merge on
TAIL_MAX = 16  # how far back a tokenizer that writes a space first looks for a token starting at one


class TextDraft(Following):
    """A draft of another tokenizer that proposes text: `draft_text` writes its greedy tokens' bytes (and whether
    it ended its reply), `target_tokens` the target's tokens of them after the accepted text; `end` is the target
    token that ends a reply (vocab_table.end_of_turn)."""

    def __init__(self, draft: Model, target: Model, end: int) -> None:
        super().__init__(draft, target)
        self.target, self.end = target, end
        self._buf = (lc.llama_token * 256)()
        self.lead = self._target_text(self._tokenize(b"a")) == b" a"  # a tokenizer writing a space first

    # ------------------------------------------------------------------ the draft's text
    def draft_text(self, k: int) -> tuple[bytes, bool]:
        """Up to k of the draft's greedy tokens from its last row, all but the last decoded: their bytes, and
        whether the draft ended its reply there. A control token other than an end stops the text before it."""
        d, render = self.draft, self.follower.draft_text
        pieces: list[bytes] = []
        if k > 1:  # as Proposer._draft_model: a recurrent state goes back here after a rejection
            d.checkpoint()
        for i in range(k):
            tok = d.sampler.take() if d.sampler.active else int(np.argmax(d.logits(1)[0]))
            if d.is_eog(tok):
                return b"".join(pieces), True
            if lc.llama_vocab_is_control(d.vocab, tok):
                break
            pieces.append(render(tok))
            if i + 1 < k:
                d.decode_one(tok)
        return b"".join(pieces), False

    # ------------------------------------------------------------------ the target's tokens of it
    def _tokenize(self, data: bytes) -> list[int]:
        cap = len(self._buf)
        if len(data) + 8 > cap:
            self._buf = (lc.llama_token * (len(data) + 8))()
            cap = len(self._buf)
        n = lc.llama_tokenize(self.target.vocab, data, len(data), self._buf, cap, False, False)
        return list(self._buf[:n]) if n > 0 else []

    def _target_text(self, ids: Sequence[int]) -> bytes:
        render = self.follower.target_text
        return b"".join(b"" if t == self.target.bos else render(t) for t in ids)

    def spells(self, ids: Sequence[int], text: bytes) -> bool:
        """Whether the target tokens ids render exactly `text`."""
        return self._target_text(ids) == text

    def _backs(self, seq: Sequence[int]) -> list[int]:
        """How many accepted tokens to tokenise again with the text, in the order tried (0: the text alone). A
        tokenizer that writes a space first needs a tail that starts at a space."""
        if not self.lead:
            return [min(TAIL, len(seq)), 0]
        render = self.follower.target_text
        at = next((b for b in range(1, min(len(seq), TAIL_MAX) + 1) if render(seq[-b]).startswith(b" ")), 0)
        return [at, 0] if at else [0]

    def target_tokens(self, seq: Sequence[int], text: bytes) -> list[int]:
        """The target's tokens of `text` after the accepted tokens seq: its last TAIL tokens tokenised again with
        it (a word they begin goes on as the target would split it) where they come out the same, else the text
        alone; only the tokens that spell a prefix of `text` (none: the target cannot write it from here)."""
        text = text[: _complete_utf8(text)]
        if not text:
            return []
        for back in self._backs(seq):
            tail = list(seq[-back:]) if back else []
            data = self._target_text(tail) + text
            if self.lead:  # the tokenizer writes the space itself: a tail must start at one
                if not data.startswith(b" "):
                    continue
                data = data[1:]
            ids = self._tokenize(data)
            if ids[: len(tail)] != tail:
                continue
            out, at = [], 0
            for t in ids[len(tail) :]:
                piece = self.follower.target_text(t)
                if not piece or not text.startswith(piece, at):
                    break
                out.append(t)
                at += len(piece)
            if out:
                return out
        return []
