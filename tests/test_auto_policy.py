"""The `auto` draft-length policy as a whole: the default everywhere, robust to an unlucky start, as good as the
best fixed k on high-acceptance (fuzzy) traces, the bench's offline oracle, and the "x plain decoding" rule.
Traces are generated (tests/support/autosim.py drives DraftLength like the engine); costs are ones measured here."""

from __future__ import annotations

import pytest

from fsd_local.bench.oracle import oracle, verify_curve
from fsd_local.bench.runner import Run, build_configs
from fsd_local.cli.options import summary_line
from fsd_local.drafting.cost_model import CostModel
from fsd_local.drafting.proposer import MODEL, ROWS_KEPT
from fsd_local.settings import Settings
from support.autosim import FSD, SD, Costs, interpolated, measured, orders, rate, run_auto, run_fixed, session, trace

MS = 1e-3
# one target decode of n tokens, seconds (index n): the wide demo target, 2 threads, on an Intel host (CPU tiles at
# 4 and 8; speculation pays) and on this AMD host (a batch of 2 costs 2.4x one token: only lossy rules pay)
TILED = [0, 0.150, 0.171, 0.202, 0.225, 0.303, 0.313, 0.355, 0.312, 0.405, 0.41, 0.41, 0.411, 0.48, 0.5, 0.5, 0.506]
WIDE = Costs(TILED + [0.58], draft=0.013, catch_up=0.004)
WIDE_AMD_MS = {1: 35.8, 2: 85, 3: 107, 4: 115, 5: 145, 6: 156, 8: 125, 9: 155, 12: 158, 16: 195, 17: 238}
WIDE_AMD = Costs([v * MS for v in interpolated(WIDE_AMD_MS)], draft=5.2 * MS, catch_up=3.0 * MS)
# a memory-bound target (the F16 demo): a batch costs little more than one decode; a fast draft
F16 = Costs([0] + [0.040 * (1 + 0.06 * (n - 1)) for n in range(1, 18)], draft=0.008, catch_up=0.003)
# the Q4_1 demo: the draft costs more than half a target step, so no acceptance makes drafting pay
Q4_1 = Costs([0] + [0.0092 * (1 + 0.9 * (n - 1)) for n in range(1, 18)], draft=0.0052, catch_up=0.003)
# every size 1..17 timed on this AMD host for issue 37 (`fsd-local bench --costs --demo D --sizes 1,...,17`, 2
# threads, the fastest of 3): the wide target (its tiles: 8 and 12 cost what 7 and 11 do) and the Q4_1 demo target,
# whose draft costs 0.7 of a target step (no acceptance makes drafting pay); draft and catch-up per token
WIDE_17_MS = [46.5, 98.1, 108.5, 123.6, 184.4, 197.8, 190.6, 186.7, 256.7, 261.1, 296.3, 266.6, 350.6, 361.2, 315.1]
WIDE_17 = Costs([0.0] + [ms * MS for ms in WIDE_17_MS + [327.9, 371.6]], draft=9.9 * MS, catch_up=5.2 * MS)


def near(plain_ms: float) -> Costs:
    """WIDE_17 with a dearer plain step (the other sizes 6% dearer): the AMD host on 2026-12-02, where ar, k = 2
    and k = 3 were within 10% of one another for sd (a plain step 54-67 ms, a batch of 4 131 ms)."""
    return Costs([0.0, plain_ms * MS] + [v * 1.06 for v in WIDE_17.verify[2:]], draft=10.5 * MS, catch_up=5.2 * MS)


Q4_1_17_MS = [12.6, 21.8, 26.9, 31.2, 40.4, 46.8, 51.0, 54.8, 63.6, 69.7, 76.6, 77.7, 88.8, 96.2, 98.3, 102.5, 102.7]
Q4_1_17 = Costs([0.0] + [ms * MS for ms in Q4_1_17_MS], draft=8.75 * MS, catch_up=4.7 * MS)
# the costly pair below (an F16 target of 8 layers, width 512; a tiny draft), 2 threads, the fastest of 5 decodes
COSTLY_MS, COSTLY_DRAFT_MS, COSTLY_CATCH_UP_MS = [2.45, 5.26, 5.79, 6.16, 6.45, 6.92, 7.95, 8.38, 8.81], 0.085, 0.0225


