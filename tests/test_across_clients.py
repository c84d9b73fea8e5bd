"""`fsd-local serve` on a pair of two tokenizers (the map path: a byte-level BPE draft for a SentencePiece target,
tiny F32 models) through the `openai` and `ollama` client packages: greedy `sd` and `fsd` at tau 0 answer what the
target alone answers, drafts are proposed and accepted through the map, streamed text is the whole text."""

from __future__ import annotations

import signal

import ollama
import openai
import pytest

from fsd_local import Engine
from fsd_local.settings import CHAT_DEFAULTS
from support.serving import start_serve, wait_up
from support.tinymodels import write_tiny_gguf

HELLO = [{"role": "user", "content": "the cab and a band"}]
OLLAMA_GREEDY = {**CHAT_DEFAULTS, "temperature": 0.0}
TIMEOUT = 60  # seconds; every wait below is bounded


@pytest.fixture(scope="module")
def pair(tmp_path_factory, cross_pair):
    """(draft, target): the tiny BPE model drafting for a larger SentencePiece one that ends a turn with
    <|im_end|> (tests/test_across_engine.py's `bpe` pair)."""
    d = tmp_path_factory.mktemp("across_clients")
    target = write_tiny_gguf(d / "big.gguf", seed=4, n_layer=3, n_embd=128, control=("<|im_end|>",))
    return cross_pair[1], str(target)


@pytest.fixture(scope="module")
def alone(pair):
    """What the target alone writes greedily (in this process): the answers the server must give."""
    draft, target = pair
    with Engine(target=target, draft=draft, n_ctx=256, n_threads=1) as eng:
        assert eng.across is not None  # the pair takes the map
        chat = eng.chat(HELLO, max_tokens=24, mode="ar", temperature=0)
        completion = eng.generate("the band and", max_tokens=24, mode="ar", temperature=0)
        assert len(chat.token_ids) > 8 and len(completion.token_ids) > 8  # replies long enough to draft in
        # an Ollama request runs with chat's defaults (repeat penalty ...) under the options it gives
        o_chat = eng.chat(HELLO, max_tokens=24, mode="ar", **OLLAMA_GREEDY)
        o_completion = eng.generate("the band and", max_tokens=24, mode="ar", **OLLAMA_GREEDY)
        yield {
            "chat": chat.text,
            "completion": completion.text,
            "n_completion": len(completion.token_ids),
            "ollama_chat": o_chat.text,
            "ollama_completion": o_completion.text,
            "n_ollama_completion": len(o_completion.token_ids),
        }


@pytest.fixture(scope="module")
def url(pair):
    draft, target = pair
    proc, base = start_serve(draft, target, "--draft-policy", "fixed", "--draft-max", "4")
    try:
        wait_up(proc, base)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=TIMEOUT)


def test_openai_chat_and_completions_through_the_map(url, alone):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    for mode in ({"mode": "sd"}, {"mode": "fsd", "tau": 0.0}):
        r = c.chat.completions.create(model="m", messages=HELLO, max_tokens=24, temperature=0, extra_body={**mode})
        assert r.choices[0].message.content == alone["chat"]
        fsd = r.model_extra["fsd"]
        assert fsd["settings"]["mode"] == mode["mode"] and fsd["drafted"] > 0 and fsd["accepted_fuzzy"] == 0
    sd = {"mode": "sd"}
    chunks = list(
        c.chat.completions.create(model="m", messages=HELLO, max_tokens=24, temperature=0, stream=True, extra_body=sd)
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == alone["chat"]
    r = c.completions.create(model="m", prompt="the band and", max_tokens=24, temperature=0, extra_body=sd)
    assert r.choices[0].text == alone["completion"] and r.usage.completion_tokens == alone["n_completion"]


def test_ollama_chat_and_generate_through_the_map(url, alone):
    oc = ollama.Client(host=url, timeout=TIMEOUT)
    opts = {"temperature": 0, "num_predict": 24, "mode": "sd"}
    r = oc.chat(model="m", messages=HELLO, options=opts)
    assert r.message.content == alone["ollama_chat"]
    streamed = list(oc.chat(model="m", messages=HELLO, options=opts, stream=True))
    assert "".join(x.message.content for x in streamed) == alone["ollama_chat"] and streamed[-1].done
    g = oc.generate(model="m", prompt="the band and", options=opts, raw=True)
    assert g.response == alone["ollama_completion"] and g.eval_count == alone["n_ollama_completion"]
