"""Drafters and draft-length policies in the engine, on real llama.cpp (tiny F32 models: greedy ids comparable):
prompt lookup needs no draft model and stays exact at tau = 0, every policy keeps greedy sd exact, and the CLI
runs without --draft."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fsd_local import ConfigError, Engine
from fsd_local.cli import cli

# repetitive prompts give prompt lookup something to find
PROMPTS = ["abcabcabcabcab", "the cat. the cat. the cat. the", "xyz"]


@pytest.fixture(scope="module")
def target_only(tiny_pair):
    with Engine(target=tiny_pair[1], n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=4) as eng:
        yield eng


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("policy", ["fixed", "adaptive", "auto"])
def test_greedy_ngram_is_exactly_the_targets_output_without_a_draft_model(target_only, prompt, policy):
    ar = target_only.generate(prompt, mode="ar", max_tokens=40)
    for mode, tau in (("sd", 0.0), ("fsd", 0.0)):
        out = target_only.generate(prompt, mode=mode, tau=tau, drafter="ngram", draft_policy=policy, max_tokens=40)
        assert out.token_ids == ar.token_ids, (mode, policy)
        st = out.stats
        assert sum(st["k_histogram"]) == st["rounds"]
        assert st["plain_tokens_per_second_est"] > 0


def test_prompt_lookup_really_drafts_and_is_accepted_on_a_repeating_text(target_only):
    out = target_only.generate("abcabcabcabcabcabc", mode="sd", drafter="ngram", max_tokens=40, draft_max=4)
    assert out.stats["drafted"] > 0
    ar = target_only.generate("abcabcabcabcabcabc", mode="ar", max_tokens=40)
    assert out.token_ids == ar.token_ids


def test_auto_learns_lookup_acceptance_per_match_class(target_only):
    """On a long repeating text the lookup matches agree far back, so `auto` keeps their acceptance under a high
    match class (drafting/ngram.py `match_class`), apart from the short matches at the start."""
    prompt = "one two three four five six seven eight nine ten " * 6
    out = target_only.generate(prompt, mode="sd", drafter="ngram", draft_policy="auto", max_tokens=40)
    classes = {c for (drafter, c) in target_only.policy_state()["lengths"]["costs"] if drafter == "ngram"}
    assert max(classes) >= 4, classes
    assert out.token_ids == target_only.generate(prompt, mode="ar", max_tokens=40).token_ids


@pytest.mark.parametrize("drafter", ["model", "ngram+model"])
@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_every_drafter_and_policy_keeps_greedy_sd_exact(tiny_engine, drafter, policy):
    for prompt in PROMPTS:
        ar = tiny_engine.generate(prompt, mode="ar", max_tokens=32)
        out = tiny_engine.generate(prompt, mode="sd", drafter=drafter, draft_policy=policy, max_tokens=32)
        assert out.token_ids == ar.token_ids, (drafter, policy, prompt)


def test_the_kl_divergences_never_rescue_a_one_hot_draft(target_only):
    out = target_only.generate("abcabcabcabc", mode="fsd", tau=1e9, divergence="kl", drafter="ngram", max_tokens=30)
    assert out.stats["accepted_fuzzy"] == 0  # KL(p || one-hot) is +inf wherever p has mass off the token
    js = target_only.generate("abcabcabcabc", mode="fsd", tau=1e9, divergence="js", drafter="ngram", max_tokens=30)
    assert js.stats["drafted"] == 0 or js.stats["acceptance_rate"] == 1.0  # js <= ln 2: a huge tau takes all


def test_the_model_drafter_needs_a_draft_model(target_only):
    with pytest.raises(ConfigError, match="needs a draft model"):
        target_only.generate("abc", mode="sd", drafter="model")


def test_cli_generate_with_ngram_needs_no_draft(tiny_pair):
    r = CliRunner().invoke(
        cli,
        [
            "generate",
            "abcabcabcabc",
            "--target",
            tiny_pair[1],
            "--drafter",
            "ngram",
            "--mode",
            "sd",
            "--draft-policy",
            "auto",
            "--max-tokens",
            "12",
            "--threads",
            "1",
            "--ctx",
            "256",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["settings"]["drafter"] == "ngram" and out["settings"]["draft_policy"] == "auto"
    assert len(out["token_ids"]) == 12


def test_adaptive_flag_is_the_adaptive_policy():
    from fsd_local import Settings

    assert Settings(adaptive=True).draft_policy == "adaptive"
    assert Settings(draft_policy="adaptive").adaptive is True


def test_bench_axes_multiply_drafters_and_policies_and_pair_sd_with_its_own_drafting():
    from fsd_local.bench.runner import Config, build_configs

    configs = build_configs(["fsd"], ["js"], [0.1], [4], [0.0], ["model", "ngram"], ["fixed", "auto"])
    # ar, sd per (drafter, policy), fsd per (drafter, policy); auto cold and warm
    assert len(configs) == 1 + 6 + 6
    assert Config("sd", 0.0, draft_max=4, drafter="ngram", policy="auto", state="cold") in configs
    assert Config("sd", 0.0, draft_max=4, drafter="ngram", policy="auto", state="warm") in configs
    assert Config("sd", 0.0, draft_max=4, drafter="ngram", policy="fixed") in configs
    s = Config("fsd", 0.0, "js", 0.1, 4, "ngram", "auto").settings(16, 0)
    assert (s["drafter"], s["draft_policy"], s["draft_max"]) == ("ngram", "auto", 4)


def test_bench_runs_the_ngram_drafter_on_a_target_alone(tiny_pair):
    r = CliRunner().invoke(
        cli,
        [
            "bench",
            "--target",
            tiny_pair[1],
            "--drafter",
            "ngram",
            "--draft-policy",
            "fixed,auto",
            "--modes",
            "sd",
            "--max-tokens",
            "12",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--ctx",
            "256",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output[r.output.index("[") :])
    sd = [row for row in rows if row["mode"] == "sd"]
    assert {(row["drafter"], row["draft_policy"]) for row in sd} == {("ngram", "fixed"), ("ngram", "auto")}
    for row in sd:
        assert row["speedup_vs_sd"] is not None and row["agreement"] == 1.0  # greedy sd is the target's output
        assert sum(row["k_histogram"]) > 0 and row["plain_tokens_per_second_est"] > 0
