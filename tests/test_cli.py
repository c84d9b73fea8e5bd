"""The command line around chat: the demo pair, models/pull/--pair end to end, error paths, help texts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsd_local import Engine, ModelLoadError
from fsd_local.cli import cli
from fsd_local.pairs.demo import DEMO_NOTE, demo_pair
from support.loopback_hub import LoopbackHub, closed_port, toml_for

ROOT = Path(__file__).resolve().parent.parent


def invoke(args, input=None):
    return CliRunner().invoke(cli, args, input=input)


# ------------------------------------------------------------------ the demo pair
def test_demo_pair_builds_from_scratch(tmp_path):
    said = []
    draft, target = demo_pair(directory=tmp_path, progress=said.append)
    assert target.parent == tmp_path and target.exists() and said and "building the demo target" in said[0]
    with Engine(target=str(target), draft=str(draft), n_ctx=256, n_threads=1) as eng:
        assert (eng.target.n_layer, eng.draft.n_layer) == (44, 30)
        out = eng.generate("The capital of France is", max_tokens=6, tau=0.3)
    assert out.stats["tokens"] == 6 and out.text.strip()
    mtime = target.stat().st_mtime_ns
    said.clear()
    assert demo_pair(directory=tmp_path, progress=said.append) == (draft, target)
    assert said == [] and target.stat().st_mtime_ns == mtime  # built once


@pytest.mark.parametrize(
    "args, input",
    [
        (["chat", "--max-tokens", "3", "--ctx", "256", "--threads", "1"], "Hi\n"),
        (["generate", "Hi", "--max-tokens", "3", "--ctx", "256", "--threads", "1"], None),
    ],
)
def test_no_model_arguments_runs_the_demo_pair_and_says_so(real_pair, args, input):
    result = invoke(args, input)
    assert result.exit_code == 0, result.output
    assert DEMO_NOTE in result.output and "fsd-local pull" in DEMO_NOTE
    assert re.search(r"\[(length|stop)\] \d+ tokens", result.output)


def test_readme_starts_with_the_demo_chat():
    first = re.search(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert first == 'pip install -e ".[demo]" && fsd-local chat --demo wide --quality-budget 0.15'
    assert "chat" in invoke(["--help"]).output


# ------------------------------------------------------------------ errors: one line, exit code, no traceback
def not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip file")
    return str(bad)


ERRORS = [
    (
        lambda tmp, pair: ["--target", str(tmp / "nope.gguf"), "--draft", pair[0]],
        r"error: target model file not found: .*nope.gguf \(check the path, or `fsd-local pull` a pair\)",
    ),
    (
        lambda tmp, pair: ["--target", not_gguf(tmp), "--draft", pair[0]],
        r"error: target model .*model.gguf is not a GGUF file \(starts with b'PK\\x03\\x04'",
    ),
    (lambda tmp, pair: ["--target", pair[1], "--draft", pair[0], "--tau", "-1"], r"error: tau=-1.0 must be >= 0"),
    (
        lambda tmp, pair: ["--pair", "qwen-0.5b"],
        r"error: unknown pair 'qwen-0.5b' \(did you mean 'qwen2.5-0.5b-7b'\?\); known pairs:",
    ),
    (
        lambda tmp, pair: ["--pair", "qwen2.5-0.5b-7b"],
        r"error: pair 'qwen2.5-0.5b-7b' is not downloaded yet \(missing bartowski/Qwen2.5-7B-Instruct-GGUF/",
    ),
]


@pytest.mark.parametrize("make_args, message", ERRORS)
def test_chat_errors_are_one_clear_line(tmp_path, tiny_pair, make_args, message):
    result = invoke(["chat", *make_args(tmp_path, tiny_pair)], "hello\n")
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1 and re.match(message, errors[0]), result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_a_larger_draft_of_another_vocabulary(real_pair, gemma_path):
    result = invoke(
        ["chat", "--target", real_pair[1], "--draft", gemma_path, "--ctx", "128", "--threads", "1"], "hello\n"
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert re.search(r"error: draft .*gemma.* is larger than target .*: a draft must be the smaller", result.output)


@pytest.mark.parametrize(
    "args, message",
    [
        (["chat", "--tau", "abc"], "Invalid value for '--tau': 'abc' is not a valid float"),
        (["chat", "--mode", "fast"], "Invalid value for '--mode': 'fast' is not one of"),
        (["chat", "--pair", "x", "--target", "t.gguf"], "give either --pair or --target/--draft, not both"),
        (["pull"], "Missing argument 'PAIR'"),
    ],
)
def test_usage_errors(args, message):
    result = invoke(args, "")
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_debug_shows_the_exception(tmp_path, tiny_pair):
    result = invoke(["--debug", "chat", "--target", str(tmp_path / "nope.gguf"), "--draft", tiny_pair[0]], "")
    assert isinstance(result.exception, ModelLoadError)


@pytest.mark.parametrize("command", ["chat", "models", "pull"])
def test_help_explains_tau_modes_and_divergences(command):
    text = " ".join(invoke([command, "--help"]).output.split())
    for words in (
        "tau",
        "0 = standard speculative decoding",
        "fsd-paper",
        "draft-only",
        "Jensen-Shannon",
        "paper-js",
        "Examples:",
        "fsd-local chat --",
    ):
        assert words in text, (command, words)


# ------------------------------------------------------------------ models, pull and --pair, end to end
def fsd_local(args, env, input=None):
    return subprocess.run(
        [sys.executable, "-m", "fsd_local.cli", *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.fixture
def registry_env(tmp_path, tiny_pair):
    draft_sha = hashlib.sha256(Path(tiny_pair[0]).read_bytes()).hexdigest()
    (tmp_path / "models.toml").write_text(toml_for(draft_sha=draft_sha))
    return {
        "FSD_LOCAL_MODELS": str(tmp_path / "models.toml"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "0",
    }


def test_pull_then_chat_with_the_pair(registry_env, tiny_pair):
    with LoopbackHub() as hub:
        hub.add("me/tiny", "draft.gguf", tiny_pair[0])
        hub.add("me/tiny", "target.gguf", tiny_pair[1])
        env = {**registry_env, "HF_ENDPOINT": hub.url}
        pulled = fsd_local(["pull", "tiny"], env)
    assert pulled.returncode == 0, pulled.stderr
    assert "draft: sha256 matches models.toml (revision 0123456)" in pulled.stderr
    paths = dict(line.split(maxsplit=1) for line in pulled.stdout.splitlines())
    assert Path(paths["target"]).read_bytes() == Path(tiny_pair[1]).read_bytes()
    listing = fsd_local(["models"], registry_env)
    assert "tiny  [downloaded]  tiny pair" in listing.stdout and registry_env["HF_HUB_CACHE"] in listing.stdout
    chat = fsd_local(
        ["chat", "--pair", "tiny", "--ctx", "256", "--threads", "1", "--max-tokens", "5", "--json"],
        registry_env,
        input="hello\n",
    )
    assert chat.returncode == 0, chat.stderr
    assert json.loads(chat.stdout)["stats"]["tokens"] == 5


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"HF_HUB_OFFLINE": "1"},
            "error: HF_HUB_OFFLINE is set and me/tiny/target.gguf, me/tiny/draft.gguf is not in the cache",
        ),
        ({"HF_ENDPOINT": "http://127.0.0.1:{port}"}, "error: cannot reach http://127.0.0.1:{port} ("),
    ],
)
def test_pull_without_the_hub_is_one_line(registry_env, env, message):
    port = closed_port()
    env = {k: v.format(port=port) for k, v in env.items()}
    run = fsd_local(["pull", "tiny"], {**registry_env, **env})
    assert run.returncode == 1 and run.stderr.startswith(message.format(port=port))
    assert len(run.stderr.strip().splitlines()) == 1


def test_models_json_and_a_broken_registry(tmp_path, monkeypatch):
    listing = json.loads(invoke(["models", "--json"]).output)
    pair = listing["qwen2.5-0.5b-7b"]
    assert pair["draft"]["file"] == "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf" and set(pair["present"]) == {"target", "draft"}
    broken = tmp_path / "mine.toml"
    broken.write_text(toml_for().replace("size_mb = 0.1", 'size_mb = "big"', 1))
    monkeypatch.setenv("FSD_LOCAL_MODELS", str(broken))
    result = invoke(["models"])
    assert result.exit_code == 1
    assert result.output == f"error: {broken} pair 'tiny' draft: size_mb must be a number, got 'big'\n"
