"""The chat page: what the server gives it (the page, /v1/fsd/settings, the fsd_delta field of streamed chunks),
`fsd-local chat --web`, and the page itself in a real browser (Debian's chromium, headless, via selenium and
chromium-driver) against `fsd-local serve` on the demo pair. The browser tests skip, saying why, where no
browser is installed (`apt-get install -y chromium chromium-driver`; .ci/run does it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fsd_local import Engine
from fsd_local.server import BackgroundServer
from fsd_local.settings import CHAT_DEFAULTS, FIELDS, spec
from support.serving import ctrl_c_on, start_serve

TIMEOUT = 30  # seconds; every wait below is bounded
HELLO = [{"role": "user", "content": "hello there"}]
BROWSER_FLAGS = (  # headless, and nothing a test does not need (no network of its own, no first-run pages)
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
)


def stream_chunks(url, body, headers=None):
    """The parsed chunks of one streamed chat completion (raw HTTP: the extension fields as sent)."""
    chunks = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ---------------------------------------------------------------------------------------------- the server side
def test_the_page_ships_in_the_package():
    """A non-editable install has the page: pyproject's package-data covers every static file."""
    import fnmatch
    from pathlib import Path

    from fsd_local.pairs.registry import tomllib  # tomllib, or tomli before Python 3.11
    from fsd_local.server.web import STATIC

    package = STATIC.parent.parent
    patterns = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = [p.relative_to(package).as_posix() for p in Path(STATIC).iterdir()]
    assert {"server/static/index.html", "server/static/app.js", "server/static/style.css"} <= set(files)
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns["fsd_local"]), f


def test_page_and_its_files_are_served(server):
    page = httpx.get(server.url + "/", timeout=TIMEOUT)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/app.js"' in page.text and "/static/style.css" in page.text
    assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing from elsewhere (works offline)
    js = httpx.get(server.url + "/static/app.js", timeout=TIMEOUT)
    assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "fsd_delta" in js.text
    assert httpx.get(server.url + "/static/style.css", timeout=TIMEOUT).headers["content-type"].startswith("text/css")
    for bad in ("/static/web.py", "/static/..%2Fapp.py", "/static/nothing.js"):
        r = httpx.get(server.url + bad, timeout=TIMEOUT)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", bad
    # the API the page uses is unchanged
    assert httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"] == "tiny-pair"
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"


def test_settings_endpoint_is_generated_from_the_declarations(tiny_engine, server):
    info = httpx.get(server.url + "/v1/fsd/settings", timeout=TIMEOUT).json()
    assert info["model"] == "tiny-pair" and info["has_draft"] is True
    by_name = {d["name"]: d for d in info["settings"]}
    assert set(by_name) == {f.name for f in FIELDS if spec(f).http}  # every request field, nothing else
    for f in FIELDS:
        if f.name in by_name:
            d, s = by_name[f.name], spec(f)
            assert (d["min"], d["max"], d["help"]) == (s.lo, s.hi, s.help)
            assert d["default"] == tiny_engine.defaults.to_dict()[f.name]
            assert d["choices"] == (list(s.choices) if s.choices else None)
    assert by_name["tau"]["type"] == "number" and by_name["max_tokens"]["type"] == "integer"
    assert "fsd" in by_name["mode"]["choices"] and "model" in by_name["drafter"]["choices"]
    # the page starts with chat's sampling (temperature 0.8, top-k 40, ...), not the API's greedy defaults
    assert {d["name"]: d["start"] for d in info["settings"] if "start" in d} == CHAT_DEFAULTS
    assert by_name["temperature"]["default"] == 0.0 and by_name["temperature"]["start"] == 0.8


def test_the_page_starts_from_the_servers_own_sampling_values(tiny_pair):
    """A server started with its own --temp keeps it on the page; the settings left at the API's defaults start
    at chat's."""
    from fsd_local import Engine

    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=256, n_threads=1, temperature=0.3) as eng, BackgroundServer(eng) as srv:
        info = httpx.get(srv.url + "/v1/fsd/settings", timeout=TIMEOUT).json()
    start = {d["name"]: d["start"] for d in info["settings"] if "start" in d}
    assert start == {**CHAT_DEFAULTS, "temperature": 0.3}


