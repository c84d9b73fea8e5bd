"""fsd-local bench / calibrate / bench --kernels: the statistics' arithmetic, prompt files and answer extraction,
and short end-to-end runs on the tiny GGUF pair (one thread: the machine is shared, spinning threads stall)."""

import csv
import io
import json
import math
import struct
import sys

import click
import numpy as np
import pytest

from fsd_local.bench.kernels import logit_rows, numpy_rows
from fsd_local.bench.prompts import EXAMPLE_FILE, extract_answer, load_prompts, parse_prompts
from fsd_local.bench.report import format_table, to_csv
from fsd_local.bench.runner import (
    BenchData,
    Config,
    Run,
    build_configs,
    paired_ratio,
    positionwise_agreement,
    prefix_agreement,
    spread,
    summarise,
    throughput_by_repeat,
)
from fsd_local.errors import ConfigError
from fsd_local.kernels.divergence import DIVERGENCES
from support import reference
from support.clirun import invoke, tiny_models

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ arithmetic
def test_spread_and_paired_ratio():
    assert spread([10.0, 14.0, 11.0]) == 2.0
    assert spread([5.0]) == 0.0
    # paired: the ratio is taken within each repeat, then the median
    assert paired_ratio([10.0, 30.0, 20.0], [5.0, 10.0, 20.0]) == 2.0
    assert paired_ratio([1.0, 2.0, None], [0.0, None, 3.0]) is None


def test_agreements():
    ref = [1, 2, 3, 4]
    assert prefix_agreement(ref, ref) == 1.0
    assert prefix_agreement([], []) == 1.0
    assert prefix_agreement([1, 2, 9, 4], ref) == 0.5
    assert positionwise_agreement([1, 2, 9, 4], ref) == 0.75
    assert prefix_agreement([1, 2, 3, 4, 5, 6, 7, 8], ref) == 0.5  # it ran past where the target stopped
    assert prefix_agreement([1, 2], ref) == 0.5
    assert positionwise_agreement([9, 2, 3], ref) == 0.5


def _stats(tokens, seconds, drafted=0, sd=0, fuzzy=0, rounds=None, by_pos=(), logprob=-1.0):
    """A generation's stats dict with the keys the bench reads."""
    return {
        "tokens": tokens,
        "rounds": rounds or tokens,
        "drafted": drafted,
        "accepted_sd": sd,
        "accepted_fuzzy": fuzzy,
        "drafted_by_position": [d for d, _ in by_pos],
        "accepted_by_position": [a for _, a in by_pos],
        "acceptance_by_position": [a / d for d, a in by_pos],
        "target_logprob_sum": logprob * tokens,
        "seconds_total": seconds,
        "seconds": {"draft": seconds / 4, "target": seconds / 2, "other": seconds / 4},
        "prompt_seconds": 0.01,
    }


