"""The speed / quality frontier of `fsd-local bench` (bench/frontier.py) on synthetic summaries, the bench axes of
the new modes, `calibrate --modes` choosing the fastest (mode, tau) within a budget (on a synthetic pair whose
quality and speed are known functions of tau, and end to end on the tiny GGUF pair), and the frontier in the
CLI's JSON, table and plot."""

import json

import pytest

from fsd_local.bench import calibrate as C
from fsd_local.bench.frontier import dominates, frontier, frontier_rows, mark_frontier
from fsd_local.bench.runner import BenchData, build_configs
from support.clirun import invoke, tiny_models

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def row(mode, tps, logp, agree=None, temp=0.0, tau=None):
    return {
        "mode": mode,
        "tau": tau,
        "temperature": temp,
        "tokens_per_second": tps,
        "target_logprob_mean": logp,
        "agreement": agree,
    }


# ------------------------------------------------------------------------------------------ the frontier
def test_dominance_needs_one_strict_improvement():
    assert dominates((2, 1), (1, 1)) and dominates((1, 2), (1, 1)) and dominates((2, 2), (1, 1))
    assert not dominates((1, 1), (1, 1)) and not dominates((2, 0), (1, 1))
    assert frontier([(1, 1), (1, 1), (0.5, 0.5), None]) == [True, True, False, None]


def test_mark_frontier_on_synthetic_summaries():
    rows = [
        row("ar", 10.0, -1.0, 1.0),  # best quality: on the frontier
        row("sd", 8.0, -1.0, 1.0),  # as good as ar and slower: dominated
        row("fsd", 14.0, -1.2, 0.6, tau=0.2),  # faster, a little worse: on
        row("typical", 14.0, -1.1, 0.5, tau=0.5),  # as fast as fsd and better log-prob: dominates it on log-prob
        row("cascade", 20.0, -2.0, 0.55, tau=0.9),  # fastest: on
        row("relaxed", 12.0, -1.5, 0.9, tau=0.1),  # dominated on log-prob (typical), not on agreement
        row("draft-only", 30.0, None, 0.1),  # no log-prob: neither on nor blocking
        row("ar", 5.0, -1.0, None, temp=0.7),  # another temperature: its own frontier
        row("fsd", 4.0, -0.9, None, temp=0.7, tau=0.1),
    ]
    mark_frontier(rows)
    on = {(r["mode"], r["temperature"]): r["on_frontier"] for r in rows}
    assert on == {
        ("ar", 0.0): True,
        ("sd", 0.0): False,
        ("fsd", 0.0): False,
        ("typical", 0.0): True,
        ("cascade", 0.0): True,
        ("relaxed", 0.0): False,
        ("draft-only", 0.0): None,
        ("ar", 0.7): True,
        ("fsd", 0.7): True,  # slower but better: temperature 0's rows do not count here
    }
    agree = {(r["mode"], r["temperature"]): r["on_frontier_agreement"] for r in rows}
    assert agree[("relaxed", 0.0)] and agree[("ar", 0.0)] and agree[("draft-only", 0.0)]
    assert agree[("fsd", 0.0)] and not agree[("typical", 0.0)] and not agree[("sd", 0.0)]
    assert agree[("ar", 0.7)] is None  # agreement is undefined when sampling
    assert [r["mode"] for r in frontier_rows(rows, 0.0)] == ["cascade", "typical", "ar"]


# ------------------------------------------------------------------------------------------ bench axes
def test_target_rules_are_not_multiplied_over_divergences():
    modes = ["fsd", "typical", "cascade", "relaxed", "fsd-entropy"]
    configs = build_configs(modes, ["js", "kl"], [0.1, 0.2], [4], [0], states=["cold"])
    by_mode = {m: [c for c in configs if c.mode == m] for m in ("fsd", "typical", "cascade", "relaxed", "fsd-entropy")}
    assert len(by_mode["fsd"]) == len(by_mode["fsd-entropy"]) == 4  # 2 divergences x 2 taus
    for m in ("typical", "cascade", "relaxed"):
        assert len(by_mode[m]) == 2 and all(c.divergence is None for c in by_mode[m])
        assert "divergence" not in by_mode[m][0].settings(8, 0)


# ------------------------------------------------------------------------------------------ calibrate --modes
# agreement = 1 - slope * tau and tokens/s = 10 + gain * tau, per mode
SLOPE = {"fsd": 1.0, "typical": 2.0, "cascade": 0.5}
GAIN = {"fsd": 10.0, "typical": 30.0, "cascade": 5.0}


def _fake_run_bench(engine, prompts, configs, **run):
    return BenchData(list(configs), prompts, run["repeats"], [[] for _ in configs])


