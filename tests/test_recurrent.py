"""Models that keep a recurrent state (llama.cpp's hybrid and recurrent architectures), on real tiny GGUFs: an
LFM2 (short-convolution and attention blocks) and a Mamba, both F32, sharing the tiny llama models' vocabulary.

They load as target and as draft and decode plainly (ar, draft-only, several sequences at once); a recurrent
state without snapshots or a checkpoint cannot drop a suffix, so a rewind empties the sequence and the next
decode evaluates the text again. Speculative modes with them: test_recurrent_rewind.py (one sequence) and
test_recurrent_batch.py (several at once).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import llama_cpp as lc
import numpy as np
import pytest
from test_recurrent_batch import _decided

from fsd_local import Engine
from fsd_local.llama.bindings import init_backend
from fsd_local.llama.model import Model, ModelOptions
from support.tinymodels import write_tiny_lfm2_gguf, write_tiny_mamba_gguf

PROMPT = "the fox walks at night"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return str(write_tiny_lfm2_gguf(tmp_path_factory.mktemp("lfm2") / "lfm2.gguf"))


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    return str(write_tiny_mamba_gguf(tmp_path_factory.mktemp("mamba") / "mamba.gguf"))


@pytest.fixture(scope="module", params=["lfm2", "mamba"])
def recurrent(request):
    """Each tiny model with a recurrent state: the hybrid one, then the fully recurrent one."""
    return request.getfixturevalue(request.param)


def _model(path: str, role: str = "target", n_seq: int = 1) -> Model:
    return Model(ModelOptions(path, n_ctx=256, n_threads=1, n_gpu_layers=0, n_seq=n_seq), role)


class RawContext:
    """A model straight through llama_cpp, apart from fsd_local's Model: the independent reference."""

    def __init__(self, path: str):
        init_backend()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        assert self.model, f"llama.cpp could not load {path}"
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 256, 1, 1, 1
        cp.n_batch = cp.n_ubatch = 64
        self.ctx = lc.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_past = 0

    def decode(self, tokens) -> np.ndarray:
        """Append tokens in one call; the last one's logits."""
        batch = lc.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, self.n_past + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(tokens) - 1
            assert lc.llama_decode(self.ctx, batch) == 0
        finally:
            lc.llama_batch_free(batch)
        self.n_past += len(tokens)
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, -1), (self.n_vocab,)).copy()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """The prompt but its last token in one call, then one token a call, as plain decoding does."""
        self.decode(prompt[:-1])
        out, last = [], prompt[-1]
        for _ in range(n):
            last = int(np.argmax(self.decode([last])))
            out.append(last)
        return out

    def close(self) -> None:
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


def test_the_tiny_models_keep_a_recurrent_state(lfm2, mamba, tiny_pair):
    for path, arch, hybrid in ((lfm2, "lfm2", True), (mamba, "mamba", False)):
        m = _model(path)
        try:
            assert (m.architecture, m.recurrent) == (arch, True)
            assert bool(lc.llama_model_is_hybrid(m.model)) == hybrid
            assert bool(lc.llama_model_is_recurrent(m.model)) != hybrid
        finally:
            m.close()
    t = _model(tiny_pair[1])
    try:
        assert (t.architecture, t.recurrent) == ("llama", False)
    finally:
        t.close()


def test_plain_decoding_is_the_models_own_greedy_text(recurrent):
    """64 greedy tokens through the Engine equal llama.cpp's own, decoded apart from fsd_local."""
    with Engine(target=recurrent, n_ctx=256, n_threads=1, mode="ar") as eng:
        prompt = eng.tokenize(PROMPT)
        out = eng.generate(prompt, max_tokens=64, **GREEDY)
    raw = RawContext(recurrent)
    try:
        want = raw.greedy(prompt, 64)
    finally:
        raw.close()
    assert out.token_ids == want
    assert len(set(want)) > 8  # varied text, not one token repeated


def test_a_rewind_empties_the_state_and_the_text_is_evaluated_again(recurrent):
    """truncate cannot drop a suffix of a recurrent state: it empties the sequence (and says so by what it keeps);
    the same text decoded again gives the logits of a fresh context that evaluated it."""
    m = _model(recurrent)
    raw = RawContext(recurrent)
    try:
        text = m.tokenize(PROMPT)
        m.decode(text)
        assert m.truncate(len(text)) == len(text)  # nothing to drop: the state stays
        assert m.truncate(len(text) - 2) == 0
        assert m.tokens == [] and lc.llama_memory_seq_pos_max(m.mem, 0) == -1
        m.decode(text[:-2])
        want = raw.decode(text[:-2])
        np.testing.assert_allclose(m.logits(1)[0], want, atol=1e-4)
        assert m.keep_common_prefix([*text[:-2], 5, 6]) == len(text) - 2  # a prefix of the new text: kept
        assert m.keep_common_prefix([*text[:3], 7, 8]) == 0  # a suffix to drop: emptied
    finally:
        m.close()
        raw.close()


