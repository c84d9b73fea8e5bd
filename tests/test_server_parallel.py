"""`fsd-local serve --parallel`: several requests at once through one supervised model process, through the
`openai` and `ollama` clients on tiny F32 pairs (greedy: each answer's text equals the same request alone).

Every request is made to wait where it can be seen: the model process is frozen with SIGSTOP before the requests
are sent, so /health shows every slot active and the queue full, and an extra request gets 503, whatever the
host's load; SIGCONT lets them all run together. Nothing is timed."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import ollama
import openai
import pytest

from fsd_local import Engine, ModelOptions, Settings
from fsd_local.server import BackgroundServer
from fsd_local.settings import CHAT_DEFAULTS
from support.tinymodels import write_tiny_gguf

TIMEOUT = 60
SETTINGS = Settings(ignore_eos=True, tau=0.2, draft_policy="fixed", draft_max=4, temperature=0.0)
PROMPTS = ["the cat sat", "a dog ran far", "once upon a time", "hello there my", "green leaves fall", "why is it"]
MODES = ["ar", "sd", "fsd", "ar", "fsd", "sd"]
TOKENS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    return str(write_tiny_gguf(d / "draft.gguf", seed=1)), str(write_tiny_gguf(d / "target.gguf", seed=2, noise=0.1))


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def alone(pair):
    """Each prompt's reply in its mode, one call at a time on an Engine of this process."""
    d, t = pair
    with Engine(target=ModelOptions(t, n_ctx=512, n_threads=1), draft=ModelOptions(d, n_ctx=512, n_threads=1)) as eng:
        return [eng.chat(chat(p), settings=SETTINGS, mode=m, max_tokens=TOKENS).text for p, m in zip(PROMPTS, MODES)]


@pytest.fixture(scope="module")
def server(pair):
    d, t = pair
    opts = {"parallel": 4}
    with BackgroundServer.supervised(
        ModelOptions(t, n_ctx=2048, n_threads=1),
        ModelOptions(d, n_ctx=2048, n_threads=1),
        SETTINGS,
        model_name="tiny",
        max_queue=2,
        supervisor_options=opts,
    ) as srv:
        yield srv


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=TIMEOUT).json()


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def idle(srv) -> None:
    wait_for(lambda: all(s["state"] == "idle" for s in health(srv)["slots"]), "every slot idle")


def openai_text(srv, i: int, out: list, close_after: int | None = None) -> None:
    """Request i streamed through the openai client; its text (or, closed early, what came) into out[i]."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    try:
        stream = client.chat.completions.create(
            model="tiny", messages=chat(PROMPTS[i]), max_tokens=TOKENS, stream=True, extra_body={"mode": MODES[i]}
        )
        text, n = "", 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                n += 1
                if n == close_after:
                    stream.close()
                    break
        out[i] = text
    except Exception as exc:  # the test thread's error, asserted by the test
        out[i] = exc


def frozen(srv):
    """The model process stopped (SIGSTOP) until the block ends."""
    pid = srv.app.state.engine.pid

    class Frozen:
        def __enter__(self):
            os.kill(pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            os.kill(pid, signal.SIGCONT)

    return Frozen()


def test_four_at_once_two_waiting_then_503_each_answer_as_alone(server, alone):
    out: list = [None] * 6
    threads = [threading.Thread(target=openai_text, args=(server, i, out)) for i in range(6)]
    with frozen(server):
        for t in threads[:4]:
            t.start()
        wait_for(lambda: sum(s["state"] == "active" for s in health(server)["slots"]) == 4, "four active slots")
        for t in threads[4:]:
            t.start()
        wait_for(lambda: health(server)["queue"]["waiting"] == 2, "two requests waiting")
        h = health(server)
        assert [s["id"] for s in h["slots"]] == [0, 1, 2, 3]
        assert sorted(s["request"]["mode"] for s in h["slots"]) == sorted(MODES[:4])
        assert all(s["request"]["stream"] and s["request"]["path"] == "/v1/chat/completions" for s in h["slots"])
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": chat("x")}, timeout=TIMEOUT)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        ps = httpx.get(server.url + "/api/ps", timeout=TIMEOUT).json()["models"][0]["fsd"]
        assert ps["waiting"] == 2 and [s["state"] for s in ps["slots"]] == ["active"] * 4
        metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
        assert 'fsd_slots{state="active"} 4.0' in metrics and 'fsd_slots{state="idle"} 0.0' in metrics
    for t in threads:
        t.join(TIMEOUT)
    assert out == alone
    idle(server)


def test_a_cancelled_stream_leaves_the_others_as_alone(server, alone):
    out: list = [None] * 4
    threads = [threading.Thread(target=openai_text, args=(server, i, out, 3 if i == 1 else None)) for i in range(4)]
    with frozen(server):
        for t in threads:
            t.start()
        wait_for(lambda: sum(s["state"] == "active" for s in health(server)["slots"]) == 4, "four active slots")
    for t in threads:
        t.join(TIMEOUT)
    assert [out[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert alone[1].startswith(out[1]) and out[1] != alone[1]
    idle(server)


def test_ollama_clients_at_once_with_a_bad_prompt(server, alone):
    """Three ollama streams and a call whose prompt ids the model process refuses: the refused call's error is
    its own, the streams answer as alone."""
    sup = server.app.state.engine
    out: list = [None] * 5

    def stream(i):
        c = ollama.Client(host=server.url, timeout=TIMEOUT)
        opts = {k: getattr(SETTINGS, k) for k in CHAT_DEFAULTS}  # the server's settings, not chat's sampling
        opts.update(num_predict=TOKENS, mode=MODES[i])
        out[i] = "".join(
            p.message.content for p in c.chat(model="tiny", messages=chat(PROMPTS[i]), options=opts, stream=True)
        )

    def bad():
        try:
            sup.generate([sup.n_vocab + 5], max_tokens=4)
        except Exception as exc:
            out[4] = exc

    threads = [
        threading.Thread(target=f, args=a) for f, a in [(stream, (0,)), (stream, (1,)), (stream, (2,)), (bad, ())]
    ]
    with frozen(server):
        for t in threads:
            t.start()
        time.sleep(0.2)  # any order works: this only lets them queue up against the frozen process
    for t in threads:
        t.join(TIMEOUT)
    assert out[:3] == alone[:3]
    assert type(out[4]).__name__ == "ConfigError" and "outside the vocabulary" in str(out[4])
    assert health(server)["status"] == "ok"
    idle(server)


def test_a_crash_fails_every_call_in_flight_and_the_next_ones_run(server, alone):
    sup = server.app.state.engine
    old = sup.pid
    out: list = [None] * 3
    threads = [threading.Thread(target=openai_text, args=(server, i, out)) for i in range(3)]
    os.kill(old, signal.SIGSTOP)  # the three calls sent, none answered: then the process dies under them
    for t in threads:
        t.start()
    wait_for(lambda: sum(s["state"] == "active" for s in health(server)["slots"]) == 3, "three active slots")
    os.kill(old, signal.SIGKILL)
    for t in threads:
        t.join(TIMEOUT)
    for r in out:  # the openai client raises the stream's error object
        assert isinstance(r, openai.APIError) and "model process died" in str(r) and "SIGKILL" in str(r), r
    wait_for(lambda: health(server)["status"] == "ok" and sup.pid != old, "the model process back")
    again: list = [None] * 2
    threads = [threading.Thread(target=openai_text, args=(server, i, again)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert again == alone[:2]
