"""Issue 40 item 5 on a pair of two tokenizers (the map path: a tiny byte-level BPE draft for a larger SentencePiece
target, F32): prompt lookup beside the draft model, `auto`, the quality budget, log-probabilities with origins,
grammars, tool calls through the openai client, the server's stream the page reads, and `calibrate`."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from fsd_local import Engine
from fsd_local.server import BackgroundServer
from support.clirun import invoke
from support.tinymodels import write_tiny_gguf
from support.tool_templates import TEMPLATES, with_template

PROMPTS = ("the cab and a cab, the end. the ab and", "a band, a band, a band and the cab")
GBNF = 'root ::= ("yes" | "no") ", " word (" " word)? "."\nword ::= [a-z] [a-z] [a-z]?'
GBNF_RE = re.compile(r"(yes|no), [a-z]{2,3}( [a-z]{2,3})?\.")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}]
HELLO = [{"role": "user", "content": "the cab and a band"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, cross_pair):
    """(draft, target): the tiny BPE model for a larger SentencePiece one with a tool-calling (Hermes) template."""
    d = tmp_path_factory.mktemp("across_features")
    big = write_tiny_gguf(d / "big.gguf", seed=4, n_layer=3, n_embd=128, control=("<|im_end|>",))
    return cross_pair[1], str(with_template(big, d / "big-tools.gguf", TEMPLATES["hermes"]))


@pytest.fixture(scope="module")
def eng(pair):
    draft, target = pair
    with Engine(target=target, draft=draft, n_ctx=2048, n_threads=1, draft_policy="fixed", draft_max=4) as e:
        assert e.across is not None and e.pairing.path == "map"
        yield e


@pytest.mark.parametrize(("drafter", "policy"), [("ngram+model", "fixed"), ("model", "auto"), ("ngram+model", "auto")])
def test_lookup_and_auto_keep_greedy_sd_exact_through_the_map(eng, drafter, policy):
    for prompt in PROMPTS:
        ar = eng.generate(prompt, mode="ar", max_tokens=32)
        out = eng.generate(prompt, mode="sd", drafter=drafter, draft_policy=policy, max_tokens=32)
        assert out.token_ids == ar.token_ids, (drafter, policy, prompt)


def test_prompt_lookup_proposes_the_targets_ids_beside_a_map_draft(eng):
    out = eng.generate("abcabcabcabcabcabc", mode="sd", drafter="ngram", max_tokens=24)
    assert out.stats["drafted"] > 0 and out.stats["accepted_sd"] > 0
    assert out.token_ids == eng.generate("abcabcabcabcabcabc", mode="ar", max_tokens=24).token_ids


@pytest.mark.parametrize("bound", [0.05, 0.3])
def test_a_quality_budget_holds_through_the_map(eng, bound):
    for prompt in PROMPTS:
        st = eng.generate(prompt, mode="fsd", quality_budget=bound, max_tokens=33).stats
        assert st["loss_sum"] <= bound * st["tokens"] + 1e-9 and st["quality_budget"] == bound


def test_logprobs_name_each_tokens_origin_through_the_map(eng):
    out = eng.generate(PROMPTS[0], mode="fsd", tau=0.6, max_tokens=32, logprobs=True, top_logprobs=3)
    n = len(out.token_ids)
    assert len(out.origins) == len(out.logprobs) == len(out.top_logprobs) == n
    assert set(out.origins) <= {"sd", "fuzzy", "target"} and "target" in out.origins
    assert (
        out.origins.count("sd") + out.origins.count("fuzzy") == out.stats["accepted_sd"] + out.stats["accepted_fuzzy"]
    )
    assert all(lp <= 0 for lp in out.logprobs)
    ar = eng.generate(PROMPTS[0], mode="ar", max_tokens=32, logprobs=True)
    sd = eng.generate(PROMPTS[0], mode="sd", max_tokens=32, logprobs=True)
    # the same ids; their log-probabilities from a verify batch's rows and from single-row decodes (F32: within 1e-3)
    assert sd.token_ids == ar.token_ids and sd.logprobs == pytest.approx(ar.logprobs, abs=2e-3)


@pytest.mark.parametrize("settings", [{"mode": "sd"}, {"mode": "fsd", "tau": 10.0}, {"mode": "fsd", "tau": 0.3}])
def test_a_grammar_holds_through_the_map(eng, settings):
    for prompt in PROMPTS:
        out = eng.generate(prompt, grammar=GBNF, max_tokens=40, **settings)
        assert GBNF_RE.fullmatch(out.text), (settings, out.text)
    ar = eng.generate(PROMPTS[0], mode="ar", grammar=GBNF, max_tokens=40)
    assert eng.generate(PROMPTS[0], mode="sd", grammar=GBNF, max_tokens=40).token_ids == ar.token_ids


@pytest.fixture(scope="module")
def server(eng):
    with BackgroundServer(eng, model_name="tiny-map") as srv:
        yield srv


def test_a_required_tool_call_through_the_map(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    for mode in ({"mode": "sd"}, {"mode": "fsd", "tau": 0.3}):
        r = c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "what is the weather in paris?"}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=400,
            extra_body=mode,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", r
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
        assert r.model_extra["fsd"]["drafted"] > 0


def test_the_pages_stream_carries_each_token_and_origin_through_the_map(eng, server):
    """What the page reads (the fsd_delta of streamed chunks, tests/test_web.py) for a map pair."""
    assert httpx.get(server.url + "/", timeout=30).status_code == 200
    expected = eng.chat(HELLO, max_tokens=32, mode="fsd", tau=0.6)
    body = {"messages": HELLO, "max_tokens": 32, "mode": "fsd", "tau": 0.6, "stream": True}
    tokens = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += json.loads(line[6:]).get("fsd_delta", {}).get("tokens", [])
    assert [t["id"] for t in tokens] == expected.token_ids
    assert [t["origin"] for t in tokens] == expected.origins


def test_calibrate_runs_on_a_map_pair(pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "the cab and a", "answer": "cab", "extract": "regex", "pattern": "(\\\\w+)"}\n'
        '{"prompt": "a band and", "answer": "the", "extract": "regex", "pattern": "(\\\\w+)"}\n'
    )
    draft, target = pair
    models = ["--target", target, "--draft", draft, "--threads", "1", "--ctx", "256"]
    args = ["calibrate", *models, "--prompts", str(prompts), "--min-agreement", "0.5", "--steps", "3"]
    r = invoke([*args, "--max-tokens", "10", "--repeats", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["agreement"] >= 0.5 and out["tokens_per_second"] > 0