def test_llama_cpp_cannot_drop_a_partial_range_of_a_recurrent_state(mamba):
    """Why a rewind empties the sequence: llama.cpp refuses to drop a suffix of a state without snapshots."""
    raw = RawContext(mamba)
    try:
        raw.decode([1, 260, 261, 262, 263, 264])
        assert not lc.llama_memory_seq_rm(raw.mem, 0, 3, -1)  # rewind to position 3: refused
        assert lc.llama_memory_seq_pos_max(raw.mem, 0) == 5  # and nothing was dropped
        assert lc.llama_memory_seq_rm(raw.mem, 0, -1, -1)  # dropping the whole sequence is allowed
        assert lc.llama_memory_seq_pos_max(raw.mem, 0) == -1
    finally:
        raw.close()


def test_calls_reuse_the_state_where_it_is_a_prefix_and_evaluate_again_where_not(recurrent):
    with Engine(target=recurrent, n_ctx=256, n_threads=1, mode="ar") as eng:
        prompt = eng.tokenize(PROMPT)
        first = eng.generate(prompt, max_tokens=16, **GREEDY)
        # the next call continues the text: the state holds a prefix of it, nothing is evaluated again
        more = eng.generate(prompt + first.token_ids, max_tokens=16, **GREEDY)
        assert more.stats["prompt_evaluated"] == 1
        other = prompt[:-2] + eng.tokenize("owl", add_special=False)
        shared = eng.generate(other, max_tokens=16, **GREEDY)
        assert shared.stats["prompt_evaluated"] == len(other)  # a suffix to drop: the whole prompt again
        eng.reset()
        assert eng.generate(prompt + first.token_ids, max_tokens=16, **GREEDY).token_ids == more.token_ids
        eng.reset()
        fresh = eng.generate(other, max_tokens=16, **GREEDY)
        assert fresh.token_ids == shared.token_ids
        assert fresh.stats["prompt_evaluated"] == len(other)


def test_a_second_chat_turn_reuses_the_first_and_equals_a_fresh_evaluation(recurrent):
    # words only (no control or byte tokens): a reply whose text tokenizes back to its own tokens, as a real
    # model's does
    words = {"temperature": 0.8, "logit_bias": {t: float("-inf") for t in range(3 + 256)}}
    msgs = [{"role": "user", "content": "where does the fox go at night?"}]
    with Engine(target=recurrent, n_ctx=512, n_threads=1, mode="ar") as eng:
        first = eng.chat(msgs, max_tokens=24, seed=3, **words)
        msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and the owl?"}]
        second = eng.chat(msgs, max_tokens=24, seed=4, **words)
        assert second.stats["prompt_evaluated"] < second.stats["prompt_tokens"] - len(first.token_ids)
        eng.reset()
        again = eng.chat(msgs, max_tokens=24, seed=4, **words)
    assert again.stats["prompt_evaluated"] == again.stats["prompt_tokens"]
    assert again.token_ids == second.token_ids


def test_a_full_context_ends_the_reply_as_for_a_transformer(lfm2):
    with Engine(target=lfm2, n_ctx=64, n_threads=1, mode="ar") as eng:
        c = eng.generate(PROMPT, max_tokens=1000, **GREEDY)
        assert (c.finish_reason, c.finish_detail) == ("length", "context_full")
        assert c.prompt_tokens + len(c.token_ids) == eng.target.n_ctx + 1  # the last token is never stored
        assert eng.generate(PROMPT, max_tokens=5, **GREEDY).finish_detail == "max_tokens"


def _together(eng: Engine, prompts: list[str], **settings) -> list[list[int]]:
    """Each prompt's greedy token ids, all generated at once (a thread each)."""
    out: dict[int, list[int]] = {}

    def run(i: int, p: str) -> None:
        out[i] = eng.generate(p, **settings, **GREEDY).token_ids

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return [out.get(i, []) for i in range(len(prompts))]


