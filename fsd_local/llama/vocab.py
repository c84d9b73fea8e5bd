"""Can the draft speak to the target? The same checks llama.cpp's speculative example makes, with the reason."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from fsd_local.errors import VocabularyMismatchError

MAX_SIZE_DIFFERENCE = 128  # Qwen2.5 0.5B vs 7B differ by exactly 128 padding entries
FIRST_CHECKED_TOKEN = 5  # ids below are control tokens that families renumber freely

VOCAB_TYPES = {0: "none", 1: "SPM (sentencepiece)", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo-2"}
# tokenizer.ggml.model -> the name llama.cpp's vocabulary types go by (VOCAB_TYPES)
TOKENIZERS = {
    "llama": "SPM (sentencepiece)",
    "gpt2": "BPE",
    "bert": "WPM",
    "t5": "UGM",
    "rwkv": "RWKV",
    "plamo2": "PLaMo-2",
    "gemma4": "BPE (gemma4)",
    "no_vocab": "none",
}


@dataclass(frozen=True)
class _Facts:
    """What both checks compare: the tokenizer type (in words) and the special tokens."""

    kind: object
    add_bos: bool
    bos: int | None
    eos: int | None
    n_vocab: int


def _problem(d: _Facts, t: _Facts, tokens_differ: Callable[[int], str | None]) -> str | None:
    """The checks in order; tokens_differ(k) compares the first k token texts (from FIRST_CHECKED_TOKEN on)."""
    if d.kind != t.kind:
        return f"tokenizer types differ: draft uses {d.kind}, target uses {t.kind}"
    if d.add_bos != t.add_bos:
        return f"BOS handling differs: draft add_bos={d.add_bos}, target add_bos={t.add_bos}"
    if d.add_bos and d.bos != t.bos:
        return f"BOS token ids differ: draft {d.bos}, target {t.bos}"
    if d.eos != t.eos:
        return f"EOS token ids differ: draft {d.eos}, target {t.eos}"
    diff = abs(d.n_vocab - t.n_vocab)
    if diff > MAX_SIZE_DIFFERENCE:
        return (
            f"vocabulary sizes differ by {diff} (draft {d.n_vocab}, target {t.n_vocab}); "
            f"at most {MAX_SIZE_DIFFERENCE} is allowed"
        )
    return tokens_differ(min(d.n_vocab, t.n_vocab))


def compatibility_problem(draft, target) -> str | None:
    """None when compatible, else one sentence naming the failed check."""
    import llama_cpp as lc

    def facts(m) -> _Facts:
        kind = lc.llama_vocab_type(m.vocab)
        return _Facts(VOCAB_TYPES.get(kind, kind), m.add_bos, m.bos, m.eos, m.n_vocab)

    def tokens_differ(k: int) -> str | None:
        for i in range(FIRST_CHECKED_TOKEN, k):
            a, b = draft.token_text(i), target.token_text(i)
            if a != b:
                return f"token {i} differs: draft {a!r}, target {b!r}"
        return None

    return _problem(facts(draft), facts(target), tokens_differ)


def check_compatible(draft, target) -> None:
    problem = compatibility_problem(draft, target)
    if problem:
        raise VocabularyMismatchError(
            f"draft {draft.path} cannot draft for target {target.path}: {problem}. "
            "Pick a draft from the same model family (same tokenizer), e.g. a pair from `fsd-local models`."
        )


# ------------------------------------------------------------------ the same checks on GGUF headers
@dataclass(frozen=True)
class HeaderVocab:
    """What compatibility_problem compares, read from a GGUF header (gguf_info.read(path, vocab=True)) without
    loading the model. The token list is kept as digests of its prefixes tokens[FIRST_CHECKED_TOKEN:k] for the
    last MAX_SIZE_DIFFERENCE + 1 lengths k (from `first` to n_vocab): enough to compare two lists whose lengths
    differ by the padding the loaded check allows, in a few kilobytes that can be cached."""

    tokenizer: str | None  # tokenizer.ggml.model: llama (SPM), gpt2 (BPE), ...
    n_vocab: int
    bos: int | None
    eos: int | None
    add_bos: bool | None  # None: the key is absent and llama.cpp's default for the tokenizer applies
    first: int
    digests: tuple[str, ...]

    def digest(self, k: int) -> str | None:
        i = k - self.first
        return self.digests[i] if 0 <= i < len(self.digests) else None

    @property
    def adds_bos(self) -> bool:
        return self.add_bos if self.add_bos is not None else self.tokenizer in ("llama", "bert")

    def to_dict(self) -> dict:
        return {**asdict(self), "digests": list(self.digests)}

    @classmethod
    def from_dict(cls, d: dict) -> HeaderVocab:
        known: dict[str, Any] = {f.name: d.get(f.name) for f in fields(cls)}
        return cls(**{**known, "digests": tuple(d["digests"])})


def header_problem(draft: HeaderVocab, target: HeaderVocab) -> str | None:
    """compatibility_problem's checks on two headers: None when compatible, else the failed check in words.
    Loading the pair runs the full check again (check_compatible)."""

    def facts(v: HeaderVocab) -> _Facts:
        return _Facts(TOKENIZERS.get(v.tokenizer or "", v.tokenizer), v.adds_bos, v.bos, v.eos, v.n_vocab)

    def tokens_differ(k: int) -> str | None:
        same = draft.digest(k) == target.digest(k)
        return None if same else f"the token lists differ within their first {k} tokens"

    return _problem(facts(draft), facts(target), tokens_differ)