@pytest.mark.parametrize("unlucky", [2, 3, 6])
def test_an_unlucky_start_never_locks_auto_into_plain_decoding(unlucky):
    """The issue's k histogram [63, 1]: the first drafts were rejected and the reply went on plainly. Here the
    first `unlucky` positions reject, then the pair accepts like a real one (0.75)."""
    res, _ = run_auto([False] * unlucky + trace(0.75, 400, unlucky), WIDE, 200)
    ar = 1 / WIDE.v(1)
    assert sum(1 for k in res.ks[:40] if k) >= 20, res.ks  # drafting again early in the reply
    assert res.rate >= 1.3 * ar, (res.rate, ar, res.ks)


@pytest.mark.parametrize(("costs", "a"), [(F16, 0.92), (F16, 0.85), (WIDE, 0.92), (WIDE, 0.75), (WIDE_AMD, 0.95)])
def test_auto_matches_the_best_fixed_k_on_long_sessions(costs, a):
    """Across the replies of one engine (the bench: many prompts), auto reaches >= 0.97 of the best fixed k on
    the same traces, high (fuzzy-like) acceptance included."""
    auto, fixed = session([trace(a, 300, 100 * r + 7) for r in range(40)], costs, 64)
    best = max(rate(f) for f in fixed.values())
    assert rate(auto) >= 0.97 * best, (rate(auto), best)


def first_reply_ratios(costs, a, seeds=8, rule=SD):
    """Per seed: a fresh engine's first reply over the same reply at the fixed k that is best over the session
    of 6 replies (the issue's "within 0.9x of that best")."""
    out = []
    for seed in range(seeds):
        auto, fixed = session([trace(a, 200, 100 * seed + r) for r in range(6)], costs, 64, rule=rule)
        best = max(fixed, key=lambda k: rate(fixed[k]))
        out.append(auto[0].rate / fixed[best][0].rate)
    return out


@pytest.mark.parametrize("costs", [WIDE_AMD, WIDE, F16])
def test_a_cold_policy_drafts_long_within_a_few_rounds_when_nearly_everything_is_accepted(costs):
    """A freshly loaded engine knows nothing of a lossy rule's acceptance but its prior: the first plain steps'
    rows, scored when the draft catches up, show it accepts nearly everything, and the policy drafts long."""
    for seed in range(10):
        res, _ = run_auto(trace(0.98, 200, seed), costs, 64, rule=FSD)
        first_long = next(i for i, k in enumerate(res.ks) if k >= 6)
        assert first_long <= 6 and res.probed <= 8, res.ks
        assert all(k >= 4 for k in res.ks[first_long : first_long + 4]), res.ks  # and goes on drafting long
    ratios = first_reply_ratios(costs, 0.98, rule=FSD)
    assert sum(ratios) / len(ratios) >= 0.9, ratios


@pytest.mark.parametrize("costs", [WIDE_AMD, WIDE, F16, Q4_1])
def test_a_cold_policy_settles_on_plain_steps_within_a_few_rounds_when_nothing_is_accepted(costs):
    for seed in range(10):
        auto, fixed = session([trace(0.02, 200, 10 * seed + r) for r in range(6)], costs, 64)
        assert sum(1 for k in auto[0].ks if k) <= 8, auto[0].ks  # a few rounds, then plain steps for good
        assert all(k == 0 for r in auto[1:] for k in r.ks), [r.ks for r in auto]
        # looked a few times, early, while a look was cheap: in the first two replies, at most one catch-up's kept
        # rows in all (sd's prior of 0.5 drafts 4 rounds and scores 9-13 positions where 0.7 drafted 6-8 and scored
        # 5-10: 0.995 of ar against 0.990 on WIDE)
        assert sum(r.probed for r in auto) <= ROWS_KEPT and not any(r.probed for r in auto[2:])
        assert rate(auto) >= 0.985 * rate(fixed[0]), (rate(auto), rate(fixed[0]))


def test_no_acceptance_makes_a_draft_that_costs_half_a_target_step_worth_probing():
    """On the Q4_1 demo the draft costs more than half a target decode: even a draft that is always accepted
    cannot pay, so the policy neither drafts nor pays a catch-up to look."""
    res, _ = run_auto(trace(0.99, 200, 1), Q4_1, 64)
    assert res.ks == [0] * 64 and res.probed == 0