def test_summarise_arithmetic():
    ar, sd, fsd = Config("ar", 0.0), Config("sd", 0.0, draft_max=2), Config("fsd", 0.0, "js", 0.3, 2)
    ref = [1, 2, 3, 4]
    data = BenchData(
        [ar, sd, fsd],
        prompts=[None, None],
        repeats=2,
        runs=[
            # 2 repeats x 2 prompts; throughput per repeat = tokens of both prompts / seconds of both prompts
            [
                Run(0, 0, ref, _stats(4, 1.0), None),
                Run(0, 1, ref, _stats(4, 1.0), None),
                Run(1, 0, ref, _stats(4, 2.0), None),
                Run(1, 1, ref, _stats(4, 2.0), None),
            ],
            [
                Run(r, p, ref, _stats(4, 0.5, drafted=4, sd=2, rounds=2, by_pos=[(2, 2), (2, 0)]), True)
                for r in range(2)
                for p in range(2)
            ],
            [
                Run(
                    r,
                    p,
                    [1, 2, 9, 9],
                    _stats(4, 0.25, drafted=4, sd=2, fuzzy=2, rounds=2, by_pos=[(2, 2), (2, 2)], logprob=-2.0),
                    p == 0,
                )
                for r in range(2)
                for p in range(2)
            ],
        ],
    )
    rows = summarise(data)
    assert throughput_by_repeat(data.runs[0], 2) == [4.0, 2.0]
    r_ar, r_sd, r_fsd = rows
    assert r_ar["tokens_per_second"] == 3.0 and r_ar["tokens_per_second_spread"] == 1.0
    assert r_ar["speedup_vs_ar"] == 1.0 and r_ar["speedup_vs_sd"] is None
    assert r_ar["acceptance_rate"] is None and r_ar["fuzzy_share"] is None
    assert r_sd["tokens_per_second"] == 8.0
    assert r_sd["speedup_vs_ar"] == pytest.approx(3.0)  # median of 8/4 and 8/2
    assert r_sd["agreement"] == 1.0 and r_sd["acceptance_rate"] == 0.5 and r_sd["fuzzy_share"] == 0.0
    assert r_sd["mean_tokens_per_round"] == 2.0
    assert r_sd["acceptance_by_position"] == [1.0, 0.0]
    assert r_sd["accuracy"] == 1.0
    assert r_fsd["speedup_vs_sd"] == 2.0
    assert r_fsd["acceptance_rate"] == 1.0 and r_fsd["fuzzy_share"] == 0.5
    assert r_fsd["agreement"] == 0.5 and r_fsd["agreement_positionwise"] == 0.5
    assert r_fsd["target_logprob_mean"] == -2.0
    assert r_fsd["accuracy"] == 0.5
    assert r_fsd["time_share"] == {"draft": 0.25, "target": 0.5, "other": 0.25}
    table = format_table(rows)
    assert "fsd" in table and "task" in table and "50%" in table
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert len(parsed) == 3 and parsed[2]["time_share_target"] == "0.5" and parsed[0]["speedup_vs_sd"] == ""


def test_agreement_is_null_when_sampling():
    ar, sd = Config("ar", 0.7), Config("sd", 0.7, draft_max=2)
    runs = [[Run(0, 0, [1, 2], _stats(2, 1.0), None)], [Run(0, 0, [1, 2], _stats(2, 1.0, drafted=1), None)]]
    rows = summarise(BenchData([ar, sd], [None], 1, runs))
    assert rows[0]["agreement"] is None and rows[1]["agreement"] is None
    assert rows[1]["target_logprob_mean"] == -1.0


def test_build_configs_does_not_multiply_ignored_axes():
    configs = build_configs(["fsd", "ar", "draft-only"], ["js", "kl"], [0, 0.1, 0.2], [2, 4], [0, 0.7], states=["cold"])
    per_temp = 1 + 2 + 2 * 3 * 2 + 1  # ar, sd per k, fsd per (divergence, tau, k), draft-only
    assert len(configs) == 2 * per_temp == len(set(configs))
    both = build_configs(["fsd", "ar", "draft-only"], ["js", "kl"], [0, 0.1, 0.2], [2, 4], [0, 0.7])
    assert len(both) == 2 * (per_temp + 2 + 2 * 3 * 2)  # auto runs cold and warm: sd and fsd twice
    assert {c.state for c in both if c.policy == "auto"} == {"cold", "warm"}
    assert sum(c.mode == "ar" for c in configs) == 2 and sum(c.mode == "draft-only" for c in configs) == 2
    assert all(c.tau is None and c.draft_max is None for c in configs if c.mode in ("ar", "draft-only"))
    assert {c.draft_max for c in configs if c.mode == "sd"} == {2, 4}  # sd runs although not listed
    with pytest.raises(ConfigError, match="unknown mode"):
        build_configs(["fast"], ["js"], [0], [4], [0])
    with pytest.raises(ConfigError, match="tau"):
        build_configs(["fsd"], ["js"], [-1.0], [4], [0])


