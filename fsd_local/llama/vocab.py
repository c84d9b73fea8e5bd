"""Can the draft speak to the target, and how: the same vocabulary (llama.cpp's speculative example's checks, with
the reason), or different tokenizers through the vocabulary map (llama/vocab_map.py), or not at all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from fsd_local.errors import VocabularyMismatchError

if TYPE_CHECKING:
    from fsd_local.llama.vocab_map import VocabMap
    from fsd_local.llama.vocab_table import VocabTable

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


# Below this share of a probe text's draft tokens carried, most of what the draft proposes is not the target's:
# across tokenizers such a pair drafts text instead (the text path), or is refused (vocab_map.VocabMap.probe_share)
MIN_PROBE_SHARE = 0.5
PATHS = ("same", "map", "text", "refused")
CHOICES = ("auto", "map", "text")  # what a caller may ask of a pair of two tokenizers (auto: by the share)


@dataclass(frozen=True)
class Pairing:
    """The path a pair takes: "same" (one vocabulary: the draft's ids are the target's), "map" (different
    tokenizers: the draft's rows carried onto the target's vocabulary, its cache following the text), "text" (the
    draft writes text in its own tokens, the target's tokens of it proposed), or "refused"; `reason` says why."""

    path: str
    reason: str | None = None
    vocab_map: VocabMap | None = None

    def describe(self) -> str:
        """The path and what the map shares, in words (the reason is not repeated)."""
        if self.path == "same":
            return "the same tokenizer: the draft proposes the target's own tokens"
        shares = self.vocab_map.describe() if self.vocab_map is not None else "no map"
        if self.path == "text":
            return f"the text path: the draft writes text, the target's tokens of it are proposed ({shares})"
        return f"the vocabulary map ({shares})" + ("" if self.path == "map" else ": too little to draft with")

    def to_dict(self) -> dict:
        vm = self.vocab_map.to_dict() if self.vocab_map is not None else None
        return {"path": self.path, "reason": self.reason, "map": vm}


def align_refusal(draft: VocabTable) -> str | None:
    """Why the draft cannot follow another tokenizer's text at all (None: it can)."""
    if not draft.every_byte:
        return (
            "the draft's SentencePiece vocabulary has no byte-fallback tokens, so llama.cpp cannot tokenise text "
            "outside its vocabulary with it"
        )
    if not draft.reads_back:
        return (
            "the draft's tokenizer does not give back the text it reads (it normalises text), so its text cannot "
            "be aligned with the target's"
        )
    return None


def share_text(vm: VocabMap) -> str:
    return f"{vm.probe_share:.0%} of the draft's tokens of a probe text exist in the target's vocabulary"


def map_refusal(vm: VocabMap, draft: VocabTable) -> str | None:
    """Why a pair of different tokenizers cannot draft through the map (None: it can)."""
    refusal = align_refusal(draft)
    if refusal is None and vm.probe_share < MIN_PROBE_SHARE:
        return f"only {share_text(vm)} (at least {MIN_PROBE_SHARE:.0%} needed)"
    return refusal


def text_refusal(draft: VocabTable, target: VocabTable) -> str | None:
    """Why the pair cannot take the text path (None: it can): the draft must follow any text, and the target
    tokenise any text the draft writes."""
    refusal = align_refusal(draft)
    if refusal is None and not target.every_byte:
        return (
            "the target's SentencePiece vocabulary has no byte-fallback tokens, so llama.cpp cannot tokenise the "
            "draft's text with it"
        )
    return refusal


def choose_path(vm: VocabMap, draft: VocabTable, target: VocabTable, want: str = "auto") -> tuple[str, str | None]:
    """(path, why not) for two tokenizers: the map where it carries enough (or `want` is "map"), else the text
    path, else refused with the share and both reasons."""
    if want not in CHOICES:
        raise ValueError(f"across must be one of {', '.join(CHOICES)}, got {want!r}")
    by_map = align_refusal(draft) if want == "map" else map_refusal(vm, draft)
    if want != "text" and by_map is None:
        return "map", None
    by_text = text_refusal(draft, target) if want != "map" else by_map
    if by_text is None:
        return "text", None
    return "refused", by_map if by_map == by_text else f"{share_text(vm)}; {by_text}"


def pairing(draft, target, want: str = "auto") -> Pairing:
    """Which path two loaded models (vocabulary-only is enough) take (`want`: CHOICES); the map is built or read
    from the cache."""
    from fsd_local.llama.vocab_map import map_between
    from fsd_local.llama.vocab_table import table_of

    problem = compatibility_problem(draft, target)
    if problem is None:
        return Pairing("same")
    vm = map_between(draft.path, target.path, draft, target)
    path, why = choose_path(vm, table_of(draft.path, draft), table_of(target.path, target), want)
    return Pairing(path, f"{problem}; {why}" if why else problem, vm)


def check_compatible(draft, target, want: str = "auto") -> Pairing:
    """The pair's path ("same", or "map" / "text" with its map), or VocabularyMismatchError naming what stops it
    and what to do."""
    p = pairing(draft, target, want)
    if p.path != "refused":
        return p
    raise VocabularyMismatchError(
        f"draft {draft.path} cannot draft for target {target.path}: {p.reason}. Pick a draft from the "
        "target's family (same tokenizer) or one that writes the target's language, e.g. from "
        "`fsd-local models --local`."
    )


# ------------------------------------------------------------------ the same checks on GGUF headers
@dataclass(frozen=True)
class HeaderVocab:
    """What compatibility_problem compares, read from a GGUF header without loading the model: the token list as
    digests of its prefixes for the last MAX_SIZE_DIFFERENCE + 1 lengths, a few kilobytes that can be cached."""

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
