"""`fsd-local serve`'s model process: killed for real (SIGSEGV, SIGKILL) by pid, with real llama.cpp.

The server runs in this process (BackgroundServer.supervised), so its model process is a direct child of
the test: found and checked through /proc, killed with os.kill. The pair is a small F32 one written here,
large enough that a 480-token generation lasts well over a second (so a kill lands mid-generation) and
exact enough that greedy token ids can be compared before and after a restart. To make "mid-stream"
certain, the child is frozen with SIGSTOP the moment the first text arrives, then sent the fatal signal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fsd_local import Engine, ModelOptions, Settings
from fsd_local.server import BackgroundServer
from support.serving import start_serve
from support.tinymodels import write_tiny_gguf

TIMEOUT = 60  # seconds; a restart loads the pair in a fresh interpreter (about 1-3 s on a busy 2-core machine)
SIZE = dict(n_embd=256, n_layer=4, n_head=4, n_ff=1024)  # ~2 ms a token on one thread: 480 tokens > 1 s
LONG = 480  # tokens: the context is 512
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("supervised")
    return (
        str(write_tiny_gguf(d / "draft.gguf", seed=1, noise=0.0, **SIZE)),
        str(write_tiny_gguf(d / "target.gguf", seed=2, noise=0.1, **SIZE)),
    )


def options(path):
    return ModelOptions(path, n_ctx=512, n_threads=1)


# fixed lengths: a random tiny model may emit </s> anywhere; a fixed k: auto picks k from measured time, and the
# batch shapes (so tau 0.2's rescues) would differ between this process and a restarted child
SETTINGS = Settings(ignore_eos=True, tau=0.2, draft_policy="fixed", draft_max=4)


@pytest.fixture(scope="module")
def expected(pair):
    """What the same pair answers in this process, at temperature 0."""
    d, t = pair
    with Engine(target=options(t), draft=options(d), settings=SETTINGS) as eng:
        return {
            "hello": eng.chat(HELLO, max_tokens=16).text,
            **{f"q{i}": eng.chat([{"role": "user", "content": f"question {i}"}], max_tokens=16).text for i in range(3)},
            "ids": eng.generate("abc", max_tokens=24).token_ids,
        }


def supervised(pair, **supervisor_options):
    d, t = pair
    return BackgroundServer.supervised(
        options(t), options(d), SETTINGS, model_name="tiny", supervisor_options=supervisor_options
    )


@pytest.fixture(scope="module")
def server(pair):
    with supervised(pair) as srv:
        yield srv


# ---------------------------------------------------------------------------------------------- helpers
def stat(pid):
    """(state, ppid) from /proc/<pid>/stat, or None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return fields[0], int(fields[1])


def children(of=None, zombie=False):
    """Direct children of this process (or of `of`): the live ones, or the zombies (exited, never reaped)."""
    parent = of or os.getpid()
    out = set()
    for name in os.listdir("/proc"):
        st = stat(int(name)) if name.isdigit() else None
        if st and st[1] == parent and (st[0] == "Z") == zombie:
            out.add(int(name))
    return out


def zombies():
    return children(zombie=True)


def rss_mib():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))


def wait_for(predicate, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def health(srv):
    r = httpx.get(srv.url + "/health", timeout=TIMEOUT)
    assert r.status_code != 503 or int(r.headers["retry-after"]) >= 1  # every 503 says when to retry
    return r.status_code, r.json()


def metric(srv, name_and_labels):
    for line in httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(name_and_labels + " "):
            return float(line.split()[-1])
    return 0.0


def chat(srv, content="hello there", max_tokens=16, timeout=TIMEOUT):
    return httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=timeout,
        json={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens},
    )


def kill_mid_stream(srv, pid, sig):
    """Start a long stream, freeze the child at its first text, kill it with `sig`; return the events after."""
    body = {"model": "m", "messages": HELLO, "max_tokens": LONG, "stream": True}
    events = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        os.kill(pid, signal.SIGSTOP)
        os.kill(pid, sig)
        os.kill(pid, signal.SIGCONT)  # a stopped process acts on a pending SIGSEGV once continued
        events = [line[6:] for line in lines if line.startswith("data: ")]
    return events


def assert_died_error(event, signame):
    err = json.loads(event)["error"]
    assert "model process died" in err["message"] and signame in err["message"], err
    assert err["type"] == "server_error" and err["code"] == "model_process_died"


def wait_restarted(srv, old_pid):
    """/health says 'restarting' (503) until the new child has loaded the models, then 'ok' (200)."""
    sup = srv.app.state.engine
    seen = []

    def ok():
        code, body = health(srv)
        seen.append((code, body["status"]))
        return body["status"] == "ok"

    wait_for(ok, "the model process to come back")
    assert (503, "restarting") in seen, seen
    assert sup.pid != old_pid and stat(sup.pid)[1] == os.getpid()  # the new child, a direct child of ours
    assert stat(old_pid) is None  # the dead one was reaped: no zombie


