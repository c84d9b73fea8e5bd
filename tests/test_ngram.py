"""Prompt lookup (drafting/ngram.py): what the n-gram index proposes against its definition by rescanning, after
appends and rewinds, and on the shipped grounded prompts."""

from __future__ import annotations

import random
import re
from time import perf_counter

import numpy as np
import pytest

from fsd_local.drafting.ngram import MATCH_LENGTH_CAP, NgramDrafter, match_class

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)

def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""


def word_tokens(text: str, vocab: dict) -> list[int]:
    """A stand-in tokenizer: words, punctuation and newlines become ids (real text, real repetition)."""
    return [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\w+|[^\w\s]|\n", text)]


def brute_force(history, k, ngram_min, ngram_max, periodic=True):
    """The definition, by rescanning: longest n first, most recent earlier occurrence with a follower."""
    size = len(history)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = history[size - n :]
        for s in range(size - n - 1, -1, -1):
            if history[s : s + n] == tail:
                ext = list(history)
                out = []
                while len(out) < k and s + n + len(out) < len(ext):
                    out.append(ext[s + n + len(out)])
                    if periodic:
                        ext.append(out[-1])
                return out
    return []


def test_proposes_what_followed_the_earlier_occurrence():
    vocab: dict = {}
    toks = word_tokens(CODE, vocab)
    # the output has started rewriting the second function's loop: "for v in"
    history = toks + word_tokens("def variance(values):\n    m = mean(values)\n    total = 0\n    for v in", vocab)
    d = NgramDrafter(1, 3)
    got = d.propose(history, 5)
    assert got == word_tokens(" values:\n    total +", vocab)
    assert d.last_match[0] == 3
    assert got == brute_force(history, 5, 1, 3)


def test_longest_n_is_preferred_over_a_more_recent_shorter_match():
    #        0  1  2  3  4  5  6  7  8  9
    hist = [1, 2, 3, 40, 9, 3, 50, 9, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at 0 (followed by 40); the unigram 3 occurred later, at 5 (followed by 50)
    d = NgramDrafter(1, 3)
    assert d.propose(hist, 1) == [40]
    assert d.last_match == (3, 0)
    assert NgramDrafter(1, 1).propose(hist, 1) == [50]


def test_most_recent_occurrence_wins():
    hist = [7, 8, 1, 7, 8, 2, 7, 8, 3, 5, 7, 8]
    assert NgramDrafter(1, 3).propose(hist, 1) == [3]
    assert NgramDrafter(1, 3).last_match is None  # fresh drafter, nothing proposed yet


def test_no_match_and_short_histories():
    d = NgramDrafter(1, 3)
    assert d.propose([1, 2, 3, 4, 5], 4) == []
    assert d.last_match is None
    assert d.propose([], 4) == []
    assert d.propose([9], 4) == []
    assert NgramDrafter(2, 3).propose([5, 1, 2, 5], 3) == []  # only a unigram matches; min is 2
    assert NgramDrafter(1, 3).propose([5, 1, 2, 5], 0) == []


def test_k_limits_and_periodic_continuation():
    hist = [1, 2, 3, 4, 5, 6, 1, 2]
    d = NgramDrafter(1, 3)
    assert d.propose(hist, 2) == [3, 4]
    assert d.propose(hist, 4) == [3, 4, 5, 6]
    # the continuation reaches the end of the history: it goes on with the proposal itself
    assert d.propose(hist, 8) == [3, 4, 5, 6, 1, 2, 3, 4]
    assert NgramDrafter(1, 3, periodic=False).propose(hist, 8) == [3, 4, 5, 6, 1, 2]
    # a repeated token is a period-1 pattern
    assert NgramDrafter(1, 3).propose([4, 9, 9, 9], 3) == [9, 9, 9]


def test_match_length_is_how_far_the_text_agrees_before_the_match():
    #        0  1  2  3  4  5  6  7  8  9
    hist = [1, 2, 3, 4, 9, 6, 2, 3, 4]
    d = NgramDrafter(1, 3)
    assert d.propose(hist, 1) == [9] and d.last_match == (3, 1)
    assert d.match_length == 3  # hist[0] = 1 differs from hist[5] = 6
    hist = [1, 2, 3, 4, 9, 1, 2, 3, 4]
    assert d.propose(hist, 1) == [9] and d.match_length == 4  # agrees back to the start of the text
    # a copied block: the agreement grows with every copied token, capped
    block = list(range(100, 150))
    d.propose(block + [0] + block[:40], 2)
    assert d.match_length == MATCH_LENGTH_CAP
    assert d.propose([5, 6], 2) == [] and d.match_length == 0
    # a periodic run agrees with itself shifted by its period
    d.propose([7, 7, 7, 7, 7, 7], 2)
    assert d.match_length == 5


def test_match_classes():
    assert [match_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]


@pytest.mark.parametrize("seed", range(6))
def test_random_histories_match_the_definition_with_appends_and_rewinds(seed):
    rng = random.Random(seed)
    lo, hi = rng.choice([(1, 3), (1, 4), (2, 3), (2, 2)])
    d = NgramDrafter(lo, hi)
    hist: list[int] = []
    for _ in range(300):
        r = rng.random()
        if r < 0.15 and hist:  # the engine's text shrinks (a new prompt sharing only a prefix)
            hist = hist[: rng.randrange(len(hist) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(3))]
        else:
            hist = hist + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        k = rng.randrange(0, 7)
        assert d.propose(hist, k) == (brute_force(hist, k, lo, hi) if k > 0 else []), (hist, k)


@pytest.mark.parametrize("seed", range(4))
def test_rewind_leaves_exactly_a_fresh_index(seed):
    rng = random.Random(100 + seed)
    hist = [rng.randrange(5) for _ in range(400)]
    d = NgramDrafter(1, 4)
    d.sync(hist)
    for cut in (399, 350, 397, 120, 5, 1, 0):
        d.truncate(cut)
        fresh = NgramDrafter(1, 4)
        fresh.sync(hist[:cut])
        assert d.snapshot() == fresh.snapshot(), cut
        d.sync(hist)  # and growing back gives the full index again
        full = NgramDrafter(1, 4)
        full.sync(hist)
        assert d.snapshot() == full.snapshot()
    # sync with a history that diverges in the middle: rewind to the common prefix, then append
    other = hist[:200] + [9, 9, 8] + hist[300:]
    d.sync(other)
    fresh = NgramDrafter(1, 4)
    fresh.sync(other)
    assert d.snapshot() == fresh.snapshot()


def test_sync_accepts_tuples_and_numpy_ints():
    d = NgramDrafter()
    d.sync(tuple(np.array([1, 2, 3, 1, 2], dtype=np.int32)))
    assert d.propose(np.array([1, 2, 3, 1, 2], dtype=np.int64).tolist(), 2) == [3, 1]
    assert all(type(t) is int for t in d.snapshot()[0])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter(0, 3)
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


def test_speed_for_a_4k_token_history(capsys):
    """Printed, not asserted (the machine is shared): the cost of indexing a 4k prompt and of one round."""
    rng = random.Random(0)
    vocab: dict = {}
    base = word_tokens(CODE, vocab)
    prompt = []
    while len(prompt) < 4096:  # text with repetition, like a code-edit prompt, plus noise tokens
        prompt += base[rng.randrange(len(base)) :][: rng.randrange(5, 40)] + [rng.randrange(1000, 49152)]
    prompt = prompt[:4096]
    d = NgramDrafter()
    t = perf_counter()
    d.sync(prompt)
    t_index = perf_counter() - t
    hist = list(prompt)
    rounds, hits = 300, 0
    t = perf_counter()
    for i in range(rounds):
        out = d.propose(hist, 8)
        hits += bool(out)
        hist.extend(out[:3] if out else [rng.randrange(1000, 49152)])  # the engine's seq grows by what it accepted
    t_round = (perf_counter() - t) / rounds
    t = perf_counter()
    for i in range(rounds):  # the caller keeps the index current itself: extend + draft
        out = d.draft(8)
        d.extend(out[:3] if out else [rng.randrange(1000, 49152)])
    t_draft = (perf_counter() - t) / rounds
    fresh = NgramDrafter()
    fresh.sync(d.snapshot()[0])
    assert fresh.snapshot() == d.snapshot()
    with capsys.disabled():
        print(
            f"\nngram: index 4096 tokens {t_index * 1e3:.2f} ms; propose(history) per round {t_round * 1e6:.1f} us "
            f"at ~{len(hist)} tokens ({hits}/{rounds} rounds matched); extend+draft {t_draft * 1e6:.1f} us"
        )


def test_grounded_prompts_file_parses_and_repeats_its_input():
    from pathlib import Path

    from fsd_local.bench.prompts import load_prompts

    path = Path(__file__).parent.parent / "fsd_local" / "data" / "prompts-grounded.jsonl"
    prompts = load_prompts(path)
    assert len(prompts) >= 8
    vocab: dict = {}
    for p in prompts:
        assert 300 <= len(p.text) <= 1200  # ~90-250 SmolLM2 tokens
        # what the answer has started to write is already in the prompt: prompt lookup finds it
        toks = word_tokens(p.text, vocab)
        assert NgramDrafter(1, 3).propose(toks, 4), p.text[-80:]