@pytest.mark.parametrize("costs", [WIDE_AMD, WIDE, F16])
@pytest.mark.parametrize("a", [0.3, 0.7, 0.9])
def test_the_first_reply_of_a_fresh_engine_is_within_0_9_of_the_best_fixed_k(costs, a):
    """The issue's goal, on generated traces of each kind of host and acceptance."""
    ratios = first_reply_ratios(costs, a)
    assert sum(ratios) / len(ratios) >= 0.9, ratios


def test_sizes_measured_as_they_are_used_cost_little_against_measuring_them_all_first():
    """A policy that knows only the sizes it has used prices the others from a fitted line (a compute-bound slope
    prior while one size is known); its optimism while evidence is thin makes it try the long drafts, and so the
    tiled target's cheap batch of 8 (k = 7), in short sessions like the issue's 2 prompts x 96 tokens. Uncalibrated,
    the first round times a plain step (every k is priced against it) and the drafts that follow find the dip at 8
    only by chance (0.886 of the best here; 0.94 before that first plain step, which cost a real host 7%)."""
    from fsd_local.drafting.length import DraftLength

    ratio = {}
    for cal in (True, False):
        tok, sec = 0, 0.0
        for seed in range(20):
            lengths = measured(WIDE) if cal else DraftLength()
            for r in range(2):
                res, lengths = run_auto(trace(0.92, 300, 1000 * seed + r), WIDE, 96, lengths=lengths)
                tok, sec = tok + res.tokens, sec + res.seconds
        ratio[cal] = tok / sec
    best = sum(run_fixed(trace(0.92, 300, 1000 * s + r), WIDE, 96, 7).rate for s in range(20) for r in range(2)) / 40
    assert ratio[True] >= 0.95 * best and ratio[False] >= 0.87 * best, (ratio, best)


def test_cold_prior_resists_two_rejections_on_a_realistic_target():
    cm = CostModel(16)
    for n in range(1, 18):
        cm.observe_verify(n, WIDE.v(n))
    cm.observe_draft(1, WIDE.draft)
    cm.observe_acceptance(1, 0)
    cm.observe_acceptance(1, 0)
    assert cm.choose_k() >= 1  # 0.75-acceptance pairs do this 6% of the time: not evidence enough to stop


def _run(stats_over=None, **kw):
    st = {
        "drafted": 0,
        "rounds": 1,
        "drafted_by_position": [],
        "accepted_by_position": [],
        "seconds": {"draft": 0.0, "target": 1.0, "other": 0.0},
        "verify_by_batch": [],
    }
    st.update(kw)
    return Run(0, 0, [1], st, None)


def test_oracle_prices_every_fixed_k_with_measured_costs_and_acceptance():
    """Survival by position 0.9, 0.81, 0.73, 0.66; draft 10 ms a token; batches measured at 1, 2 and 5 only
    (3 and 4 interpolated); the loop's own time 1 ms a round."""
    runs = [
        _run(
            drafted=40,
            rounds=10,
            drafted_by_position=[10, 10, 10, 10],
            accepted_by_position=[9, 8.1, 7.29, 6.561],
            seconds={"draft": 0.4, "target": 1.0, "other": 0.01},
            verify_by_batch=[[5, 10, 1.0]],
        ),
    ]
    ar = [_run(verify_by_batch=[[1, 10, 0.5], [2, 2, 0.12]])]
    curve = verify_curve([ar, runs], 5)
    assert curve[1:] == pytest.approx([0.05, 0.06, 0.07333, 0.08667, 0.1], rel=1e-3)
    o = oracle(runs, curve)
    want = [1 / 0.051]
    e = 1.0
    for k, surv in enumerate([0.9, 0.81, 0.729, 0.6561], start=1):
        e += surv
        want.append(e / (k * 0.01 + curve[k + 1] + 0.001))
    assert o["by_k"] == pytest.approx(want)
    assert o["k"] == want.index(max(want)) and o["tokens_per_second"] == max(want)
    assert oracle([_run()], curve) is None  # drafted nothing: no acceptance to price