# ---------------------------------------------------------------------------------------------- crashes
def test_the_model_runs_in_a_direct_child(server, expected):
    sup = server.app.state.engine
    assert stat(sup.pid)[1] == os.getpid() and sup.pid != os.getpid()
    code, body = health(server)
    assert code == 200 and body["status"] == "ok" and body["model_process"]["restarts"] == 0
    assert chat(server).json()["choices"][0]["message"]["content"] == expected["hello"]
    assert sup.generate("abc", max_tokens=24).token_ids == expected["ids"]


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL], ids=lambda s: s.name)
def test_death_mid_stream(server, expected, sig):
    sup = server.app.state.engine
    pid, restarts = sup.pid, metric(server, "fsd_model_restarts_total")
    deaths = metric(server, f'fsd_model_process_deaths_total{{cause="{sig.name}"}}')
    events = kill_mid_stream(server, pid, sig)
    assert events and events[-1] != "[DONE]"  # the stream ends with the error event
    assert_died_error(events[-1], sig.name)
    wait_restarted(server, pid)
    assert metric(server, "fsd_model_restarts_total") == restarts + 1
    assert metric(server, f'fsd_model_process_deaths_total{{cause="{sig.name}"}}') == deaths + 1
    assert sup.generate("abc", max_tokens=24).token_ids == expected["ids"]  # the same tokens as before the crash
    assert chat(server).json()["choices"][0]["message"]["content"] == expected["hello"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=lambda s: s.name)
def test_death_with_requests_waiting(server, expected, sig):
    """The running request gets a 500 naming the signal; the two waiting ones (one streamed) run on the new
    child and get the answers the pair gives in this process."""
    sup = server.app.state.engine
    pid = sup.pid

    def streamed(content):
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 16, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if json.loads(e)["choices"]
        )

    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(chat, server, "question 9", LONG)
        wait_for(lambda: health(server)[1]["queue"]["running"] == 1, "the long request to run")
        os.kill(pid, signal.SIGSTOP)  # it cannot finish before the kill now
        waiting = [pool.submit(chat, server, "question 0"), pool.submit(streamed, "question 1")]
        wait_for(lambda: health(server)[1]["queue"]["waiting"] == 2, "two requests to wait")
        os.kill(pid, sig)
        os.kill(pid, signal.SIGCONT)
        r = running.result(TIMEOUT)
        assert r.status_code == 500
        assert_died_error(r.text, sig.name)
        assert waiting[0].result(TIMEOUT).json()["choices"][0]["message"]["content"] == expected["q0"]
        assert waiting[1].result(TIMEOUT) == expected["q1"]
    assert sup.pid != pid and stat(pid) is None
    assert health(server)[0] == 200