def test_several_sequences_at_once_each_get_their_own_text(lfm2, mamba):
    prompts = ["the fox walks at night", "abc def", "the fox walks at night", "xyz, the owl"]
    for path in (lfm2, mamba):
        with Engine(target=path, n_ctx=512, n_threads=1, mode="ar", parallel=4) as eng:
            alone = []
            for p in prompts:
                eng.reset()
                alone.append(eng.generate(p, max_tokens=32, **GREEDY).token_ids)
            assert _together(eng, prompts, max_tokens=32) == alone


def test_a_recurrent_draft_decodes_alone_in_draft_only(lfm2, tiny_pair):
    """draft-only is plain decoding by the draft: a recurrent draft runs it, and gives its own greedy text."""
    with Engine(target=tiny_pair[1], draft=lfm2, n_ctx=256, n_threads=1, mode="draft-only") as eng:
        prompt = eng.tokenize(PROMPT)
        out = eng.generate(prompt, max_tokens=32, **GREEDY)
    raw = RawContext(lfm2)
    try:
        assert out.token_ids == raw.greedy(prompt, 32)
    finally:
        raw.close()


def test_a_target_without_snapshots_loads_with_a_checkpoint_as_a_draft_does(mamba, tiny_pair):
    draft, target = tiny_pair
    with Engine(target=mamba, draft=draft, n_ctx=128, n_threads=1) as eng:  # the default mode, fsd
        assert eng.target.recurrent and eng.target.rewinds and eng.target.redecodes
        sd = eng.generate(PROMPT, max_tokens=16, mode="sd", draft_policy="fixed", **GREEDY)
        assert sd.stats["drafted"] > 0 and sd.token_ids == eng.generate(PROMPT, max_tokens=16, **GREEDY).token_ids
    with Engine(target=target, draft=mamba, n_ctx=128, n_threads=1) as eng:  # a draft goes back to a checkpoint
        assert eng.draft.recurrent and eng.draft.rewinds


def test_several_sequences_at_once_run_speculative_calls_as_one_does(mamba, tiny_pair):
    """A recurrent target of two sequences at once (a spare each for its checkpoints), prompt lookup or a draft
    model: each call's greedy text is the target's own, as alone."""
    draft, _ = tiny_pair
    with Engine(target=mamba, draft=draft, n_ctx=256, n_threads=1, mode="ar") as eng:
        refs = {p: eng.generate(p, max_tokens=12, logprobs=True, top_logprobs=2, **GREEDY) for p in (PROMPT, "a")}
        alone = {p: _decided(r).token_ids for p, r in refs.items()}  # no near tie: a batch rounds it the same
    with Engine(target=mamba, draft=draft, n_ctx=256, n_threads=1, parallel=2, draft_policy="fixed") as eng:
        assert eng.target.n_seq == 2 and lc.llama_n_seq_max(eng.target.ctx) == 4 and eng.target.rewinds
        for mode, drafter in (("sd", "model"), ("fsd", "ngram")):
            out = _together(eng, list(alone), max_tokens=12, mode=mode, drafter=drafter)
            assert out == list(alone.values()), (mode, drafter)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsd_local.cli", "generate", PROMPT, "--threads", "1", "--max-tokens", "8", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_cli_decodes_a_recurrent_target_alone_or_with_prompt_lookup(lfm2):
    """--draft none: plain decoding; no draft named and none on the disk: prompt lookup drafts, as for any model."""
    for args, said in (
        (["--draft", "none"], "--draft none: plain decoding, the target alone (mode ar)"),
        ([], "Meanwhile prompt lookup drafts (--drafter ngram)."),
    ):
        r = _cli("--target", lfm2, *args)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
        assert "[length] 8 tokens" in r.stderr
        assert said in r.stderr


def test_cli_runs_a_recurrent_target_with_a_draft(mamba, tiny_pair):
    r = _cli("--target", mamba, "--draft", tiny_pair[0], "--tau", "0.4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "[length] 8 tokens" in r.stderr


def test_serve_gives_a_recurrent_target_the_default_slots(mamba, tiny_pair):
    """`serve` without --parallel: the default number of slots, for a recurrent target as for a transformer."""
    from fsd_local.cli.options import load_engine
    from fsd_local.server.worker import default_parallel
    from fsd_local.settings import Settings

    draft, target = tiny_pair
    base = dict(draft=draft, pair=None, n_ctx=4096, n_threads=1, n_gpu_layers=0, draft_n_gpu_layers=0)
    for t in (mamba, target):
        with load_engine(target=t, **base, settings=Settings(), parallel=None) as eng:
            assert eng.parallel == default_parallel(4096) > 1
            assert len(eng.generate(PROMPT, max_tokens=4, mode="sd", **GREEDY).token_ids) == 4