def test_auto_is_the_default_policy_everywhere(tiny_pair):
    from click.testing import CliRunner

    from fsd_local import Engine
    from fsd_local.cli import cli
    from fsd_local.server.openai_schema import ChatRequest

    s = Settings()
    assert (s.draft_policy, s.draft_max) == ("auto", 16)
    with Engine(target=tiny_pair[1], draft=tiny_pair[0], n_ctx=512, n_threads=1) as eng:  # the Python API
        assert (eng.defaults.draft_policy, eng.defaults.draft_max) == ("auto", 16)
        out = eng.generate("the cat", max_tokens=8, mode="sd")
        assert out.settings["draft_policy"] == "auto" and out.settings["draft_max"] == 16
    for command in ("generate", "chat", "serve"):  # the CLI's options come from the settings
        params = {p.name: p for p in cli.commands[command].params}
        assert params["draft_policy"].default == "auto" and params["draft_max"].default == 16, command
    help_text = CliRunner().invoke(cli, ["bench", "--help"]).output
    assert "default: auto" in help_text and "default: 16" in help_text
    assert all(c.policy in (None, "auto") for c in build_configs(["fsd"], ["js"], [0.2], [16], [0.0]))
    # the server: a request that names no policy gets the engine's defaults
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    assert getattr(req, "draft_policy", None) is None


def test_x_plain_only_from_a_measured_plain_step(tiny_pair, tmp_path, monkeypatch):
    """The summary shows "x plain decoding" only once a single-token target decode was timed on this machine: by
    this engine, or by an earlier one of the same files (its costs kept on disk, drafting/calibration.py)."""
    from fsd_local import Engine

    monkeypatch.setenv("FSD_LOCAL_COSTS", str(tmp_path / "costs.json"))  # a machine that never ran this pair
    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as eng:
        first = eng.generate("the cat", max_tokens=12, mode="sd", draft_policy="fixed", draft_max=3)
        assert first.stats["plain_tokens_per_second_est"] == 0.0
        assert first.stats["speedup_vs_plain_est"] is None
        assert "plain decoding" not in summary_line(first.stats, first.finish_reason)
        eng.generate("the cat", max_tokens=4, mode="ar")  # an earlier reply that timed plain steps
        later = eng.generate("the dog", max_tokens=12, mode="sd", draft_policy="fixed", draft_max=3)
        assert later.stats["speedup_vs_plain_est"] > 0
        assert "x plain decoding" in summary_line(later.stats, later.finish_reason)
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as eng:  # the next engine: the plain rate is known
        out = eng.generate("the cat", max_tokens=12, mode="sd", draft_policy="fixed", draft_max=3)
        assert out.stats["speedup_vs_plain_est"] > 0


def test_settings_seen_before_get_their_evidence_back():
    """A bench alternates configurations on one engine (a chat may switch tau back and forth): the acceptance
    learned under each set of settings is kept for it, not discounted at every switch; new settings start from
    the current evidence, discounted; the target's costs are shared by all."""
    from fsd_local.drafting.length import DraftLength

    dl = DraftLength()
    dl.start(Settings(mode="fsd", tau=0.2, draft_policy="auto"))
    for _ in range(30):
        dl.observe(MODEL, 4, 4, 0.01, 5, 0.05)
    high = dl.cost(MODEL).acceptance()
    dl.start(Settings(mode="sd", draft_policy="auto"))
    assert sum(dl.cost(MODEL)._seen) < 0.2 * 30 * 4  # new settings: the old evidence, discounted
    for _ in range(30):
        dl.observe(MODEL, 4, 0, 0.01, 5, 0.05)
    low = dl.cost(MODEL).acceptance()
    dl.start(Settings(mode="fsd", tau=0.2, draft_policy="auto"))
    assert dl.cost(MODEL).acceptance() == pytest.approx(high)  # its own evidence back, untouched
    assert low[0] < 0.2 < 0.9 < high[0]
    assert dl.cost(MODEL).verify is dl.verify


@pytest.fixture(scope="module")
def costly_pair(tmp_path_factory):
    """(draft, target) with the cost ratio of a real pair: a tiny draft and an F16 target of 34M
    parameters (8 layers, width 512) over the same vocabulary, unrelated weights (sd accepts almost nothing)."""
    import numpy as np

    from support.tinymodels import write_tiny_gguf

    d = tmp_path_factory.mktemp("costly")
    target = write_tiny_gguf(d / "target.gguf", seed=2, n_embd=512, n_layer=8, n_head=8, n_ff=2048, dtype=np.float16)
    return str(write_tiny_gguf(d / "draft.gguf", seed=1)), str(target)