def test_settings_endpoint_needs_the_api_key_when_one_is_set(tiny_engine):
    with BackgroundServer(tiny_engine, api_key="sesame") as srv:
        assert httpx.get(srv.url + "/v1/fsd/settings", timeout=TIMEOUT).status_code == 401
        ok = httpx.get(srv.url + "/v1/fsd/settings", headers={"Authorization": "Bearer sesame"}, timeout=TIMEOUT)
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/", timeout=TIMEOUT).status_code == 200  # the page itself is public


def test_streamed_chunks_carry_each_token_with_its_origin(tiny_engine, server):
    tau = 0.6  # generous: the tiny pair's random models then disagree, and tau rescues some tokens
    expected = tiny_engine.chat(HELLO, max_tokens=48, tau=tau)
    chunks = stream_chunks(server.url, {"messages": HELLO, "max_tokens": 48, "tau": tau})
    deltas = [c["fsd_delta"] for c in chunks if "fsd_delta" in c]
    tokens = [t for d in deltas for t in d["tokens"]]
    assert [t["id"] for t in tokens] == expected.token_ids
    assert [t["origin"] for t in tokens] == expected.origins
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == expected.text and "".join(t["text"] for t in tokens).startswith(content)
    stats = chunks[-1]["fsd"]
    assert sum(d["drafted"] for d in deltas) == stats["drafted"]
    fuzzy = [t for t in tokens if t["origin"] == "fuzzy"]
    assert len(fuzzy) == stats["accepted_fuzzy"] > 0
    for t in fuzzy:
        # greedy: a rescued token is not the target's choice, so the target prefers its own top token
        assert 0 <= t["divergence"] <= tau and t["logprob_gap"] > 0
    assert all("divergence" not in t and "logprob_gap" not in t for t in tokens if t["origin"] != "fuzzy")


def test_a_rescued_tokens_numbers_are_the_targets(tiny_engine, server):
    """The gap is log p_target(top) - log p_target(token), recomputed here from the target's logits."""
    import numpy as np

    chunks = stream_chunks(server.url, {"messages": HELLO, "max_tokens": 32, "tau": 0.6})
    tokens = [t for c in chunks if "fsd_delta" in c for t in c["fsd_delta"]["tokens"]]
    i = next(i for i, t in enumerate(tokens) if t["origin"] == "fuzzy")
    prefix = tiny_engine.chat_prompt(HELLO) + [t["id"] for t in tokens[:i]]
    with tiny_engine._lock:
        tiny_engine.target.clear()
        tiny_engine.target.decode(prefix, "last")
        row = tiny_engine.target.logits(1)[0, : tiny_engine.n_vocab].astype(np.float64)
        tiny_engine.target.clear()
    # a single-row decode here, a batch of rows in the round: quantised kernels differ by about 1e-3
    assert tokens[i]["logprob_gap"] == pytest.approx(row.max() - row[tokens[i]["id"]], abs=0.02)
    assert row.argmax() != tokens[i]["id"]  # greedy: a rescued token is never the target's own choice