# ------------------------------------------------------------------------------------------ prompts and answers
@pytest.mark.parametrize(
    "output, expected",
    [
        (" (B) Mercury", "B"),
        (" B. Mercury is closest", "B"),
        (" The answer is C.", "C"),
        (" I think the answer: (d) dolphin", "D"),
        ("A cat is not a fish (C)", "C"),
        (" A shark is a fish.", None),
        (" I think so", None),
        ("(a) first", "A"),
        (" The answer is a dolphin", None),
        (" no idea", None),
    ],
)
def test_letter_extraction(output, expected):
    assert extract_answer(output, "letter") == expected


@pytest.mark.parametrize(
    "output, expected",
    [
        (" 3 boxes of 4 make 12.", "12"),
        (" The answer is 1,200 apples; 5 are red", "1200"),
        (" first 3, then -4.5", "-4.5"),
        (" none", None),
        (" answer: $42, or 7 per box", "42"),
    ],
)
def test_number_extraction(output, expected):
    assert extract_answer(output, "number") == expected


def test_regex_extraction_and_grading():
    p = parse_prompts(
        '{"prompt": "Capital?", "answer": "Paris", "extract": "regex", "pattern": "\\\\b(Paris|Rome)\\\\b"}', "q.jsonl"
    )[0]
    assert p.extract_answer(" It is Rome, not Paris") == "Rome"
    assert p.is_correct(" Paris.") and not p.is_correct(" Rome.") and not p.is_correct(" Berlin")
    whole = parse_prompts('{"prompt": "x", "answer": "ab", "extract": "regex", "pattern": "a."}', "q.jsonl")[0]
    assert whole.is_correct("xxabx")  # no group: the whole match
    n = parse_prompts('{"prompt": "x", "answer": 12}', "q.jsonl")[0]
    assert n.extract == "number" and n.is_correct("so 12.0") and not n.is_correct("13")
    assert parse_prompts('{"prompt": "x"}', "q.jsonl")[0].is_correct("anything") is None


def test_prompt_files_plain_and_jsonl():
    plain = parse_prompts("first prompt\n\n  second one  \n", "p.txt")
    assert [p.text for p in plain] == ["first prompt", "  second one  "]
    assert all(p.answer is None for p in plain)
    js = parse_prompts('{"prompt": "a"}\n\n{"prompt": "b", "answer": "c"}\n', "p.jsonl")
    assert [(p.text, p.answer, p.extract) for p in js] == [("a", None, None), ("b", "c", "letter")]
    assert js[1].is_correct(" (C) yes")
    example = load_prompts()
    assert {p.extract for p in example} == {None, "letter", "number", "regex"}
    assert EXAMPLE_FILE.name == "prompts-example.jsonl"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a"', "line 2: not valid JSON"),
        ('["a"]', "line 2: expected a JSON object"),
        ('{"text": "a"}', "line 2: unknown key"),
        ('{"prompt": ""}', 'line 2: "prompt" must be'),
        ('{"prompt": "a", "answer": "Paris"}', "line 2: cannot tell how to read"),
        ('{"prompt": "a", "answer": "x", "extract": "regex"}', 'line 2: .*needs a "pattern"'),
        ('{"prompt": "a", "answer": "x", "extract": "regex", "pattern": "("}', 'line 2: bad "pattern"'),
        ('{"prompt": "a", "answer": "x", "extract": "number"}', "line 2: .*is not a number"),
        ('{"prompt": "a", "answer": "B", "extract": "vote"}', "line 2: \"extract\" is 'vote'"),
        ('{"prompt": "a", "extract": "letter"}', 'line 2: .*without an "answer"'),
    ],
)
def test_bad_jsonl_lines_name_the_line(line, message):
    with pytest.raises(ConfigError, match=f"p.jsonl {message}"):
        parse_prompts('{"prompt": "fine"}\n' + line, "p.jsonl")


