"""The OpenAI-compatible server, started for real on a free loopback port with the tiny pair.

Answers are checked against the same engine called directly (greedy decoding, so they must be equal), through
the official `openai` client and through raw HTTP (httpx) for what the client would hide: error bodies, status
codes, disconnects. Waits are bounded; the engine's own lock is held by a test where it must keep the server
busy deterministically.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from fsd_local.server import BackgroundServer
from support.serving import start_serve

HELLO = [{"role": "user", "content": "hello there"}]
TIMEOUT = 20  # seconds; every wait below is bounded


def post(server, path, body, timeout=TIMEOUT):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=timeout)


def wait_for(predicate, what):
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def metric(server, name_and_labels):
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith(name_and_labels + " "):
            return float(line.split()[-1])
    return 0.0


# ---------------------------------------------------------------------------------------------- the happy paths
def test_chat_non_streaming_matches_the_engine(tiny_engine, client):
    expected = tiny_engine.chat(HELLO, max_tokens=16, tau=0.3)
    r = client.chat.completions.create(
        model="anything-at-all", messages=HELLO, max_tokens=16, temperature=0, extra_body={"tau": 0.3}
    )
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == expected.finish_reason == "length"
    assert r.model == "anything-at-all"  # one pair answers whatever model is named
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected.prompt_tokens, 16)
    assert r.usage.total_tokens == expected.prompt_tokens + 16
    fsd = r.model_extra["fsd"]
    assert fsd["settings"]["tau"] == 0.3 and fsd["tokens"] >= 16
    assert fsd["accepted_sd"] + fsd["accepted_fuzzy"] <= fsd["drafted"]
    assert 0 <= fsd["acceptance_rate"] <= 1


def test_chat_streaming_matches_the_engine(tiny_engine, client):
    expected = tiny_engine.chat(HELLO, max_tokens=24, tau=0.2)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=HELLO,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"tau": 0.2},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == expected.text
    assert [c.choices[0].finish_reason for c in with_choices].count("length") == 1
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert with_choices[-1].model_extra["fsd"]["settings"]["tau"] == 0.2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24  # include_usage's chunk
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_streaming_and_not(tiny_engine, client):
    expected = tiny_engine.generate("abc", max_tokens=20)
    r = client.completions.create(model="m", prompt="abc", max_tokens=20)
    assert r.choices[0].text == expected.text and r.object == "text_completion"
    assert r.usage.prompt_tokens == expected.prompt_tokens
    streamed = list(client.completions.create(model="m", prompt="abc", max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "length"
    ids = tiny_engine.tokenize("abc")  # a prompt given as token ids means the same
    assert client.completions.create(model="m", prompt=ids, max_tokens=20).choices[0].text == expected.text


def test_standard_fields_stop_seed_temperature(tiny_engine, client):
    plain = tiny_engine.generate("xyz", max_tokens=32).text
    stop = next(ch for ch in plain[3:] if ch.isascii() and ch.isprintable())
    r = client.completions.create(model="m", prompt="xyz", max_tokens=32, stop=[stop, "never-there"])
    assert r.choices[0].text == plain[: plain.index(stop)] and r.choices[0].finish_reason == "stop"
    assert (
        client.completions.create(model="m", prompt="xyz", max_tokens=32, stop=stop).choices[0].text
        == r.choices[0].text
    )
    sampled = [
        client.completions.create(model="m", prompt="xyz", max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    direct = tiny_engine.generate("xyz", max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    assert sampled[0] == sampled[1] == direct.text


def test_fsd_knobs_per_request(tiny_engine, client):
    """tau = 0 is lossless: greedy FSD equals the target alone; the knobs come back in the statistics."""
    ar = client.chat.completions.create(model="m", messages=HELLO, max_tokens=16, extra_body={"mode": "ar"})
    sd = client.chat.completions.create(
        model="m",
        messages=HELLO,
        max_tokens=16,
        extra_body={"tau": 0.0, "mode": "fsd", "divergence": "tv", "draft_max": 6, "top_k": 5, "min_p": 0.01},
    )
    assert ar.choices[0].message.content == sd.choices[0].message.content
    assert ar.model_extra["fsd"]["settings"]["mode"] == "ar" and ar.model_extra["fsd"]["drafted"] == 0
    settings = sd.model_extra["fsd"]["settings"]
    assert (settings["divergence"], settings["draft_max"], settings["top_k"]) == ("tv", 6, 5)
    assert len(sd.model_extra["fsd"]["drafted_by_position"]) <= 6


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["tiny-pair"]
    assert client.models.retrieve("gpt-4o").id == "gpt-4o"
    h = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    # the default queue (docs/server.md, "Load, faults and crashes")
    assert h["status"] == "ok" and h["queue"]["max_queue"] == 512


# ---------------------------------------------------------------------------------------------- bad requests
def too_long():
    return {"model": "m", "prompt": "a" * 600}


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/chat/completions", "{not json", 400, None),
        ("/v1/chat/completions", "[1, 2]", 400, None),
        ("/v1/chat/completions", b"\xff\xfe", 400, None),
        ("/v1/chat/completions", {"model": "m"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            400,
            "messages",
        ),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "max_tokens": 1.5}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "stream": "yes"}, 400, "stream"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "stop": [1]}, 400, "stop"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "tau": -0.1}, 400, "tau"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "tau": "0.3"}, 400, "tau"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "mode": "turbo"}, 400, "mode"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "divergence": "l2"}, 400, "divergence"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "draft_max": 0}, 400, "draft_max"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "seed": -1}, 400, "seed"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "n": 2}, 400, "n"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "logprobs": 3}, 400, "logprobs"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": HELLO, "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs",
        ),
        ("/v1/completions", {"model": "m", "prompt": "a", "logprobs": True}, 400, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "a", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "a", "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"model": "m", "messages": HELLO, "draft_min": 3, "draft_max": 2}, 400, None),
        ("/v1/completions", too_long(), 400, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [99999]}, 400, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ],
)
def test_bad_requests_get_openai_error_bodies(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param


def test_context_overflow_says_so(server):
    err = post(server, "/v1/completions", too_long()).json()["error"]
    assert err["code"] == "context_length_exceeded" and "512" in err["message"]


def test_unknown_paths_and_methods(server):
    r = httpx.get(server.url + "/v1/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and "error" in r.json()


def test_a_failing_generation_is_reported_and_the_server_goes_on(tiny_engine, server, client, monkeypatch):
    expected = tiny_engine.chat(HELLO, max_tokens=8).text

    def broken(*args, **kwargs):
        raise RuntimeError("llama_decode failed (simulated)")
        yield  # a generator, like Engine.stream

    with monkeypatch.context() as m:
        m.setattr(tiny_engine, "stream", broken)
        m.setattr(tiny_engine, "generate", lambda *a, **k: next(broken()))
        r = post(server, "/v1/chat/completions", {"model": "m", "messages": HELLO})
        assert r.status_code == 500 and "simulated" in r.json()["error"]["message"]
        with pytest.raises(openai.APIError, match="simulated"):
            list(client.chat.completions.create(model="m", messages=HELLO, stream=True))
    assert (
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=8).choices[0].message.content == expected
    )


# ---------------------------------------------------------------------------------------------- load and faults
def test_concurrent_clients_each_get_their_own_answer(tiny_engine, server):
    jobs = [
        ("chat", [{"role": "user", "content": f"question {i}"}], {"tau": 0.1 * (i % 4)}, i % 2 == 0) for i in range(8)
    ]
    expected = [tiny_engine.chat(msgs, max_tokens=24, **knobs).text for _, msgs, knobs, _ in jobs]

    def ask(job):
        _, msgs, knobs, stream = job
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        if stream:
            chunks = c.chat.completions.create(model="m", messages=msgs, max_tokens=24, stream=True, extra_body=knobs)
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return (
            c.chat.completions.create(model="m", messages=msgs, max_tokens=24, extra_body=knobs)
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, jobs)) == expected


def test_disconnect_mid_stream_stops_the_generation(tiny_engine, server, client, monkeypatch):
    """The generation is held after its first text until the server has noticed the client left; it must
    then end as 'cancelled' long before max_tokens, and the next request must get a correct answer."""
    expected = tiny_engine.chat(HELLO, max_tokens=12).text
    real_stream = tiny_engine.stream
    finished = []

    def held_stream(prompt, *, cancel, **settings):
        for piece in real_stream(prompt, cancel=cancel, **settings):
            yield piece
            if piece.completion is not None:
                finished.append(piece.completion)
            elif piece.text:  # the client gets this text, then hangs up
                assert cancel.wait(TIMEOUT), "the server never cancelled the generation"

    monkeypatch.setattr(tiny_engine, "stream", held_stream)
    body = {"model": "m", "prompt": "abc", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one piece of text arrived; now hang up
    wait_for(lambda: finished, "the generation to end")
    assert finished[0].finish_reason == "cancelled" and len(finished[0].token_ids) < 400
    monkeypatch.undo()
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=12)
    assert r.choices[0].message.content == expected


def test_a_client_that_gives_up_while_queued_costs_nothing(tiny_engine, server, client):
    expected = tiny_engine.chat(HELLO, max_tokens=8).text
    cancelled = metric(server, 'fsd_generations_total{finish_reason="cancelled"}')
    with tiny_engine._lock:  # the engine is busy: the request waits in the queue
        with pytest.raises(httpx.ReadTimeout):
            post(
                server,
                "/v1/chat/completions",
                {"model": "m", "messages": HELLO, "max_tokens": 300},
                timeout=httpx.Timeout(TIMEOUT, read=0.3),
            )
        time.sleep(0.2)  # the server notices the closed connection
    wait_for(
        lambda: metric(server, 'fsd_generations_total{finish_reason="cancelled"}') == cancelled + 1,
        "the abandoned generation to be cancelled",
    )
    assert (
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=8).choices[0].message.content == expected
    )


def test_full_queue_answers_503(tiny_engine):
    """max_queue=1: one running (blocked on the engine's lock, held here) and one waiting; the third is refused."""
    expected = tiny_engine.chat(HELLO, max_tokens=8).text
    body = {"model": "m", "messages": HELLO, "max_tokens": 8}
    with BackgroundServer(tiny_engine, max_queue=1) as srv, ThreadPoolExecutor(2) as pool:

        def queue():
            return httpx.get(srv.url + "/health", timeout=TIMEOUT).json()["queue"]

        with tiny_engine._lock:
            first = pool.submit(post, srv, "/v1/chat/completions", body)
            wait_for(lambda: queue()["running"] == 1, "the first request to start")
            second = pool.submit(post, srv, "/v1/chat/completions", body)
            wait_for(lambda: queue()["waiting"] == 1, "the second request to wait")
            r = post(srv, "/v1/chat/completions", body)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_error"
        for f in (first, second):
            assert f.result(TIMEOUT).json()["choices"][0]["message"]["content"] == expected
        assert queue() == {"running": 0, "waiting": 0, "max_queue": 1}


def test_api_key(tiny_engine):
    with BackgroundServer(tiny_engine, api_key="sekret") as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.get(srv.url + "/v1/models", headers=headers, timeout=TIMEOUT)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics", timeout=TIMEOUT).status_code == 401
        assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200  # liveness stays open
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=TIMEOUT)
        assert ok.chat.completions.create(model="m", messages=HELLO, max_tokens=4).choices[0].finish_reason
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]\w*="[^"\\\n]*"(,[a-zA-Z_]\w*="[^"\\\n]*")*\})? '
    r"(-?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?|NaN|[+-]Inf)$"
)


