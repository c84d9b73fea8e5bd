"""Can the draft speak to the target? The same checks llama.cpp's speculative example makes, with the reason."""

from __future__ import annotations

from fsd_local.errors import VocabularyMismatchError

MAX_SIZE_DIFFERENCE = 128  # Qwen2.5 0.5B vs 7B differ by exactly 128 padding entries
FIRST_CHECKED_TOKEN = 5  # ids below are control tokens that families renumber freely

VOCAB_TYPES = {0: "none", 1: "SPM (sentencepiece)", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo-2"}


def compatibility_problem(draft, target) -> str | None:
    """None when compatible, else one sentence naming the failed check."""
    import llama_cpp as lc

    td, tt = lc.llama_vocab_type(draft.vocab), lc.llama_vocab_type(target.vocab)
    if td != tt:
        return f"tokenizer types differ: draft uses {VOCAB_TYPES.get(td, td)}, target uses {VOCAB_TYPES.get(tt, tt)}"
    if draft.add_bos != target.add_bos:
        return f"BOS handling differs: draft add_bos={draft.add_bos}, target add_bos={target.add_bos}"
    if draft.add_bos and draft.bos != target.bos:
        return f"BOS token ids differ: draft {draft.bos}, target {target.bos}"
    if draft.eos != target.eos:
        return f"EOS token ids differ: draft {draft.eos}, target {target.eos}"
    diff = abs(draft.n_vocab - target.n_vocab)
    if diff > MAX_SIZE_DIFFERENCE:
        return (
            f"vocabulary sizes differ by {diff} (draft {draft.n_vocab}, target {target.n_vocab}); "
            f"at most {MAX_SIZE_DIFFERENCE} is allowed"
        )
    for i in range(FIRST_CHECKED_TOKEN, min(draft.n_vocab, target.n_vocab)):
        a, b = draft.token_text(i), target.token_text(i)
        if a != b:
            return f"token {i} differs: draft {a!r}, target {b!r}"
    return None


def check_compatible(draft, target) -> None:
    problem = compatibility_problem(draft, target)
    if problem:
        raise VocabularyMismatchError(
            f"draft {draft.path} cannot draft for target {target.path}: {problem}. "
            "Pick a draft from the same model family (same tokenizer), e.g. a pair from `fsd-local models`."
        )