def test_empty_and_missing_prompt_files(tmp_path):
    with pytest.raises(ConfigError, match="no prompts"):
        parse_prompts("\n \n", "empty.txt")
    with pytest.raises(ConfigError, match="cannot read prompts file"):
        load_prompts(tmp_path / "nope.txt")


# ------------------------------------------------------------------------------------------ end to end (tiny pair)
@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text(
        '{"prompt": "the cat sat on", "answer": "B"}\n'
        '{"prompt": "we ran far", "answer": "Paris", "extract": "regex", "pattern": "(\\\\w+)"}\n'
    )
    return str(path)


@pytest.fixture(scope="module")
def bench_run(tiny_pair, prompts_file, tmp_path_factory):
    png = tmp_path_factory.mktemp("plot") / "bench.png"
    result = invoke(
        [
            "bench",
            *tiny_models(tiny_pair),
            "--prompts",
            prompts_file,
            "--taus",
            "0,0.3",
            "--divergence",
            "js,kl",
            "--modes",
            "fsd,ar,draft-only",
            "--draft-max",
            "2,3",
            "--draft-policy",
            "fixed",
            "--temp",
            "0,0.8",
            "--max-tokens",
            "10",
            "--repeats",
            "2",
            "--json",
            "--plot",
            str(png),
        ]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), png


def test_bench_json(bench_run):
    rows, _ = bench_run
    # per temperature: ar, sd x 2 k, fsd x 2 divergences x 2 taus x 2 k, draft-only
    assert len(rows) == 2 * (1 + 2 + 8 + 1)
    required = {
        "mode",
        "divergence",
        "tau",
        "draft_max",
        "temperature",
        "tokens_per_second",
        "speedup_vs_ar",
        "speedup_vs_sd",
        "acceptance_rate",
        "mean_tokens_per_round",
        "fuzzy_share",
        "target_logprob_mean",
        "agreement",
        "accuracy",
        "acceptance_by_position",
        "time_share",
    }
    assert all(required <= set(r) for r in rows)
    assert all(r["runs"] == 4 and r["tokens_per_second"] > 0 for r in rows)
    for r in rows:
        if r["mode"] == "ar":
            assert r["speedup_vs_ar"] == 1.0
        if r["mode"] == "sd":
            assert r["speedup_vs_sd"] == 1.0
            assert r["fuzzy_share"] == 0.0
        if r["temperature"] == 0 and (r["mode"] == "sd" or (r["mode"] == "fsd" and r["tau"] == 0)):
            assert r["agreement"] == 1.0  # lossless: token for token the target's greedy output
        if r["temperature"] > 0:
            assert r["agreement"] is None
        if r["draft_max"]:
            assert len(r["acceptance_by_position"]) == r["draft_max"]
            # the offline oracle prices k = 0..draft_max with the row's acceptance and the bench's costs
            assert (
                0 <= r["oracle_k"] <= r["draft_max"] and len(r["oracle_tokens_per_second_by_k"]) == r["draft_max"] + 1
            )
            assert r["oracle_tokens_per_second"] == max(r["oracle_tokens_per_second_by_k"]) > 0
        assert r["accuracy"] in (0.0, 0.5, 1.0)
        assert sum(r["time_share"].values()) == pytest.approx(1.0)
    fsd_big = [r for r in rows if r["mode"] == "fsd" and r["tau"] == 0.3 and r["divergence"] == "js"]
    assert all(r["fuzzy_share"] > 0 for r in fsd_big)  # the tiny pair disagrees often: tau must rescue some
    assert all(r["target_logprob_mean"] is None for r in rows if r["mode"] == "draft-only")


def test_bench_plot_is_a_matplotlib_png(bench_run):
    _, png = bench_run
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert b"Software" in data[:2000] and b"matplotlib" in data[:2000]  # the tEXt chunk matplotlib writes


