"""Who may drive the server: crafted raw requests (httpx, every header set by hand) against a real server on the
tiny pair, as a hostile page in a browser would send them. A refused request must not generate anything: the
generations counter of /metrics is read before and after."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from fsd_local.server import BackgroundServer
from fsd_local.server.security import AccessPolicy
from support.serving import start_serve, wait_up

HELLO = [{"role": "user", "content": "hello there"}]
TIMEOUT = 20
EVIL = "https://evil.example"
OPENAI_CHAT = ("/v1/chat/completions", {"model": "m", "messages": HELLO, "max_tokens": 4})
OLLAMA_CHAT = ("/api/chat", {"model": "m", "messages": HELLO, "stream": False, "options": {"num_predict": 4}})


def generations(url):
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("fsd_generations_total{"))


def send(url, method, path, body=None, **headers):
    content = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    return httpx.request(method, url + path, content=content, headers=headers, timeout=TIMEOUT)


def error_text(r, path):
    return r.json()["error"] if path.startswith("/api/") else r.json()["error"]["message"]


@pytest.mark.parametrize("path,body", [OPENAI_CHAT, OLLAMA_CHAT])
def test_a_foreign_host_header_is_refused_before_anything_runs(server, path, body):
    """DNS rebinding: the attacker's domain resolves to 127.0.0.1, the browser sends it as Host."""
    before = generations(server.url)
    r = send(server.url, "POST", path, body, **{"Host": "attacker.example:8080", "Content-Type": "application/json"})
    assert r.status_code == 403
    assert "attacker.example" in error_text(r, path) and "--allow-host" in error_text(r, path)
    assert generations(server.url) == before
    for get in ("/", "/v1/models", "/api/tags", "/v1/fsd/settings"):  # reads too: the page would read the answers
        assert send(server.url, "GET", get, Host="attacker.example").status_code == 403


def test_the_servers_own_names_work(server):
    port = server.url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"LOCALHOST:{port}", f"app.localhost:{port}"):
        assert send(server.url, "GET", "/api/tags", Host=host).status_code == 200, host


@pytest.mark.parametrize("path,body", [OPENAI_CHAT, OLLAMA_CHAT])
def test_a_cross_site_simple_post_is_refused(server, path, body):
    """A page of another site can POST text/plain without asking first (no preflight): refused by its Origin,
    and a body not sent as JSON is refused whoever sends it."""
    before = generations(server.url)
    r = send(server.url, "POST", path, body, **{"Origin": EVIL, "Content-Type": "text/plain"})
    assert r.status_code == 403 and EVIL in error_text(r, path) and "--allow-origin" in error_text(r, path)
    assert "access-control-allow-origin" not in r.headers
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": kind} if kind else {}
        r = send(server.url, "POST", path, body, **headers)
        assert r.status_code == 415 and "application/json" in error_text(r, path), kind
    assert generations(server.url) == before
    r = send(server.url, "POST", path, body, **{"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_a_foreign_preflight_is_refused(server):
    r = send(
        server.url,
        "OPTIONS",
        "/api/chat",
        Origin=EVIL,
        **{"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
    )
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_the_pages_own_origin_always_works(server):
    before = generations(server.url)
    for path, body in (OPENAI_CHAT, OLLAMA_CHAT):
        r = send(server.url, "POST", path, body, **{"Origin": server.url, "Content-Type": "application/json"})
        assert r.status_code == 200, r.text
    assert generations(server.url) == before + 2
    assert send(server.url, "GET", "/v1/fsd/settings", Origin=server.url).status_code == 200


def test_listed_origins_get_cors(tiny_engine):
    origins = ["http://localhost:3000", "chrome-extension://*"]
    with BackgroundServer(tiny_engine, allow_origins=origins) as srv:
        for origin in ("http://localhost:3000", "chrome-extension://abcdef"):
            pre = send(
                srv.url,
                "OPTIONS",
                "/api/chat",
                Origin=origin,
                **{
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization,content-type",
                },
            )
            assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == origin
            assert "POST" in pre.headers["access-control-allow-methods"]
            assert pre.headers["access-control-allow-headers"] == "authorization,content-type"
            path, body = OLLAMA_CHAT
            r = send(srv.url, "POST", path, body, **{"Origin": origin, "Content-Type": "application/json"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            assert r.headers["vary"] == "Origin"
        assert send(srv.url, "GET", "/api/tags", Origin="http://localhost:3001").status_code == 403


def test_the_policy_by_address():
    loopback = AccessPolicy("127.0.0.1")
    assert loopback.host_allowed("127.0.0.1:8080") and loopback.host_allowed("[::1]:8080")
    assert loopback.host_allowed("127.0.0.2") and loopback.host_allowed(None)  # no Host: HTTP/1.0, not a browser
    assert not loopback.host_allowed("192.168.1.10:8080") and not loopback.host_allowed("localhost.evil.example")
    lan = AccessPolicy("192.168.1.10", allow_hosts=["*.home.arpa"])
    assert lan.host_allowed("192.168.1.10:8080") and lan.host_allowed("box.home.arpa")
    assert not lan.host_allowed("10.0.0.1") and not lan.host_allowed("evil.example")
    everywhere = AccessPolicy("0.0.0.0")
    assert everywhere.host_allowed("10.1.2.3:8080") and everywhere.host_allowed("[fe80::1]:8080")
    assert not everywhere.host_allowed("rebound.evil.example")  # a name still has to be listed
    assert AccessPolicy("127.0.0.1", allow_hosts=["*"]).host_allowed("behind.a.proxy")
    assert loopback.origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080")
    assert not loopback.origin_allowed("http://127.0.0.1:9999", "127.0.0.1:8080")  # another local page
    assert not loopback.origin_allowed("null", "127.0.0.1:8080")
    assert AccessPolicy(allow_origins=["*"]).origin_allowed(EVIL, "127.0.0.1:8080")


def test_fsd_local_serve_takes_the_options_and_the_environment(tiny_pair, monkeypatch):
    d, t = tiny_pair
    monkeypatch.setenv("FSD_LOCAL_ORIGINS", "http://from-env.example, http://other.example")
    proc, url = start_serve(d, t, "--allow-origin", "http://from-flag.example", "--allow-host", "box.lan")
    try:
        wait_up(proc, url, 60)
        for origin, status in (
            ("http://from-flag.example", 200),
            ("http://from-env.example", 200),
            ("http://other.example", 200),
            (EVIL, 403),
        ):
            assert send(url, "GET", "/api/tags", Origin=origin).status_code == status, origin
        assert send(url, "GET", "/api/tags", Host="box.lan:1234").status_code == 200
        assert send(url, "GET", "/api/tags", Host="attacker.example").status_code == 403
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=TIMEOUT)
