"""The server's log-probabilities, context errors and behaviour under load, through the official `openai` client
(and raw HTTP for headers), on a real server on a loopback port with the tiny pair. Waits are bounded."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from fsd_local.server import BackgroundServer
from fsd_local.server.logprobs import token_text

HELLO = [{"role": "user", "content": "hello there"}]
TIMEOUT = 60


def entries(tiny_engine, c):
    """What a chat choice's logprobs.content must hold for Completion c."""
    return [
        (token_text(tiny_engine.token_bytes(t)), lp, [a for a, _ in top], origin)
        for t, lp, top, origin in zip(c.token_ids, c.logprobs, c.top_logprobs, c.origins)
    ]


def test_chat_logprobs_through_the_openai_client(tiny_engine, client):
    expected = tiny_engine.chat(HELLO, max_tokens=12, tau=0.3, top_logprobs=3)
    r = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, extra_body={"tau": 0.3}
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == expected.text and len(content) == len(expected.token_ids)
    seen: list = []
    for e, (token, lp, top_ids, origin) in zip(content, entries(tiny_engine, expected)):
        assert e.token == token and e.logprob == pytest.approx(lp, abs=1e-9)
        assert bytes(e.bytes) == tiny_engine.token_bytes(expected.token_ids[len(seen)])
        seen.append(e)
        assert [a.token for a in e.top_logprobs] == [token_text(tiny_engine.token_bytes(i)) for i in top_ids]
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-9 and len(e.top_logprobs) == 3
        assert e.model_extra["origin"] == origin  # fsd-local's extension: why the token is there
    assert {e.model_extra["origin"] for e in content} <= {"target", "sd", "fuzzy"}


def test_chat_logprobs_streamed(tiny_engine, client):
    expected = tiny_engine.chat(HELLO, max_tokens=16, tau=0.3, top_logprobs=2)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=HELLO,
            max_tokens=16,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            extra_body={"tau": 0.3},
        )
    )
    got = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    want = entries(tiny_engine, expected)
    assert [(e.token, e.model_extra["origin"]) for e in got] == [(t, o) for t, _, _, o in want]
    assert [e.logprob for e in got] == pytest.approx(expected.logprobs, abs=1e-9)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected.text


def test_chat_logprobs_without_alternatives_and_off_by_default(client):
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=6, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    assert client.chat.completions.create(model="m", messages=HELLO, max_tokens=6).choices[0].logprobs is None


def test_completion_logprobs_legacy_format(tiny_engine, client):
    expected = tiny_engine.generate("abc", max_tokens=10, mode="sd", top_logprobs=2)
    r = client.completions.create(model="m", prompt="abc", max_tokens=10, logprobs=2, extra_body={"mode": "sd"})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected.logprobs, abs=1e-9)
    shown = [tiny_engine.token_bytes(t) for t in expected.token_ids]
    assert lp.tokens == [token_text(b) for b in shown]
    widths = [len(b.decode("utf-8", "replace")) for b in shown]
    assert lp.text_offset == [sum(widths[:i]) for i in range(len(shown))]
    assert all(len(top) <= 2 and max(top.values()) >= x - 1e-9 for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.model_extra["origins"] == expected.origins
    streamed = list(
        client.completions.create(
            model="m", prompt="abc", max_tokens=10, logprobs=0, stream=True, extra_body={"mode": "sd"}
        )
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(expected.logprobs, abs=1e-9)
    offsets = [x for p in parts for x in p.text_offset]
    assert offsets == lp.text_offset  # offsets continue across chunks


def test_a_chat_that_cannot_fit_is_a_400_context_length_exceeded(client):
    long = [{"role": "user", "content": "tell me about the fox " * 200}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=long, max_tokens=8)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    assert "context holds 512" in err.value.message


def test_a_reply_cut_by_the_context_says_why(client):
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=2000, extra_body={"ignore_eos": False})
    fsd = r.model_extra["fsd"]
    assert r.choices[0].finish_reason in ("length", "stop")
    if r.choices[0].finish_reason == "length":
        assert fsd["finish_detail"] == "context_full"
    short = client.chat.completions.create(model="m", messages=HELLO, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.model_extra["fsd"]["finish_detail"] == "max_tokens"


# ---------------------------------------------------------------------------------------------- under load
def test_the_default_queue_answers_48_concurrent_chats(tiny_engine):
    """The issue's load: 48 concurrent chat requests; the default queue (512) holds them all, none gets 503."""
    with BackgroundServer(tiny_engine) as srv, ThreadPoolExecutor(48) as pool:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        health = httpx.get(srv.url + "/health", timeout=TIMEOUT).json()
        assert health["queue"]["max_queue"] == 512

        def ask(i):
            msgs = [{"role": "user", "content": f"question {i}"}]
            return c.chat.completions.create(model="m", messages=msgs, max_tokens=4).choices[0].finish_reason

        answers = list(pool.map(ask, range(48)))
    assert len(answers) == 48 and set(answers) <= {"length", "stop"}


def test_every_503_carries_retry_after(tiny_engine):
    """A full queue: 503 queue_full with Retry-After (whole seconds, at least 1), raw HTTP and the client."""
    body = {"model": "m", "messages": HELLO, "max_tokens": 4}
    with BackgroundServer(tiny_engine, max_queue=0) as srv, ThreadPoolExecutor(1) as pool:
        with tiny_engine._lock:  # the running request blocks on the engine: the queue (depth 0) is full
            first = pool.submit(httpx.post, srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
            deadline = TIMEOUT
            while httpx.get(srv.url + "/health", timeout=TIMEOUT).json()["queue"]["running"] != 1:
                deadline -= 0.01
                assert deadline > 0
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
            s = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT)
            assert s.status_code == 503 and int(s.headers["retry-after"]) >= 1
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            with pytest.raises(openai.APIStatusError) as err:
                c.chat.completions.create(model="m", messages=HELLO, max_tokens=4)
            assert err.value.status_code == 503 and int(err.value.response.headers["retry-after"]) >= 1
        assert first.result(TIMEOUT).status_code == 200
        # after a measured generation the estimate is its mean duration, rounded up
        worker = srv.app.state.worker
        assert worker.retry_after() == max(1, math.ceil(worker._mean_seconds))


def test_logprobs_through_the_supervised_model_process(tiny_pair, tiny_engine):
    """`fsd-local serve` runs the models in a child process: the logprobs cross the socket with each piece."""
    d, t = tiny_pair
    expected = tiny_engine.chat(HELLO, max_tokens=8, mode="sd", top_logprobs=2)
    with BackgroundServer.supervised(t, d, model_name="tiny") as srv:
        body = {"model": "m", "messages": HELLO, "max_tokens": 8, "mode": "sd", "logprobs": True, "top_logprobs": 2}
        body |= {"draft_policy": "fixed", "draft_max": 4}  # the engine fixture's batch shapes
        full = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
        content = full["choices"][0]["logprobs"]["content"]
        assert [e["logprob"] for e in content] == pytest.approx(expected.logprobs, abs=1e-9)
        with httpx.stream(
            "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = [
            e
            for ev in events
            if ev["choices"] and ev["choices"][0]["logprobs"]
            for e in ev["choices"][0]["logprobs"]["content"]
        ]
        assert [e["origin"] for e in streamed] == expected.origins
        assert [e["logprob"] for e in streamed] == pytest.approx(expected.logprobs, abs=1e-9)