def test_bench_plot_is_a_grid_readable_at_page_width_with_one_legend(bench_run):
    from fsd_local.bench.plot import figure

    rows, png = bench_run
    width, height = struct.unpack(">II", png.read_bytes()[16:24])  # the IHDR chunk
    assert 800 <= width <= 1200 and height > width  # two panels wide, not a strip
    fig = figure(rows)
    try:
        shown = [ax for ax in fig.axes if ax.axison]
        assert len(shown) == 2 * 5  # two temperatures x (three tau panels + two frontiers), the sixth cell empty
        assert {round(ax.get_position().width * width) for ax in shown} <= set(range(300, 600))
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        assert "ar (target alone)" in labels and "fsd js k=2" in labels and "fsd kl k=3" in labels
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_bench_table_and_csv(tiny_pair, prompts_file):
    args = [
        "bench",
        *tiny_models(tiny_pair),
        "--prompts",
        prompts_file,
        "--taus",
        "0.2",
        "--max-tokens",
        "6",
        "--repeats",
        "1",
    ]
    table = invoke(args)
    assert table.exit_code == 0 and "tok/s" in table.stdout and "x sd" in table.stdout
    assert "state" in table.stdout.splitlines()[0] and "cold" in table.stdout and "warm" in table.stdout
    rows = list(csv.DictReader(io.StringIO(invoke(args + ["--csv"]).stdout)))
    assert [(r["mode"], r["policy_state"]) for r in rows] == [
        ("ar", ""),
        ("sd", "cold"),
        ("sd", "warm"),
        ("fsd", "cold"),
        ("fsd", "warm"),
    ]
    assert rows[0]["speedup_vs_ar"] == "1.0"