def _fake_summarise(data):
    rows = []
    for c in data.configs:
        tau = c.tau or 0.0
        quality = 1.0 - SLOPE.get(c.mode, 0.0) * tau
        rows.append(
            {
                "mode": c.mode,
                "tau": c.tau,
                "tokens_per_second": 10.0 + GAIN.get(c.mode, 0.0) * tau,
                "tokens_per_second_spread": 0.0,
                "speedup_vs_ar": 1.0,
                "speedup_vs_sd": 1.0,
                "acceptance_rate": min(1.0, 0.4 + tau),
                "mean_tokens_per_round": 2.0,
                "fuzzy_share": 0.1,
                "target_logprob_mean": -1.0 - (1.0 - quality),
                "agreement": quality,
                "accuracy": None,
            }
        )
    return rows


def test_calibrate_modes_returns_the_fastest_mode_within_the_budget(monkeypatch):
    monkeypatch.setattr(C, "run_bench", _fake_run_bench)
    monkeypatch.setattr(C, "summarise", _fake_summarise)
    budget = C.Budget("agreement", 0.8)  # largest taus: fsd 0.2 (12 tok/s), typical 0.1 (13), cascade 0.4 (12)
    out = C.calibrate(None, [None], budget=budget, modes=["fsd", "typical", "cascade"], steps=12, tau_max=1.0)
    assert out["mode"] == "typical" and out["tau"] == pytest.approx(0.1, abs=1e-3)
    assert out["divergence"] is None  # typical reads no divergence
    cands = out["candidates"]
    assert cands[0]["mode"] == "typical"  # fastest first (fsd and cascade tie at 12 tok/s)
    assert {c["mode"]: round(c["tau"], 2) for c in cands} == {"typical": 0.1, "fsd": 0.2, "cascade": 0.4}
    assert [c["divergence"] for c in cands if c["mode"] == "fsd"] == ["js"]
    assert all(c["agreement"] >= 0.8 for c in cands)
    report = C.format_report(out, budget)
    assert "fastest within the budget" in report and "typical" in report
    single = C.calibrate(None, [None], budget=budget, mode="cascade", steps=12, tau_max=1.0)
    assert single["mode"] == "cascade" and "candidates" not in single


def test_default_search_ranges():
    assert C.default_tau_max("cascade", "js") == 1.0 and C.default_tau_max("relaxed", "kl") == 1.0
    assert C.default_tau_max("typical", "js") == pytest.approx(1 / 0.91)
    assert C.default_tau_max("fsd-entropy", "js") == pytest.approx(2 * C.TAU_CEILING["js"])
    assert C.default_tau_max("fsd", "kl") == C.TAU_CEILING_UNBOUNDED


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_text("the cat sat on\nwe ran far\n")
    return str(path)


def test_bench_marks_the_frontier_of_every_mode(tiny_pair, prompts_file, tmp_path):
    png = tmp_path / "front.png"
    args = ["bench", *tiny_models(tiny_pair), "--prompts", prompts_file, "--taus", "0,0.5", "--max-tokens", "8"]
    args += ["--modes", "fsd,typical,cascade,relaxed,fsd-entropy", "--temp", "0,0.8", "--repeats", "1"]
    args += ["--policy-state", "cold"]
    result = invoke(args + ["--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 2 * (1 + 1 + 5 * 2)  # ar, sd, 5 modes x 2 taus per temperature
    for temp in (0.0, 0.8):
        at = [r for r in rows if r["temperature"] == temp]
        assert any(r["on_frontier"] for r in at)
        points = [(r["tokens_per_second"], r["target_logprob_mean"]) for r in at]
        assert [r["on_frontier"] for r in at] == frontier(points)
    for r in rows:
        if r["mode"] in ("typical", "cascade", "relaxed"):
            assert r["divergence"] is None
        if r["temperature"] == 0 and r["tau"] == 0:
            assert r["agreement"] == 1.0  # every rule at tau = 0 is sd: the target's greedy output
        if r["temperature"] > 0:
            assert r["on_frontier_agreement"] is None
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    table = invoke(args)
    assert "front" in table.stdout.splitlines()[0] and "typical" in table.stdout


def test_calibrate_modes_end_to_end(tiny_pair, prompts_file):
    args = ["calibrate", *tiny_models(tiny_pair), "--prompts", prompts_file, "--min-agreement", "0.5"]
    args += ["--steps", "2", "--max-tokens", "8", "--repeats", "1"]
    result = invoke(args + ["--modes", "fsd,cascade", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    cands = out["candidates"]
    assert {c["mode"] for c in cands} == {"fsd", "cascade"}
    assert out["mode"] == cands[0]["mode"] and out["tokens_per_second"] == max(c["tokens_per_second"] for c in cands)
    assert all(c["agreement"] >= 0.5 for c in cands)
    both = invoke(args + ["--modes", "fsd,cascade", "--mode", "typical"])
    assert both.exit_code == 2 and "not both" in both.output
    bad = invoke(args + ["--modes", "fsd,ar"])
    assert bad.exit_code == 2 and "'ar'" in bad.output
