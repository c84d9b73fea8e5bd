"""A target given without a draft: chat, generate, serve and bench pick the best ranked local model that can
draft for it (said on stderr), else draft by prompt lookup with a note on what to pull; --draft none decodes with the
target alone. The stores are laid out by the tests (tests/support/localstores.py) from tiny models."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fsd_local.pairs.names import choose_draft
from fsd_local.pairs.ranking import ACCEPT_SAME, expected_speedup
from support.clirun import invoke
from support.localstores import isolate, lmstudio_file, ollama_model
from support.tinymodels import write_tiny_gguf

RUN = ["--threads", "1", "--ctx", "256", "--max-tokens", "6", "--draft-policy", "fixed", "--draft-max", "2"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    d = tmp_path_factory.mktemp("family")
    return {
        "other": write_tiny_gguf(d / "other.gguf", n_layer=1, n_embd=32, byte_tokens=False),  # smallest, foreign
        "small": write_tiny_gguf(d / "small.gguf", n_layer=1, n_embd=32),
        "medium": write_tiny_gguf(d / "medium.gguf", n_layer=2, n_embd=64),
        "big": write_tiny_gguf(d / "big.gguf", n_layer=3, n_embd=96),
    }


@pytest.fixture
def stores(tmp_path, monkeypatch, family):
    s = isolate(monkeypatch, tmp_path)
    ollama_model(s["ollama"], "tiny:big", family["big"])
    ollama_model(s["ollama"], "tiny:medium", family["medium"])
    ollama_model(s["ollama"], "odd:tiny", family["other"])
    lmstudio_file(s["lmstudio"], "acme", "Tiny-GGUF", family["small"], filename="tiny-small.gguf")
    return s


def chosen(family) -> str:
    """The note for tiny-small chosen for tiny:big: the best of the two of its tokenizer (odd:tiny, another
    vocabulary without byte fallback, cannot draft), with the speed-up the cost model expects at their sizes."""
    ratio = family["small"].stat().st_size / family["big"].stat().st_size
    return (
        "draft: acme/Tiny-GGUF/tiny-small.gguf [LM Studio, 148 kB, f32; "
        f"~{expected_speedup(ACCEPT_SAME, ratio):.2f}x expected] chosen for tiny:big: the best of 2 local drafts. "
        "Another: --draft NAME or PATH (`fsd-local models --local` ranks them); plain decoding: --draft none"
    )


def test_the_smallest_compatible_model_drafts(stores, family):
    result = invoke(["generate", "abcabc", "--target", "tiny:big", *RUN, "--json"])
    assert result.exit_code == 0, result.output
    assert chosen(family) in result.stderr  # odd:tiny is smaller but has another vocabulary; tiny:medium is larger
    out = json.loads(result.stdout)
    assert out["settings"]["drafter"] == "model" and out["stats"]["drafted"] > 0


def test_choose_draft_returns_the_file_it_names(stores, family):
    from fsd_local.pairs.names import resolve

    choice = choose_draft(resolve("tiny:big", "target"))
    assert choice.draft is not None and choice.candidates == 2
    assert choice.draft.path == str(stores["lmstudio"] / "acme" / "Tiny-GGUF" / "tiny-small.gguf")
    assert choice.target.name == "tiny:big"


def test_chat_with_a_target_alone_says_which_draft(stores, family):
    result = invoke(["chat", "--target", "tiny:big", *RUN, "--json"], input="hello\n")
    assert result.exit_code == 0, result.output
    assert chosen(family) in result.stderr and json.loads(result.stdout.splitlines()[-1])["stats"]["drafted"] > 0


def test_no_compatible_model_falls_back_to_prompt_lookup(tmp_path, monkeypatch, family):
    s = isolate(monkeypatch, tmp_path)
    ollama_model(s["ollama"], "tiny:big", family["big"])
    ollama_model(s["ollama"], "odd:tiny", family["other"])
    result = invoke(["generate", "abcabcabc", "--target", "tiny:big", *RUN, "--json"])
    assert result.exit_code == 0, result.output
    note = [ln for ln in result.stderr.splitlines() if ln.startswith("no model on this disk")]
    assert note == [
        "no model on this disk can draft for tiny:big (same vocabulary, smaller; searched: Ollama, Hugging Face "
        "cache, LM Studio, llama.cpp cache, the target's folder). Pull a smaller model of the same family (same "
        "tokenizer: e.g. `ollama pull` a smaller size, or `fsd-local models` for curated pairs) and it is picked "
        "automatically. Meanwhile prompt lookup drafts (--drafter ngram)."
    ]
    assert json.loads(result.stdout)["settings"]["drafter"] == "ngram"


def test_draft_none_is_plain_decoding(stores):
    result = invoke(["generate", "abc", "--target", "tiny:big", "--draft", "none", *RUN, "--json"])
    assert result.exit_code == 0, result.output
    assert "--draft none: plain decoding, the target alone (mode ar)" in result.stderr
    assert "chosen for" not in result.stderr
    out = json.loads(result.stdout)
    assert out["settings"]["mode"] == "ar" and out["stats"]["drafted"] == 0
    refused = invoke(["generate", "abc", "--target", "tiny:big", "--draft", "none", "--mode", "sd", *RUN])
    assert refused.exit_code == 2 and "--draft none gives none: add --drafter ngram" in refused.output


def test_a_draft_next_to_a_target_path_is_found(tmp_path, monkeypatch, family):
    isolate(monkeypatch, tmp_path)  # empty stores
    folder = tmp_path / "my-models"
    folder.mkdir()
    for k in ("big", "small"):
        (folder / f"{k}.gguf").write_bytes(family[k].read_bytes())
    result = invoke(["generate", "abc", "--target", str(folder / "big.gguf"), *RUN, "--json"])
    assert result.exit_code == 0, result.output
    assert f"draft: {folder / 'small.gguf'} [the target's folder, 148 kB, f32; ~" in result.stderr
    assert f"x expected] chosen for {folder / 'big.gguf'}: the one local draft." in result.stderr


def test_a_name_that_matches_nothing_says_where_it_looked(stores):
    result = invoke(["chat", "--target", "qwen2.5:7b", *RUN], input="hi\n")
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output
    assert errors[0].startswith("error: target 'qwen2.5:7b' is not a file, and no model of that name is on this disk")
    assert f"Ollama {stores['ollama']} (found)" in errors[0] and f"LM Studio {stores['lmstudio']} (found)" in errors[0]
    assert f"llama.cpp cache {stores['llama.cpp']} (not found)" in errors[0]


def test_a_missing_target_path_alone_is_reported_as_missing(stores, tmp_path):
    result = invoke(["generate", "abc", "--target", str(tmp_path / "nope.gguf"), *RUN])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: target model file not found: {tmp_path / 'nope.gguf'} (check the path, or `fsd-local pull` a pair)"
    )


def test_bench_with_a_target_alone(stores, family):
    args = ["--threads", "1", "--ctx", "256", "--max-tokens", "4", "--repeats", "1", "--taus", "0.1"]
    bench = invoke(["bench", "--target", "tiny:big", "--modes", "fsd", "--draft-policy", "fixed", *args, "--json"])
    assert bench.exit_code == 0, bench.output
    assert chosen(family) in bench.stderr
    rows = json.loads(bench.stdout[bench.stdout.index("[") :])
    assert {r["drafter"] for r in rows if r["mode"] != "ar"} == {"model"}
    (stores["lmstudio"] / "acme" / "Tiny-GGUF" / "tiny-small.gguf").unlink()
    (stores["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "medium").unlink()
    lookup = invoke(["bench", "--target", "tiny:big", "--modes", "fsd", "--draft-policy", "fixed", *args, "--json"])
    assert lookup.exit_code == 0, lookup.output
    assert "Meanwhile prompt lookup drafts (--drafter ngram)." in lookup.stderr
    rows = json.loads(lookup.stdout[lookup.stdout.index("[") :])
    assert {r["drafter"] for r in rows if r["mode"] != "ar"} == {"ngram"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_resolves_the_draft_before_the_server_starts(stores, family):
    """A real `fsd-local serve --target tiny:big` (models in process): the draft is chosen and said before the
    server starts, and the API calls the model by the name it was given."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsd_local.cli", "serve", "--target", "tiny:big", "--in-process", "--port", str(port)]
        + ["--threads", "1", "--ctx", "256"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if line.startswith(("serving", "error")):
                break
        assert chosen(family) in lines, lines
        assert lines[-1].startswith(f"serving the OpenAI API on http://127.0.0.1:{port}/v1"), lines
        deadline = time.monotonic() + 60
        while True:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, lines
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["tiny:big"]
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_doctor_takes_names(stores):
    result = invoke(["doctor", "--json", "--target", "tiny:big", "--draft", "acme/Tiny-GGUF/tiny-small.gguf"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["compatible"] is True and report["compatibility_problem"] is None
    refused = invoke(["doctor", "--target", "tiny:big", "--draft", "odd:tiny"])
    assert refused.exit_code == 1
    assert "draft -> target: INCOMPATIBLE: vocabulary sizes differ by 256 (draft 36, target 292)" in refused.output


@pytest.mark.parametrize(
    "label, name, pair",
    [
        ("Meta Llama 3.1 8B Instruct", "x", "llama3.2-1b-3.1-8b"),
        ("Qwen2.5 7B Instruct", "x", "qwen2.5-0.5b-7b"),
        (None, "gemma-2-9b-it-Q8_0.gguf", "gemma2-2b-9b"),
        ("tiny-3", "tiny:big", None),
    ],
)
def test_the_note_says_which_pair_would_bring_a_draft(label, name, pair):
    from fsd_local.pairs.local import LocalModel
    from fsd_local.pairs.names import pull_hint

    hint = pull_hint(LocalModel("folder", name, None, label=label))
    if pair:
        assert f"(`fsd-local pull {pair}` fetches it with its target)" in hint, hint
    else:
        assert hint.startswith("Pull a smaller model of the same family"), hint