# the seconds the costly pair's policy sees (DraftLength.prices) instead of the ones it measures, so that what it
# decides hangs on the models' acceptance alone, never on the host's load (COSTLY_MS: timed once on the AMD host)
COSTLY = Costs([0.0] + [ms * MS for ms in COSTLY_MS], draft=COSTLY_DRAFT_MS * MS, catch_up=COSTLY_CATCH_UP_MS * MS)


def costly_engine(costly_pair, tmp_path, monkeypatch):
    """A freshly loaded engine of the costly pair on a machine that never ran it (an empty cost store of its own),
    its policy priced with COSTLY."""
    from fsd_local import Engine

    monkeypatch.setenv("FSD_LOCAL_COSTS", str(tmp_path / "costs.json"))
    d, t = costly_pair
    eng = Engine(target=t, draft=d, n_ctx=512, n_threads=2)
    eng.policy.length.prices = COSTLY
    return eng


def test_a_fresh_engine_finds_what_a_rule_that_accepts_everything_buys(costly_pair, tmp_path, monkeypatch):
    """The issue's case on real models: a freshly loaded engine, fsd with a js tau above ln 2 (every draft is
    accepted), the default auto policy. Its prior is sd's, at which plain steps may win; the first plain steps
    are scored when the draft catches up, and it drafts long within a few rounds."""
    with costly_engine(costly_pair, tmp_path, monkeypatch) as eng:
        out = eng.generate("the cat sat", max_tokens=48, mode="fsd", tau=0.7, draft_max=8)
    hist, st = out.stats["k_histogram"], out.stats
    assert st["acceptance_rate"] == 1.0 and st["fuzzy_share"] > 0.9
    assert hist[0] <= 4 and sum(hist[4:]) >= sum(hist) - hist[0] - 2, hist  # a few plain steps, then long drafts
    assert st["probed"] <= 6


def test_a_fresh_engine_settles_on_plain_steps_when_the_draft_is_never_accepted(costly_pair, tmp_path, monkeypatch):
    """sd on a pair that accepts ~0.1 (unrelated weights) over a memory-bound target: it measures the draft in a
    few rounds, then decodes plainly, and what it learned stays for the next reply."""
    with costly_engine(costly_pair, tmp_path, monkeypatch) as eng:
        out = eng.generate("the cat sat", max_tokens=48, mode="sd")
        again = eng.generate("a dog ran", max_tokens=48, mode="sd")
    hist = out.stats["k_histogram"]
    assert out.stats["acceptance_rate"] < 0.2 and out.stats["drafted"] > 0, out.stats
    assert sum(hist[1:]) <= 4 and hist[0] >= 40, hist  # a few drafting rounds of 47, then plain steps
    assert sum(again.stats["k_histogram"][1:]) <= 2, again.stats["k_histogram"]


# the costly pair's target steps with a draft token at 0.7 of one (the Q4_1 demo's ratio): no acceptance pays
DEAR = Costs(COSTLY.verify, draft=0.7 * COSTLY.verify[1], catch_up=0.35 * COSTLY.verify[1])


def test_where_plain_steps_win_the_draft_model_does_not_evaluate_the_next_prompt(costly_pair, tmp_path, monkeypatch):
    """From an empty store the first reply's draft evaluates its prompt (that batch prices its tokens) and the
    policy takes plain steps; from then on a new prompt is text the draft skipped, so a reply where plain decoding
    wins runs the target alone, as `ar` does (issue 37: each new chat's draft prompt cost auto ~10% on Q4_1)."""
    with costly_engine(costly_pair, tmp_path, monkeypatch) as eng:
        eng.policy.length.prices = DEAR
        first = eng.generate("the cat sat", max_tokens=24, mode="sd")
        assert len(eng.draft.tokens) >= first.prompt_tokens - 1 and sum(first.stats["k_histogram"][1:]) == 0
        spent, held = eng.draft.decode_seconds, list(eng.draft.tokens)
        again = eng.generate("a dog ran far away", max_tokens=24, mode="sd")
        assert sum(again.stats["k_histogram"][1:]) == 0, again.stats["k_histogram"]
        assert eng.draft.decode_seconds == spent and eng.draft.tokens == held[: len(eng.draft.tokens)]
        assert again.token_ids == eng.generate("a dog ran far away", max_tokens=24, mode="ar").token_ids


