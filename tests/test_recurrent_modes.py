"""Models with a recurrent state treated like any model, on tiny F32 GGUFs the suite writes: prompt lookup (alone
and before a draft model), grammars with jump-forward, every lossy rule under the quality budget and drafts across
tokenizers run with a hybrid or a Mamba model as target or draft, exactly where the rule is exact and each state
the text afterwards; automatic pairing chooses them; doctor and the GPU placement count their state's copies
(docs/design.md, "Models with a recurrent state")."""

from __future__ import annotations

import ctypes
import json
import signal
import threading

import llama_cpp as lc
import numpy as np
import pytest
from click.testing import CliRunner
from test_engine import _next_logits
from test_recurrent_batch import ASKS, _decided
from test_recurrent_rewind import OTHER_CALLS, _fresh_logits

from fsd_local import CacheTruncationError, Engine
from fsd_local.cli import cli
from fsd_local.llama import doctor, gguf_info, state_shape
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.llama.placement import footprint
from fsd_local.round import rewind_options
from fsd_local.settings import CHAT_DEFAULTS, Settings
from support.localstores import hub_file, isolate
from support.serving import start_serve, wait_up
from support.tinymodels import write_tiny_gguf, write_tiny_lfm2_gguf, write_tiny_mamba_gguf

GREEDY = {"temperature": 0, "ignore_eos": True}
REPEATS = "the fox walks at night, the fox walks at night, the fox walks"  # prompt lookup finds its drafts
PROMPT = "we ran far away, very far"
GRAMMAR = 'root ::= "the " [a-z ]+ "."'


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models of one vocabulary (as test_recurrent_rewind.py's: a llama and a hybrid and a Mamba leaning on its
    token map, a hybrid pair of their own), and a larger BPE llama: another tokenizer."""
    d = tmp_path_factory.mktemp("modes")
    llama = write_tiny_gguf(d / "llama.gguf", seed=2, block_scale=0.1)
    paths = {
        "llama": llama,
        "hybrid_target": write_tiny_lfm2_gguf(d / "lfm2-t.gguf", seed=2, noise=0.06),
        "hybrid_draft": write_tiny_lfm2_gguf(d / "lfm2-d.gguf", seed=1),
        "hybrid_like_llama": write_tiny_lfm2_gguf(d / "lfm2-l.gguf", seed=3, lexicon_of=llama, block_scale=0.1),
        "mamba_like_llama": write_tiny_mamba_gguf(d / "mamba-l.gguf", n_embd=64, lexicon_of=llama, block_scale=0.3),
        "bpe": write_tiny_gguf(d / "bpe.gguf", seed=3, tokenizer="bpe", n_embd=128),
    }
    return {name: str(p) for name, p in paths.items()}


PAIRS = {  # (target, draft)
    "both hybrid": ("hybrid_target", "hybrid_draft"),
    "recurrent target": ("mamba_like_llama", "llama"),
    "hybrid draft": ("llama", "hybrid_like_llama"),
}


def _engine(models, pair: str, **kw) -> Engine:
    target, draft = (models[n] for n in PAIRS[pair])
    return Engine(target=target, draft=draft, n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=4, **kw)


def _states_are_the_text(eng: Engine, seq: list[int]) -> None:
    for m in (eng.target, eng.draft):
        want = _fresh_logits(m.path, seq)
        np.testing.assert_allclose(_next_logits(m, seq), want, rtol=0, atol=OTHER_CALLS, err_msg=m.role)


@pytest.mark.parametrize("pair", PAIRS)
def test_prompt_lookup_and_a_grammar_with_jump_forward_give_ars_tokens(models, pair):
    with _engine(models, pair) as eng:
        ar = eng.generate(REPEATS, mode="ar", max_tokens=48, **GREEDY)
        for drafter in ("ngram", "ngram+model"):
            sd = eng.generate(REPEATS, mode="sd", drafter=drafter, max_tokens=48, **GREEDY)
            assert sd.stats["drafted"] > 0 and sd.token_ids == ar.token_ids, drafter
        _states_are_the_text(eng, eng.tokenize(REPEATS) + ar.token_ids)
        plain = eng.generate(PROMPT, mode="ar", grammar=GRAMMAR, max_tokens=40, temperature=0)
        for mode in ("sd", "fsd"):
            out = eng.generate(PROMPT, mode=mode, tau=0.0, grammar=GRAMMAR, max_tokens=40, temperature=0)
            assert out.stats["forced"] > 0 and out.stats["drafted"] > 0, mode
            assert out.token_ids == plain.token_ids and out.text.startswith("the "), mode
        _states_are_the_text(eng, eng.tokenize(PROMPT) + plain.token_ids)


@pytest.mark.parametrize("pair", PAIRS)
def test_every_lossy_rule_keeps_its_quality_budget(models, pair):
    """The budget moves each rule's threshold from the target's logits: a state rewound wrong would still run, so
    the states are checked against fresh contexts after each reply."""
    rescued = 0
    with _engine(models, pair) as eng:
        for mode in ("fsd", "typical", "cascade", "relaxed", "fsd-entropy"):
            out = eng.generate(PROMPT, mode=mode, quality_budget=0.3, max_tokens=32, **GREEDY)
            st = out.stats
            assert st["loss_sum"] <= 0.3 * st["tokens"] + 1e-9 and st["quality_budget"] == 0.3, mode
            rescued += st["accepted_fuzzy"]
            _states_are_the_text(eng, eng.tokenize(PROMPT) + out.token_ids)
    assert rescued > 0  # the budget was spent, so rounds were cut and rewound within it


@pytest.mark.parametrize("draft", ["hybrid_like_llama", "mamba_like_llama"])
@pytest.mark.parametrize("across", ["map", "text"])
def test_a_recurrent_draft_of_another_tokenizer_drafts_exactly(models, draft, across):
    with Engine(target=models["bpe"], draft=models[draft], n_ctx=512, n_threads=1, across=across) as eng:
        assert eng.across is not None and eng.draft.recurrent
        for prompt in (PROMPT, REPEATS):
            ar = eng.generate(prompt, mode="ar", max_tokens=32, **GREEDY)
            sd = eng.generate(prompt, mode="sd", draft_policy="fixed", max_tokens=32, **GREEDY)
            assert sd.stats["drafted"] > 0 and sd.token_ids == ar.token_ids, prompt


def test_automatic_pairing_chooses_recurrent_drafts_and_drafts_for_recurrent_targets(models, tmp_path, monkeypatch):
    s = isolate(monkeypatch, tmp_path)
    hub_file(s["huggingface"], "acme/Lfm2-GGUF", "lfm2-t.gguf", models["hybrid_target"])
    hub_file(s["huggingface"], "acme/Tiny-GGUF", "llama.gguf", models["llama"])
    hub_file(s["huggingface"], "acme/Mamba-GGUF", "mamba-l.gguf", models["mamba_like_llama"])
    listed = CliRunner().invoke(cli, ["models", "--local", "--json"])
    assert listed.exit_code == 0, listed.output
    drafts = {m["name"]: m["drafts"] for m in json.loads(listed.output)["models"]}
    lfm2, llama, mamba = "acme/Lfm2-GGUF/lfm2-t.gguf", "acme/Tiny-GGUF/llama.gguf", "acme/Mamba-GGUF/mamba-l.gguf"
    assert drafts[lfm2] == [mamba, llama]  # smallest first: a recurrent model and a transformer draft for a hybrid
    assert drafts[llama] == [mamba] and drafts[mamba] == []  # and a recurrent one for a transformer
    run = ["--threads", "1", "--max-tokens", "8", "--json"]
    out = CliRunner().invoke(cli, ["generate", PROMPT, "--target", lfm2, *run])
    assert out.exit_code == 0, out.output
    assert f"draft: {mamba} [Hugging Face cache, 270 kB, f32; " in out.stderr and f"chosen for {lfm2}" in out.stderr
    settings = json.loads(out.stdout)["settings"]
    assert (settings["mode"], settings["drafter"]) == ("fsd", "model")


def test_doctor_counts_attention_and_recurrent_layers_and_every_copy_of_the_state(models):
    rewind = rewind_options(Settings())
    snapshots = rewind[0]["n_rs_seq"]
    r = doctor.report(target=models["hybrid_target"], draft=models["mamba_like_llama"], n_ctx=4096, rewind=rewind)
    t, d = r["models"]["target"], r["models"]["draft"]
    assert (t["layers"], t["kv_layers"], t["recurrent_layers"]) == (3, 1, 2)  # "cca": two convolutions, attention
    assert (d["layers"], d["kv_layers"], d["recurrent_layers"], d["kv_bytes"]) == (1, 0, 1, 0)
    assert t["kv_bytes"] == 4096 * 2 * 4 * 16 * 2  # one attention layer: K and V, 4 heads of 16, f16
    assert t["state"]["snapshots"] == snapshots and t["state"]["spare"] == 0  # LFM2 keeps snapshots
    assert d["state"]["snapshots"] == 0 and d["state"]["spare"] == 1  # Mamba has none: a checkpoint's spare
    text = doctor.render(r)
    assert "lfm2 (tiny-lfm2-2), 3 layers (2 recurrent, 1 with attention), embedding 64, 4 heads (4 KV)" in text
    assert "mamba (tiny-mamba-0), 1 recurrent layer, embedding 64" in text
    assert f"(1 sequence, {snapshots} snapshots each), and up to 3 host copies for a next turn" in text
    assert "no KV cache; recurrent state 3.5 KiB a sequence, 7.0 KiB in all (1 sequence, a spare for" in text


@pytest.mark.parametrize("name", ["hybrid_target", "mamba_like_llama"])
@pytest.mark.parametrize("n_seq, n_rs_seq, checkpoint", [(1, 5, True), (1, 0, False), (2, 5, False), (3, 5, True)])
def test_the_estimate_is_what_llama_cpp_allocates(models, name, n_seq, n_rs_seq, checkpoint):
    """The header's state bytes are a sequence's recurrent state as llama.cpp serialises it (less its few bytes of
    framing), its rows those the loaded context holds; the placement's layers add them to the weights."""
    path = models[name]
    info = gguf_info.read(path)
    m = Model(ModelOptions(path, 256, 1, n_gpu_layers=0, n_seq=n_seq, n_rs_seq=n_rs_seq, checkpoint=checkpoint))
    try:
        m.decode([1, 2, 3], "last")
        serialised = lc.llama_state_seq_get_size_ext(m.ctx, 0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        loaded = lc.llama_n_seq_max(m.ctx) * (1 + lc.llama_n_rs_seq(m.ctx))
    finally:
        m.close()
    one = info.state_bytes * sum(info.recurrent)
    assert 0 < serialised - one < 128
    rows = state_shape.rows(info.architecture, n_seq, n_rs_seq, checkpoint)
    assert rows == loaded
    fp = footprint(info, 256, state_rows=rows)
    kv = info.kv_bytes(256, 1, 1)
    for i, (w, layer) in enumerate(zip(info.layer_bytes, fp.layers)):
        assert layer == w + kv[i] + (info.state_bytes * rows if info.recurrent[i] else 0)


def test_a_rollback_llama_cpp_refuses_is_an_error_naming_the_model_and_a_refused_copy_is_evaluated_again(models):
    path = models["hybrid_target"]
    m = Model(ModelOptions(path, 256, 1, n_gpu_layers=0, n_rs_seq=2, checkpoint=True), "target")
    try:
        m.decode(list(range(1, 9)), "last")
        m.n_rs_seq = 6  # more than the context keeps: llama.cpp refuses to drop 5 tokens
        with pytest.raises(CacheTruncationError) as info:
            m.truncate(3)
        msg = str(info.value)
        assert f"target model {path} (lfm2): llama.cpp refused to roll its recurrent state back by 5" in msg
        assert "--mode ar" in msg
    finally:
        m.close()
    m = Model(ModelOptions(path, 256, 1, n_gpu_layers=0, n_rs_seq=2, checkpoint=True), "target")
    try:
        m.decode([1, 2, 3, 4, 5], "last")
        m.keep_state()
        n, copy = m._saved[0][0]  # sequence 0's only copy, cut in half
        m._saved[0] = [(n, (ctypes.c_uint8 * (len(copy) // 2)).from_buffer_copy(bytes(copy)[: len(copy) // 2]))]
        m.decode([6, 7], "last")
        m.decode([8], "last")
        assert m.truncate(5) == 0 and m.tokens == []  # a copy llama.cpp cannot read: the text is evaluated again
    finally:
        m.close()


def test_serve_answers_both_apis_with_a_hybrid_pair(models):
    """`serve` with its default slots, as for any model: two requests at once come whole, and greedy sd through the
    openai and ollama clients is what the target alone writes."""
    import ollama
    import openai

    target, draft = models["hybrid_target"], models["hybrid_draft"]
    hello = [{"role": "user", "content": ASKS[1]}]  # two at once: a reply with no near tie (test_recurrent_batch)
    with Engine(target=target, draft=draft, n_ctx=2048, n_threads=1) as eng:
        alone = _decided(eng.chat(hello, max_tokens=24, mode="ar", temperature=0, logprobs=True, top_logprobs=2)).text
        o_alone = eng.chat(hello, max_tokens=24, mode="ar", **{**CHAT_DEFAULTS, "temperature": 0.0}).text
    proc, url = start_serve(draft, target, "--ctx", "2048", "--draft-policy", "fixed", "--draft-max", "4")
    try:
        wait_up(proc, url)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        replies: list[str] = []

        def ask() -> None:
            r = c.chat.completions.create(
                model="m", messages=hello, max_tokens=24, temperature=0, extra_body={"mode": "sd"}
            )
            assert r.model_extra["fsd"]["drafted"] > 0
            replies.append(r.choices[0].message.content)

        both = [threading.Thread(target=ask) for _ in range(2)]
        for t in both:
            t.start()
        for t in both:
            t.join(timeout=120)
        assert replies == [alone, alone]
        chunks = c.chat.completions.create(model="m", messages=hello, max_tokens=24, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == alone  # fsd at tau 0
        oc = ollama.Client(host=url, timeout=60)
        r = oc.chat(model="m", messages=hello, options={"temperature": 0, "num_predict": 24, "mode": "sd"})
        assert r.message.content == o_alone  # with chat's defaults (repeat penalty ...) under its options
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