def test_metrics_in_prometheus_text_format(server, client):
    client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, extra_body={"tau": 0.5})
    r = httpx.get(server.url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert r.text.endswith("\n")
    types, values = {}, {}
    for line in r.text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge") and name not in types
            types[name] = kind
            continue
        m = SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        assert m.group(1) in types, f"{m.group(1)} has no TYPE line before it"
        values[m.group(1) + (m.group(2) or "")] = float(m.group(4))
    assert all(name.endswith("_total") for name, kind in types.items() if kind == "counter")
    assert values["fsd_completion_tokens_total"] >= 8 and values["fsd_drafted_tokens_total"] > 0
    assert values['fsd_accepted_tokens_total{reason="sd"}'] + values['fsd_accepted_tokens_total{reason="fuzzy"}'] > 0
    # label order carries no meaning in Prometheus; prometheus_client writes them sorted by name
    assert values['fsd_http_responses_total{code="200",path="/v1/chat/completions"}'] >= 1
    assert 0 < values["fsd_acceptance_ratio"] <= 1 and values["fsd_tokens_per_second"] > 0


# ---------------------------------------------------------------------------------------------- the command
def test_fsd_local_serve_command(tiny_pair):
    d, t = tiny_pair
    proc, url = start_serve(d, t, "--api-key", "k", "--max-queue", "3", "--tau", "0.25", "--parallel", "2")
    try:

        def up():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "fsd-local serve to listen")
        h = httpx.get(url + "/health", timeout=TIMEOUT).json()
        assert h["queue"]["max_queue"] == 3 and [s["state"] for s in h["slots"]] == ["idle", "idle"]
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        r = c.completions.create(model=os.path.basename(t), prompt="abc", max_tokens=5)
        assert r.model_extra["fsd"]["settings"]["tau"] == 0.25  # the command's options are the defaults
        assert r.usage.completion_tokens == 5
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 130, out  # Ctrl-C: a clean shutdown, then the conventional exit code
    assert "serving the OpenAI API on" in out and "Application shutdown complete" in out
    assert "2 requests at once (--parallel), 3 more may wait (--max-queue)" in out


def test_the_default_slots_follow_the_context():
    from fsd_local.server.worker import default_parallel

    assert [default_parallel(n) for n in (256, 1024, 2048, 3072, 4096, 32768)] == [1, 1, 2, 3, 4, 4]