def test_bench_plot_without_matplotlib_is_one_clear_line(tiny_pair, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the `plot` extra sees
    result = invoke(["bench", *tiny_models(tiny_pair), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 1
    assert (
        result.stderr.strip() == "error: --plot needs matplotlib, which is not installed: pip install 'fsd-local[plot]'"
    )
    assert not (tmp_path / "x.png").exists()


def test_bench_usage_errors(tiny_pair):
    assert "--json and --csv" in invoke(["bench", "--kernels", "--json", "--csv"]).output
    assert "no model arguments" in invoke(["bench", "--kernels", *tiny_models(tiny_pair)]).output
    assert "only apply to --kernels" in invoke(["bench", *tiny_models(tiny_pair), "--rows", "2"]).output
    bad = invoke(["bench", *tiny_models(tiny_pair), "--taus", "0,x"])
    assert bad.exit_code == 2 and "'x' is not a valid tau value" in bad.output
    # calibrate measures fsd against sd: a target alone with no local model to draft for it is refused
    draftless = invoke(["calibrate", "--target", tiny_pair[1], "--min-agreement", "0.5"])
    assert draftless.exit_code == 2 and "give --draft too" in draftless.output
    assert "no model on this disk can draft for" in draftless.output


def test_calibrate_finds_the_largest_tau_within_an_agreement_budget(tiny_pair, prompts_file):
    result = invoke(
        [
            "calibrate",
            *tiny_models(tiny_pair),
            "--prompts",
            prompts_file,
            "--min-agreement",
            "0.5",
            "--steps",
            "3",
            "--max-tokens",
            "10",
            "--repeats",
            "1",
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert 0 <= out["tau"] <= math.log(2)
    assert out["agreement"] >= 0.5
    for v in out["visited"]:
        assert v["meets"] == (v["agreement"] >= 0.5)
        assert v["meets"] == (v["tau"] <= out["tau"])  # the search's monotone picture is what it measured
    assert out["speedup_vs_ar"] > 0 and out["tokens_per_second"] > 0


def test_calibrate_acceptance_target_and_errors(tiny_pair, prompts_file):
    result = invoke(
        [
            "calibrate",
            *tiny_models(tiny_pair),
            "--prompts",
            prompts_file,
            "--target-acceptance",
            "0.9",
            "--steps",
            "2",
            "--max-tokens",
            "10",
            "--repeats",
            "1",
            "--temp",
            "0.8",
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    reached = [v["tau"] for v in out["visited"] if v["meets"]]
    assert out["tau"] == min(reached) and out["acceptance_rate"] >= 0.9
    both = invoke(["calibrate", *tiny_models(tiny_pair), "--min-agreement", "0.5", "--target-acceptance", "0.9"])
    assert both.exit_code == 2 and "exactly one" in both.output
    sampled = invoke(["calibrate", *tiny_models(tiny_pair), "--min-agreement", "0.5", "--temp", "0.7"])
    assert sampled.exit_code == 2 and "--temp 0" in sampled.output


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("name", DIVERGENCES)
def test_numpy_baseline_computes_the_same_divergences(name):
    x, y = logit_rows(3000, 3, seed=5)
    got = numpy_rows(name, x, y)
    want = [reference.divergence(name, x[r], y[r]) for r in range(3)]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)


def test_bench_kernels_json():
    result = invoke(["bench", "--kernels", "--vocab", "64,300", "--rows", "1,3", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["divergence"], r["vocab"], r["rows"]) for r in rows] == [
        (d, v, n) for d in DIVERGENCES for v in (64, 300) for n in (1, 3)
    ]
    for r in rows:
        assert r["numba_s"] > 0 and r["numpy_s"] > 0
        assert r["ratio"] == pytest.approx(r["numpy_s"] / r["numba_s"])
        entries = r["vocab"] * r["rows"]
        assert r["numba_ns_per_entry"] == pytest.approx(r["numba_s"] / entries * 1e9)
        assert r["numpy_ns_per_entry"] == pytest.approx(r["numpy_s"] / entries * 1e9)
        assert r["max_rel_diff"] < 1e-3  # both computed the same thing
    table = invoke(["bench", "--kernels", "--vocab", "64", "--rows", "1", "--divergence", "kl", "--repeats", "1"])
    assert "numba ms" in table.stdout and "numba ns/entry" in table.stdout
    assert len(table.stdout.strip().splitlines()) == 2


def test_bench_samples_as_chat_does_and_takes_the_first_prompts(tiny_pair, prompts_file):
    """--chat-sampling: chat's top-k, top-p, min-p and repeat penalty in every run, and its temperature unless
    --temp is given; a chain option given alone overrides; --limit takes the first N prompts."""
    from fsd_local.cli import cli
    from fsd_local.cli.bench import sampling_of
    from fsd_local.cli.options import BENCH_SAMPLING
    from fsd_local.settings import CHAT_DEFAULTS

    args = ["bench", *tiny_models(tiny_pair), "--prompts", prompts_file, "--max-tokens", "6", "--repeats", "1"]
    args += ["--modes", "fsd", "--taus", "0.2", "--draft-policy", "fixed", "--draft-max", "2", "--json"]
    res = invoke([*args, "--chat-sampling", "--limit", "2"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert {r["temperature"] for r in rows} == {CHAT_DEFAULTS["temperature"]}
    assert all(r["runs"] == 2 for r in rows)  # two prompts, one repeat
    assert all(r["loss_per_token"] is not None for r in rows if r["mode"] != "draft-only")  # sampled loss, measured
    res = invoke([*args, "--chat-sampling", "--temp", "0.5", "--top-k", "3", "--limit", "1"])
    assert res.exit_code == 0, res.output
    assert {r["temperature"] for r in json.loads(res.stdout)} == {0.5}
    ctx = click.Context(cli.commands["bench"], info_name="bench")  # what the options become, without a run
    with ctx:
        a = {"chat_sampling": True, "temperatures": [0.0], **dict.fromkeys(BENCH_SAMPLING), "top_k": 3}
        common, temps = sampling_of(a)
    assert common == {**{k: v for k, v in CHAT_DEFAULTS.items() if k != "temperature"}, "top_k": 3}
    assert temps == [0.0]  # a context of its own: every option counts as given, --temp too