RULES = {"sd": SD, "fsd": FSD}  # the settings the recorded traces were scored under (fsd: js tau 0.2)


def recorded(rule: str) -> list[list[bool]]:
    """Teacher-forced traces of the wide demo pair on 10 chat prompts (benchmarks/record_traces.py): sd accepts
    where the draft's greedy pick is the target's (0.73-0.91 per prompt), fsd js 0.2 also where js <= 0.2 (0.98+)."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "traces-wide.json").read_text())
    tau = {"sd": -1.0, "fsd": 0.2}[rule]
    return [[bool(sd) or js <= tau for sd, js in t] + [False] * 20 for t in data["traces"]]


@pytest.mark.parametrize("rule", ["sd", "fsd"])
@pytest.mark.parametrize("costs", [WIDE_AMD, WIDE], ids=["amd", "intel"])
def test_auto_on_recorded_traces_of_the_wide_pair(rule, costs):
    """The issue's goals on the pair's own traces and each host's measured costs: over a session of fresh-engine
    replies auto reaches >= 0.97 of the best of ar and every fixed k, and its first reply >= 0.9 of that best."""
    traces = [t for t in recorded(rule) if len(t) >= 84]
    auto, fixed = session(traces, costs, 64, rule=RULES[rule])
    best = max(fixed, key=lambda k: rate(fixed[k]))
    assert rate(auto) >= 0.97 * rate(fixed[best]), (rate(auto), best, rate(fixed[best]))
    assert auto[0].rate >= 0.9 * fixed[best][0].rate, (auto[0].ks, best)


@pytest.mark.parametrize("rule", ["sd", "fsd"])
def test_a_fresh_engine_without_stored_costs_on_recorded_traces_of_the_wide_pair(rule):
    """Issue 37's goals from an EMPTY cost store (a new install: nothing timed, the draft's cost read off the
    prompt it evaluates), on the pair's own traces and the wide target's measured costs: over the session auto
    reaches >= 0.97 of the best of ar and every fixed k, and fsd's first reply >= 0.9 of the best's first reply
    (it times the batches it needs as it goes: sd's first reply pays more for that, its best being ar)."""
    traces = [t for t in recorded(rule) if len(t) >= 84]
    for start in (0, 2):
        auto, fixed = session(traces[start : start + 6], WIDE_17, 64, stored=False, prompt=40, rule=RULES[rule])
        best = max(fixed, key=lambda k: rate(fixed[k]))
        assert rate(auto) >= 0.97 * rate(fixed[best]), (rate(auto), best, rate(fixed[best]))
        if rule == "fsd":
            assert auto[0].rate >= 0.9 * fixed[best][0].rate, (auto[0].ks, best)
            assert max(auto[0].ks) >= 12, auto[0].ks  # long drafts in the first reply


@pytest.mark.parametrize("a", [0.3, 0.9, 0.99])
def test_where_plain_decoding_wins_a_fresh_engine_never_drafts(a):
    """The Q4_1 demo target: its draft costs 0.7 of a target step, so no acceptance makes drafting pay. From an
    empty store the draft's prompt prices it, and the policy takes plain steps from the first round on: auto
    costs nothing against ar (issue 37: 0.81x before)."""
    auto, fixed = session([trace(a, 200, seed) for seed in range(3)], Q4_1_17, 64, stored=False, prompt=40)
    assert all(k == 0 for r in auto for k in r.ks) and not any(r.probed for r in auto)


@pytest.mark.parametrize("costs", [WIDE_17, WIDE_AMD], ids=["amd17", "amd"])
def test_two_early_rejections_do_not_keep_a_lossy_rule_from_drafting_for_a_session(costs):
    """The wide pair's fsd traces 4-9 (0-based; 3 is too short), the first rejecting at its 9th and 11th
    positions: from an EMPTY store, with sd's acceptance prior the policy fell to plain steps after three rounds and
    never drafted again (0.686 of the best fixed k over six replies with WIDE_17, 0.509 with WIDE_AMD). A lossy
    rule's prior is higher, so those rejections leave it drafting: >= 0.97 of the best fixed k, long drafts in
    every reply."""
    traces = [t for t in recorded("fsd") if len(t) >= 84][3:9]
    auto, fixed = session(traces, costs, 64, stored=False, prompt=40, rule=FSD)
    best = max(fixed, key=lambda k: rate(fixed[k]))
    assert rate(auto) >= 0.97 * rate(fixed[best]), ([r.ks for r in auto], best)
    assert all(sum(1 for k in r.ks if k >= 8) >= 2 for r in auto), [r.ks for r in auto]
    # the same session under sd's prior falls short: it locks into plain steps (WIDE_17: 0.69 of the best), or
    # drafts again only after a look on thin evidence (WIDE_AMD: 0.96; 0.52 before looks counted a next reply)
    sd_prior, _ = session(traces, costs, 64, stored=False, prompt=40, rule=SD)
    assert rate(sd_prior) < 0.97 * rate(fixed[best]), [r.ks for r in sd_prior]


def test_the_acceptance_prior_follows_the_rule():
    """Lossless rules (sd, a lossy mode at tau 0) start from a coin flip, lossy ones (tau > 0 or a quality budget)
    from ACCEPT_PRIOR_LOSSY; a switch of rule moves the prior of the evidence kept."""
    from fsd_local.drafting.length import ACCEPT_PRIOR_LOSSLESS, ACCEPT_PRIOR_LOSSY, DraftLength, accept_prior

    assert ACCEPT_PRIOR_LOSSLESS < ACCEPT_PRIOR_LOSSY
    assert accept_prior(Settings(mode="sd")) == accept_prior(Settings(mode="fsd")) == ACCEPT_PRIOR_LOSSLESS
    for s in (Settings(mode="fsd", tau=0.2), Settings(mode="typical", tau=0.5), Settings(quality_budget=0.15)):
        assert accept_prior(s) == ACCEPT_PRIOR_LOSSY, s
    dl = DraftLength()
    dl.start(Settings(mode="sd", draft_policy="auto"))
    assert dl.cost(MODEL).pooled()[0] == pytest.approx(ACCEPT_PRIOR_LOSSLESS)
    dl.start(Settings(mode="fsd", tau=0.2, draft_policy="auto"))
    assert dl.cost(MODEL).pooled()[0] == pytest.approx(ACCEPT_PRIOR_LOSSY)


@pytest.mark.parametrize("costs", [WIDE_17, WIDE_AMD, near(58)], ids=["amd17", "amd", "near58"])
def test_fsd_from_an_empty_store_over_random_orders_of_the_recorded_replies(costs):
    """Issue 37's goal 1 for fsd js 0.2 on the simulator: over 10 random orders of 6 recorded replies, each session
    from an EMPTY store reaches >= 0.95 of the best fixed k (0.97 on average) and its first reply 0.9 on average
    (sd's acceptance prior for every rule: worst 0.50-0.68, the lock-in above)."""
    res = orders([t for t in recorded("fsd") if len(t) >= 84], costs, FSD, n=10)
    session_ratios, first = [r[0] for r in res], [r[1] for r in res]
    assert min(session_ratios) >= 0.95 and sum(session_ratios) / 10 >= 0.97, session_ratios
    assert sum(first) / 10 >= 0.9, first


def test_a_look_on_thin_evidence_counts_the_next_reply_too():
    """sd's first draft of an engine rejected at its first position leaves 0.33 on 3 positions of evidence: a look's
    value then counts most of a next reply as long as this one, settled evidence (32+ positions) this reply alone.
    Where k = 3 beats ar by 12% (a 62 ms plain step), sessions from an EMPTY store over 20 random orders of the
    recorded replies reach 0.95 of the best on average (0.915 with this reply alone: plain steps for the session)."""
    from fsd_local.drafting.length import NEXT_REPLY_EVIDENCE, DraftLength

    dl = DraftLength()
    dl.start(SD.with_(draft_max=16))
    cm = dl.cost(MODEL)
    cm.observe_acceptance(2, 0)
    dl.written = 20
    assert cm.pooled() == pytest.approx((1 / 3, 3.0))
    assert dl.look_horizon(44, cm) == pytest.approx(44 + (1 - 3 / NEXT_REPLY_EVIDENCE) * 64)
    for _ in range(12):
        cm.observe_acceptance(4, 3)
    assert cm.pooled()[1] >= NEXT_REPLY_EVIDENCE and dl.look_horizon(44, cm) == 44
    res = orders([t for t in recorded("sd") if len(t) >= 84], near(62), SD, n=20)
    assert sum(r[0] for r in res) / 20 >= 0.94, [round(r[0], 3) for r in res]
