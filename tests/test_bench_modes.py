"""`fsd-local bench`'s measurements other than the sweep, end to end on the tiny pair: --costs (one decode of each
batch size on both models), --serve (the server under concurrent clients), --overhead (the loop's own time), and
which options go with which."""

from __future__ import annotations

import json

import pytest

from support.clirun import invoke


@pytest.fixture(scope="module")
def models(tiny_pair, tmp_path_factory):
    draft, target = tiny_pair
    prompts = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    prompts.write_text('{"prompt": "the cat sat on the mat"}\n{"prompt": "we ran far and fast"}\n')
    return ["--target", target, "--draft", draft, "--threads", "1", "--ctx", "256", "--prompts", str(prompts)]


def test_costs_time_every_batch_size_on_both_models(models, tiny_pair):
    result = invoke(["bench", "--costs", *models, "--sizes", "4,2", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["model"], r["batch"]) for r in rows] == [(m, n) for m in ("target", "draft") for n in (1, 2, 4)]
    draft, target = tiny_pair
    assert {r["path"] for r in rows if r["model"] == "target"} == {target}
    assert all(r["ms"] > 0 and r["context"] > 0 for r in rows)  # after the first prompt, as a verification runs
    assert [r["ratio"] for r in rows if r["batch"] == 1] == [1.0, 1.0]
    assert "timing batch sizes after a prompt of" in result.stderr

    table = invoke(["bench", "--costs", *models, "--sizes", "2", "--repeats", "1"]).stdout
    lines = table.splitlines()
    assert "target ms" in lines[0] and "draft ms" in lines[0] and "x one" in lines[0]
    assert [ln.split()[0] for ln in lines[1:3]] == ["1", "2"]


def test_costs_of_a_target_alone(models):
    result = invoke(["bench", "--costs", *models, "--draft", "none", "--sizes", "2", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert {r["model"] for r in json.loads(result.stdout)} == {"target"}


def test_serve_answers_every_request_of_concurrent_clients(models):
    args = ["bench", "--serve", *models, "--clients", "2", "--requests", "4", "--max-tokens", "4", "--json"]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert (r["clients"], r["requests"], r["answered"], r["refused_503"]) == (2, 4, 4, 0)
    assert r["requests_per_second"] > 0 and r["completion_tokens_per_second"] > 0
    assert 0 < r["latency_s"]["median"] <= r["latency_s"]["p90"] <= r["latency_s"]["max"]
    assert r["acceptance_rate"] is None or 0 <= r["acceptance_rate"] <= 1
    assert r["rss_mib"]["before"] > 0 and r["rss_mib"]["after"] > 0  # Linux: /proc/self/status
    text = invoke(args[:-1]).stdout
    assert "4 answered, 0 refused (503)" in text and "latency s: median" in text


def test_overhead_splits_the_loop_by_phase(models):
    """With no sampling option, every configuration under the three samplings a user meets (greedy, a temperature
    alone as OpenAI's API sends, chat's defaults); with one, that sampling alone. Each row has its phases and the
    call's own time taken from outside (generate's wall time minus llama.cpp's)."""
    args = ["bench", "--overhead", *models, "--taus", "0.3", "--draft-max", "2", "--draft-policy", "fixed"]
    result = invoke(args + ["--max-tokens", "6", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    labels = [r["config"] for r in rows]
    for case in ("greedy", "T 0.7 alone (API default)", "chat defaults"):
        assert f"ar {case}" in labels and f"fsd js tau 0.3 fixed k 2 {case}" in labels
    for r in rows:
        assert r["rounds"] > 0 and r["tokens"] > 0 and 0 <= r["own_share_of_wall"] <= 1
        assert 0 < r["call_us_per_round_best"] and r["verify_us_per_round"] > 0
    one = invoke(args + ["--max-tokens", "6", "--json", "--temp", "0.5"])
    assert [r["config"] for r in json.loads(one.stdout)][:2] == ["ar T 0.5", "sd fixed k 2 T 0.5"]
    assert all(r["map_us_per_round"] is None for r in rows)  # one vocabulary: no map


def test_overhead_of_a_pair_of_two_tokenizers_has_the_maps_and_the_followers_time(models, cross_pair, tmp_path):
    """A draft of another vocabulary (the tiny BPE model for a larger SentencePiece one): each row says what carrying
    the draft's rows (the map) and following the text cost per round; the map's inside the drafting phase's."""
    from support.tinymodels import write_tiny_gguf

    target = str(write_tiny_gguf(tmp_path / "big.gguf", seed=4, n_layer=3, n_embd=128, control=("<|im_end|>",)))
    pair = ["--target", target, "--draft", cross_pair[1], *models[4:]]
    args = ["bench", "--overhead", *pair, "--taus", "0.3", "--draft-max", "2", "--draft-policy", "fixed"]
    result = invoke(args + ["--max-tokens", "6", "--json", "--temp", "0"])
    assert result.exit_code == 0, result.output
    rows = {r["config"]: r for r in json.loads(result.stdout)}
    ar, fsd = rows["ar T 0"], rows["fsd js tau 0.3 fixed k 2 T 0"]
    assert ar["map_us_per_round"] == 0 and fsd["map_us_per_round"] > 0 and fsd["follow_us_per_round"] > 0
    assert fsd["map_us_per_round"] <= fsd["draft_us_per_round"]
    assert " map  follow" in invoke(args + ["--max-tokens", "6", "--temp", "0"]).stdout


def test_each_measurement_takes_its_own_options(models):
    assert "choose one of --kernels, --costs" in invoke(["bench", "--kernels", "--costs"]).output
    assert "--sizes only applies to --costs" in invoke(["bench", *models, "--sizes", "2"]).output
    assert "--clients and --requests only apply to --serve" in invoke(["bench", "--costs", "--clients", "2"]).output
    assert "--costs prints a table or --json" in invoke(["bench", "--costs", *models, "--csv"]).output
    assert "--serve prints a table or --json" in invoke(["bench", "--serve", *models, "--csv"]).output