def test_a_disconnect_still_cancels_in_the_child(server, expected):
    sup = server.app.state.engine
    pid = sup.pid
    cancelled = metric(server, 'fsd_generations_total{finish_reason="cancelled"}')
    body = {"model": "m", "messages": HELLO, "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # hang up after the first text
    wait_for(
        lambda: metric(server, 'fsd_generations_total{finish_reason="cancelled"}') == cancelled + 1,
        "the generation to be cancelled in the child",
    )
    assert sup.pid == pid  # a cancel is not a crash
    assert chat(server).json()["choices"][0]["message"]["content"] == expected["hello"]


def test_the_supervisor_as_a_python_object(server, expected):
    """What the server relies on: errors of a generation come back as the same class and the child lives on;
    a stream dropped halfway is cancelled and drained, so the next call starts clean."""
    from fsd_local import ConfigError, ContextOverflowError

    sup = server.app.state.engine
    pid = sup.pid
    with pytest.raises(ConfigError):
        sup.stream("abc", tau=-1)
    with pytest.raises(ContextOverflowError, match="512"):
        sup.generate([5] * 600)  # checked in the child: the server checks this before, a Python caller need not
    stream = sup.stream("abc", max_tokens=LONG)
    assert next(stream).token_ids
    stream.close()
    assert sup.generate("abc", max_tokens=24).token_ids == expected["ids"]
    assert [p.completion.token_ids for p in sup.stream("abc", max_tokens=24) if p.completion] == [expected["ids"]]
    assert sup.pid == pid


def test_twenty_crashes_leave_nothing_behind(server, expected):
    sup = server.app.state.engine
    others = children() - {sup.pid}  # e.g. another server's child
    restarts = metric(server, "fsd_model_restarts_total")
    rss = fds = None
    for i in range(20):
        if i == 2:  # after two cycles everything that is allocated once has been
            rss, fds = rss_mib(), len(os.listdir("/proc/self/fd"))
        sig = (signal.SIGSEGV, signal.SIGKILL)[i % 2]
        pid = sup.pid
        assert_died_error(kill_mid_stream(server, pid, sig)[-1], sig.name)
        wait_for(lambda: health(server)[1]["status"] == "ok" and sup.pid != pid, "the restart")
        assert sup.generate("abc", max_tokens=24).token_ids == expected["ids"]
    assert metric(server, "fsd_model_restarts_total") == restarts + 20
    assert children() - others == {sup.pid} and not zombies()
    assert len(os.listdir("/proc/self/fd")) <= fds + 2
    grown = rss_mib() - rss
    assert grown < 20, f"the server's RSS grew by {grown:.1f} MiB over 18 crashes"


def test_back_off_then_give_up(pair):
    """Children killed as soon as they appear: restarted after growing delays, then no more; the server stays
    up and answers 503 with the reason."""
    others = children()
    with supervised(pair, backoff_s=0.2, max_failures=4) as srv:
        killed, appeared = [], []
        deadline = time.monotonic() + TIMEOUT
        while health(srv)[1]["status"] != "failed":
            assert time.monotonic() < deadline, "the supervisor never gave up"
            for pid in children() - others - set(killed):
                appeared.append(time.monotonic())
                os.kill(pid, signal.SIGSEGV)
                killed.append(pid)
            time.sleep(0.002)
        assert len(killed) == 4  # the first child, then three restarts
        gaps = [b - a for a, b in zip(appeared, appeared[1:])]
        for gap, delay in zip(gaps, (0.0, 0.2, 0.4)):  # 0 after the first death, then 0.2 s doubling
            assert gap >= delay, gaps
        code, body = health(srv)
        assert code == 503 and "4 times in a row" in body["reason"] and "SIGSEGV" in body["reason"]
        r = chat(srv)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
        assert r.headers["retry-after"] == "60"  # every 503 says when to retry; a given-up model: a minute
        assert httpx.get(srv.url + "/health", timeout=TIMEOUT).headers["retry-after"] == "60"
        assert httpx.get(srv.url + "/v1/models", timeout=TIMEOUT).status_code == 200  # still up
        assert metric(srv, 'fsd_model_process_deaths_total{cause="SIGSEGV"}') == 4
        assert metric(srv, "fsd_model_restarts_total") == 3 and metric(srv, "fsd_model_process_up") == 0
        assert children() - others == set()
    assert not zombies()


def test_a_child_that_cannot_start_says_why(pair, tmp_path):
    d, t = pair
    target = shutil.copy(t, tmp_path / "target.gguf")
    with supervised((d, str(target)), backoff_s=0.05, max_failures=2) as srv:
        pid = srv.app.state.engine.pid
        os.rename(target, tmp_path / "moved.gguf")  # the next child fails to load it
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: health(srv)[1]["status"] == "failed", "the supervisor to give up")
        reason = health(srv)[1]["reason"]
        assert "ModelLoadError" in reason and "not found" in reason and "exited with code 1" in reason, reason


def test_fsd_local_serve_restarts_its_child(pair):
    """The command itself: the model process is a direct child of `fsd-local serve`; a SIGKILL costs a restart,
    Ctrl-C ends both."""
    d, t = pair
    proc, url = start_serve(d, t)
    try:

        def status():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(url + "/health", timeout=5).json()["status"]
            except httpx.TransportError:
                return None

        def model_children():
            return list(children(of=proc.pid))

        wait_for(lambda: status() == "ok", "fsd-local serve to listen")
        [child] = model_children()
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: status() == "restarting", "/health to say restarting")
        wait_for(lambda: status() == "ok", "the new model process")
        [new] = model_children()
        assert new != child
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "abc", "max_tokens": 5}, timeout=TIMEOUT)
        assert r.json()["usage"]["completion_tokens"] == 5
        assert re.search(r"^fsd_model_restarts_total 1\.0$", httpx.get(url + "/metrics", timeout=TIMEOUT).text, re.M)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 130, out
    assert "died (killed by SIGKILL)" in out
    assert stat(new) is None  # the model process ended with the server


def test_the_model_process_does_not_outlive_a_killed_server(pair):
    """SIGKILL to the server leaves it no time to stop its child: the child sees its socket close and exits."""
    d, t = pair
    code = (
        "import sys, time; from fsd_local.server.supervisor import Supervisor; "
        "s = Supervisor(sys.argv[1], sys.argv[2]); print(s.pid, flush=True); time.sleep(600)"
    )
    server = subprocess.Popen([sys.executable, "-c", code, t, d], stdout=subprocess.PIPE, text=True)
    try:
        child = int(server.stdout.readline())
        assert stat(child)[1] == server.pid
    finally:
        server.kill()
        server.wait(TIMEOUT)
    wait_for(lambda: stat(child) is None or stat(child)[0] == "Z", "the orphaned model process to exit", 10)