def test_chat_web_serves_the_page_and_opens_the_browser(tiny_pair, tmp_path):
    """`fsd-local chat --web`: a free loopback port, the page handed to Python's webbrowser (here a script
    named by $BROWSER that records the address), the API behind it; Ctrl-C stops it."""
    d, t = tiny_pair
    opened = tmp_path / "opened.txt"
    recorder = tmp_path / "browser.py"
    recorder.write_text(f"import sys\nopen({str(opened)!r}, 'w').write(sys.argv[1])\n")
    env = {**os.environ, "BROWSER": f"{sys.executable} {recorder} %s", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fsd_local.cli", "chat", "--web", "--target", t, "--draft", d]
    cmd += ["--ctx", "256", "--threads", "1", "--tau", "0.3"]
    proc = subprocess.Popen(
        cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=ctrl_c_on
    )
    try:
        deadline = time.monotonic() + 60
        while not (opened.exists() and opened.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        url = opened.read_text()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        assert "/static/app.js" in httpx.get(url, timeout=TIMEOUT).text
        info = httpx.get(url + "v1/fsd/settings", timeout=TIMEOUT).json()
        assert {s["name"]: s["default"] for s in info["settings"]}["tau"] == 0.3  # chat's options are the defaults
        chunks = stream_chunks(url.rstrip("/"), {"messages": HELLO, "max_tokens": 8})
        assert chunks[-1]["fsd"]["tokens"] == 8
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert "the chat page is at http://127.0.0.1:" in out and proc.returncode == 130, out


def test_chat_web_refuses_the_terminal_only_options():
    from click.testing import CliRunner

    from fsd_local.cli import cli

    r = CliRunner().invoke(cli, ["chat", "--web", "--json"])
    assert r.exit_code == 2 and "--web opens the chat page" in r.output


# ---------------------------------------------------------------------------------------------- in a browser
def _browser(tmp_path, width=1280, height=900):
    """Headless Debian chromium through chromium-driver from PATH; selenium's manager never downloads anything."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install 'fsd-local[test]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip(
            "no browser: install Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
        )
    os.environ["SE_AVOID_STATS"] = "true"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in BROWSER_FLAGS + (f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def _wait(predicate, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _text(browser, element_id):
    return browser.find_element("id", element_id).text


def _set_slider(browser, name, value):
    browser.execute_script(
        "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
        "s.dispatchEvent(new Event('input', {bubbles: true}));",
        "set-" + name,
        value,
    )


def _send(browser, text):
    """Type a message and press Enter; returns once its reply has finished."""
    before = len(browser.find_elements("css selector", ".msg.assistant"))
    browser.find_element("id", "input").send_keys(text + "\n")
    _wait(lambda: len(browser.find_elements("css selector", ".msg.assistant")) > before, "the reply to start")
    _wait(lambda: _text(browser, "stats-state").startswith(("finished", "failed")), "the reply to finish", 120)
    assert _text(browser, "stats-state").startswith("finished"), _text(browser, "error")
    return browser.find_elements("css selector", ".msg.assistant")[-1]


def _unnamed_controls(browser):
    return browser.execute_script(
        "return [...document.querySelectorAll('button, input, select, textarea')]"
        ".filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')).map(e => e.outerHTML);"
    )


@pytest.mark.real
def test_the_page_in_a_browser_on_the_demo_pair(real_pair, tmp_path):
    browser = _browser(tmp_path)  # skips before starting the server when there is no browser
    d, t = real_pair
    # a fixed k, so that every reply drafts (auto may decode plainly on a fast CPU, and the page has nothing to colour)
    proc, url = start_serve(d, t, "--ctx", "1024", "--max-tokens", "48", "--draft-policy", "fixed", "--draft-max", "4")
    try:
        _wait(lambda: proc.poll() is not None or _up(url), "fsd-local serve to listen", 120)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        browser.get(url + "/")
        _wait(lambda: browser.find_elements("id", "set-tau"), "the controls, built from /v1/fsd/settings")
        tau_label = browser.find_element("css selector", "label[for='set-tau']").text
        assert tau_label.split()[0] == "tau"
        for name in ("mode", "drafter", "draft_policy"):
            assert browser.find_element("id", "set-" + name).tag_name == "select"
        assert not _unnamed_controls(browser)

        _check_the_input_box(browser)
        _check_a_reply_at_tau(browser, tmp_path)
        _check_tau_0_regenerate_stop_and_new(browser)
        _check_the_phone_width(browser, tmp_path)
    finally:
        browser.quit()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=TIMEOUT)


def _check_the_input_box(browser):
    # Shift+Enter adds a line and sends nothing
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element("id", "input")
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second line")
    assert browser.execute_script("return document.getElementById('input').value") == "first line\nsecond line"
    assert not browser.find_elements("css selector", ".msg")
    box.clear()


def _check_a_reply_at_tau(browser, tmp_path):
    _set_slider(browser, "tau", 0.5)
    reply = _send(browser, "Name three colours and say why you like them.")
    origins = [s.get_attribute("data-origin") for s in reply.find_elements("css selector", ".tok")]
    assert set(origins) <= {"target", "sd", "fuzzy"} and "sd" in origins and "fuzzy" in origins
    colours = {
        o: browser.execute_script("return getComputedStyle(arguments[0]).backgroundColor", span)
        for o, span in ((s.get_attribute("data-origin"), s) for s in reply.find_elements("css selector", ".tok"))
    }
    assert len(set(colours.values())) == 3  # target, sd and fuzzy look different
    assert "tau 0.5" in reply.find_element("css selector", ".meta").text
    assert float(_text(browser, "stat-tps")) > 0 and _text(browser, "stat-fuzzy").endswith("%")
    assert int(_text(browser, "stat-tokens")) > 0
    assert browser.find_elements("css selector", "#chart rect.bar")  # acceptance by draft position

    # hovering a rescued token shows its divergence and log-probability gap
    from selenium.webdriver import ActionChains

    rescued = reply.find_element("css selector", ".tok[data-origin='fuzzy']")
    ActionChains(browser).move_to_element(rescued).perform()
    tip = _wait(lambda: _text(browser, "tip"), "the tooltip")
    assert "divergence" in tip and "log-prob gap" in tip
    assert float(rescued.get_attribute("data-divergence")) <= 0.5
    assert float(rescued.get_attribute("data-logprob-gap")) >= 0
    browser.save_screenshot(str(tmp_path / "chat-page.png"))


def _check_tau_0_regenerate_stop_and_new(browser):
    # tau 0: lossless speculative decoding, nothing is rescued
    _set_slider(browser, "tau", 0)
    reply = _send(browser, "And three animals?")
    origins = [s.get_attribute("data-origin") for s in reply.find_elements("css selector", ".tok")]
    assert "fuzzy" not in origins and "sd" in origins
    assert "tau 0" in reply.find_element("css selector", ".meta").text and _text(browser, "stat-fuzzy") == "0%"

    # regenerate replaces the last reply; stop ends a reply early; new conversation empties the page
    browser.find_element("id", "regenerate").click()
    _wait(lambda: _text(browser, "stats-state").startswith("finished"), "the regenerated reply", 120)
    assert len(browser.find_elements("css selector", ".msg.assistant")) == 2
    browser.execute_script(
        "const m = document.getElementById('set-max_tokens'); m.value = 400;"
        "m.dispatchEvent(new Event('change', {bubbles: true}));"
    )
    browser.find_element("id", "input").send_keys("Tell me a long story about a dragon.\n")
    _wait(lambda: _text(browser, "stats-state") == "streaming…", "tokens to stream")
    browser.find_element("id", "stop").click()
    _wait(lambda: _text(browser, "stats-state") == "stopped", "the reply to stop")
    assert (
        browser.find_elements("css selector", ".msg.assistant")[-1].find_element("css selector", ".meta").text
        == "stopped"
    )
    browser.find_element("id", "new-chat").click()
    assert not browser.find_elements("css selector", ".msg")


def _check_the_phone_width(browser, tmp_path):
    # phone width: one column, nothing wider than the screen, the controls still named and usable
    browser.set_window_size(390, 844)
    reply = _send(browser, "Hi!")
    assert reply.find_elements("css selector", ".tok")
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    assert browser.find_element("id", "send").is_displayed() and not _unnamed_controls(browser)
    browser.save_screenshot(str(tmp_path / "chat-page-phone.png"))
    # where to keep the screenshots (the README's and docs/chat.md's come from here)
    shots = os.environ.get("FSD_WEB_SCREENSHOTS")
    for name in ("chat-page.png", "chat-page-phone.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if shots:
            shutil.copy(tmp_path / name, shots)


def test_the_page_asks_for_the_api_key_and_sends_it(tiny_engine, tmp_path):
    browser = _browser(tmp_path, 800, 700)
    try:
        with BackgroundServer(tiny_engine, api_key="sesame") as srv:
            browser.get(srv.url + "/")
            _wait(lambda: "API key" in _text(browser, "error"), "the page to ask for the key")
            key = browser.find_element("id", "api-key")
            key.send_keys("sesame\t")  # change event: remembered, and the settings are read again
            _wait(lambda: browser.find_elements("id", "set-tau"), "the controls once the key is given")
            assert browser.execute_script("return localStorage.getItem('fsd-local.api-key')") == "sesame"
            reply = _send(browser, "hello")
            assert reply.find_elements("css selector", ".tok[data-origin]")
            browser.refresh()  # remembered: the controls come back without typing it again
            _wait(lambda: browser.find_elements("id", "set-tau"), "the controls after a reload")
    finally:
        browser.quit()


def _up(url):
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_new_setting_appears_on_the_page_by_itself(server, tmp_path):
    """The controls come from the server's declarations: a slider-worthy setting the page has no code for (the
    quality budget, off by default, added to the settings after the page was written) gets its slider with no
    change to the page, and moving it sets tau aside (the budget moves the threshold itself), as moving tau sets
    the budget back to off."""
    browser = _browser(tmp_path, 800, 700)
    try:
        browser.get(server.url + "/")
        _wait(lambda: browser.find_elements("id", "set-tau"), "the controls")
        _wait(lambda: browser.find_elements("id", "set-quality_budget"), "the budget slider")
        budget = browser.find_element("id", "set-quality_budget")
        assert budget.get_attribute("type") == "range" and _text(browser, "set-quality_budget-value") == "off"
        assert browser.find_element("css selector", "label[for='set-quality_budget']").text.startswith("quality budget")
        # nothing moved: chat's sampling defaults, everything else the server's
        assert browser.execute_script("return requestSettings()") == CHAT_DEFAULTS
        assert browser.find_element("id", "set-temperature").get_attribute("value") == "0.8"
        _set_slider(browser, "quality_budget", 0.2)
        assert browser.execute_script("return requestSettings()") == {**CHAT_DEFAULTS, "quality_budget": 0.2, "tau": 0}
        _set_slider(browser, "tau", 0.3)
        assert browser.execute_script("return requestSettings()") == {**CHAT_DEFAULTS, "tau": 0.3}
        assert _text(browser, "set-quality_budget-value") == "off"
    finally:
        browser.quit()


def test_the_page_shows_the_slots_and_the_queue(tiny_pair, tmp_path):
    """The page's server box lists every slot of a two-slot server, idle, then the one a request holds while the
    batch is paused (its mode and tokens), then idle again."""
    d, t = tiny_pair
    browser = _browser(tmp_path, 800, 900)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "mode": "ar"}
    try:
        with Engine(target=t, draft=d, n_ctx=2048, n_threads=1, parallel=2) as eng, BackgroundServer(eng) as srv:
            browser.get(srv.url + "/")
            idle = "#slots li[data-state='idle']"
            _wait(lambda: len(browser.find_elements("css selector", idle)) == 2, "two idle slots")
            assert _text(browser, "server-state") == "ok" and _text(browser, "queue-waiting") == "0"
            with ThreadPoolExecutor(1) as pool:
                with eng.batch.paused():  # the request holds its slot, its call waiting for the batch
                    reply = pool.submit(httpx.post, srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
                    active = "#slots li[data-state='active']"
                    _wait(lambda: browser.find_elements("css selector", active), "an active slot")
                    assert _text(browser, "slots").startswith("slot 0: ar, 0/8 tokens")
                assert reply.result().status_code == 200
            _wait(lambda: len(browser.find_elements("css selector", idle)) == 2, "the slots idle again")
    finally:
        browser.quit()
