"""One round as a unit (round.py), driven through the engine's public `generation`: a proposal in, emitted
tokens out, the caches cut back to the accepted text; the hot path allocates no row-sized memory per round; and
the first request is not kept waiting by measure_costs (drafting/calibration.py)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from numba import njit

from fsd_local import Engine
from fsd_local.drafting.proposer import MODEL, DraftPicks
from fsd_local.kernels.accept import accept_round
from fsd_local.kernels.emit import emit_one
from fsd_local.kernels.sampling import pick_kept, pick_kept_copy
from fsd_local.kernels.typed import decoded
from fsd_local.round import Proposal, RoundContext, verify
from fsd_local.settings import Settings


@njit
def _head_sum(x, n):
    return x[:n].sum()


def _propose(ctx: RoundContext, tokens: list[int]) -> Proposal:
    """A proposal of these tokens, as if drafted by the draft model (written into the context's buffers)."""
    d = ctx.buffers.drafts
    for i, t in enumerate(tokens):
        d.tokens[i], d.prob[i], d.onehot[i] = t, 1.0, 0
    return Proposal(len(tokens), MODEL, len(tokens), 0.0)


def test_a_proposal_in_emitted_tokens_out_and_the_caches_cut_back(tiny_engine):
    """Greedy sd: drafts that are the target's own tokens are accepted, the first wrong one is replaced by the
    target's token, nothing after it is kept; both caches then hold a prefix of the accepted text."""
    ar = tiny_engine.generate("the cat sat", mode="ar", max_tokens=12).token_ids
    with tiny_engine.generation("the cat sat", mode="sd") as g:
        wrong = (ar[2] + 1) % tiny_engine.n_vocab
        step = verify(tiny_engine.target, g.ctx, _propose(g.ctx, [ar[0], ar[1], wrong, ar[3]]))
        assert step.accepted == 2 and step.emitted.tokens == ar[:3]
        assert step.emitted.origins == ["sd", "sd", "target"] and step.batch == 5
        assert step.seconds > 0 and step.rows.shape == (5, tiny_engine.target.n_vocab)
        before = list(g.seq)
        finish, piece = g.advance(step)
        assert finish is None and piece is not None and piece.token_ids == ar[:3]
        assert g.seq == before + ar[:3]
        tgt = tiny_engine.target.tokens
        assert tgt == g.seq[: len(tgt)] and len(tgt) == len(g.seq) - 1  # the rejected drafts are gone
        assert tiny_engine.draft.tokens == g.seq[: len(tiny_engine.draft.tokens)]
        # the next round goes on from there: a full accept emits the bonus token too
        step = verify(tiny_engine.target, g.ctx, _propose(g.ctx, ar[3:6]))
        assert step.accepted == 3 and step.emitted.tokens == ar[3:7] and step.emitted.origins[-1] == "target"


def test_rounds_driven_by_hand_write_the_targets_own_text(tiny_engine):
    """Whatever is proposed, greedy sd emits what ar writes (the tiny models are F32: ids compare exactly)."""
    ar = tiny_engine.generate("we ran far", mode="ar", max_tokens=30, ignore_eos=True).token_ids
    rng = np.random.default_rng(0)
    out: list[int] = []
    with tiny_engine.generation("we ran far", mode="sd", ignore_eos=True) as g:
        while len(out) < 30:
            k = min(int(rng.integers(0, 5)), 29 - len(out))
            guess = [ar[len(out) + i] if rng.random() < 0.6 else int(rng.integers(3, 259)) for i in range(k)]
            step = verify(tiny_engine.target, g.ctx, _propose(g.ctx, guess))
            g.advance(step)
            out += step.emitted.tokens
    assert out[:30] == ar


@pytest.fixture(scope="module")
def wide_vocab_pair(tmp_path_factory):
    """A tiny pair over a 65,536-token vocabulary: one logit row is 256 KiB, so copying or allocating a row per
    round stands out from the round's Python objects and the kernels' small candidate lists (top-k's)."""
    from support.tinymodels import WORDS, write_tiny_gguf

    words = WORDS + [f"▁w{i}" for i in range(65536 - 259 - len(WORDS))]
    d = tmp_path_factory.mktemp("widevocab")
    return (
        str(write_tiny_gguf(d / "draft.gguf", seed=1, words=words)),
        str(write_tiny_gguf(d / "target.gguf", seed=2, noise=0.1, words=words)),
    )


SETTINGS = {
    "greedy sd": {"mode": "sd"},
    "greedy fsd": {"mode": "fsd", "tau": 0.3},
    "a temperature alone, sd": {"mode": "sd", "temperature": 0.7},  # OpenAI's API: untruncated rows
    "a temperature alone, fsd": {"mode": "fsd", "tau": 0.3, "temperature": 0.7},
    "chat defaults": {
        "mode": "sd",
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "repeat_penalty": 1.1,
    },
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_no_row_sized_allocation_on_the_hot_path(wide_vocab_pair, name):
    """Count what a round allocates (tracemalloc sees NumPy's buffers): after the first rounds, no round's peak
    of new memory comes near one logit row. The call's own buffers (the chain, the round buffers) are set up
    before its first round and reused."""
    d, t = wide_vocab_pair
    row_bytes = 4 * 65536
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=4) as eng:
        eng.generate("the cat", max_tokens=8, **SETTINGS[name])  # buffers, kernels, caches: all warm
        import fsd_local.generation as G

        peaks: list[int] = []
        advance = G.Generation.advance

        def measured(self, step):
            current, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - current)
            out = advance(self, step)
            tracemalloc.reset_peak()
            return out

        tracemalloc.start()
        try:
            G.Generation.advance = measured
            eng.reset()
            tracemalloc.reset_peak()
            out = eng.generate("the cat sat on", max_tokens=40, seed=1, ignore_eos=True, **SETTINGS[name])
        finally:
            G.Generation.advance = advance
            tracemalloc.stop()
    assert out.stats["rounds"] == len(peaks) >= 8
    assert max(peaks[1:]) < row_bytes // 4, (name, peaks)


def test_the_first_request_decodes_only_what_it_uses_and_the_next_engine_starts_from_its_costs(
    tiny_pair, tmp_path, monkeypatch
):
    """No measure_costs inside a request: a fresh engine's first auto reply decodes the target only for its own
    rounds (every batch it timed is one of them); the sizes it measured are on disk for the next engine."""
    monkeypatch.setenv("FSD_LOCAL_COSTS", str(tmp_path / "costs.json"))  # a machine that never ran this pair
    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as eng:
        assert not _measured(eng)
        out = eng.generate("the cat sat", mode="sd", max_tokens=24)
        used = {n for n, _, _ in out.stats["verify_by_batch"]}
        assert sum(c for _, c, _ in out.stats["verify_by_batch"]) == out.stats["target_calls"]
        assert _measured(eng) == used
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as again:
        assert used <= _measured(again)
    with Engine(target=t, draft=d, n_ctx=512, n_threads=2) as other:  # another thread count is another machine
        assert not _measured(other)


def _measured(eng: Engine) -> set[int]:
    """The target batch sizes the engine's policy has timed (or restored from the store)."""
    return {int(n) for n in eng.policy.costs()["sizes"]}


def test_a_broken_cost_store_is_measured_afresh(tiny_pair, tmp_path, monkeypatch):
    store = tmp_path / "costs.json"
    store.write_text("{not json")
    monkeypatch.setenv("FSD_LOCAL_COSTS", str(store))
    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as eng:
        out = eng.generate("the cat", mode="sd", max_tokens=6, settings=Settings())
    assert out.finish_reason in ("stop", "length")
    assert "sizes" in next(iter(__import__("json").loads(store.read_text()).values()))


def test_engines_side_by_side_keep_each_others_sizes_and_an_entry_without_a_plain_step_is_not_restored(
    tiny_pair, tmp_path, monkeypatch
):
    """Two engines of one pair, open together, each decoding other batch sizes: the store keeps the union (the
    second save does not drop the first's sizes). An entry that lacks the one-token size is not restored (a plain
    step's price read off the larger batches misprices every k): the next engine starts as a fresh one."""
    import json

    store = tmp_path / "costs.json"
    monkeypatch.setenv("FSD_LOCAL_COSTS", str(store))
    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as a, Engine(target=t, draft=d, n_ctx=512, n_threads=1) as b:
        a.generate("the cat sat", mode="ar", max_tokens=6)  # one-token decodes
        b.generate("the cat sat", mode="sd", max_tokens=12, draft_policy="fixed", draft_max=3)  # batches of 4
    (entry,) = json.loads(store.read_text()).values()
    assert {"1", "4"} <= set(entry["sizes"]), entry
    data = json.loads(store.read_text())
    for e in data.values():
        del e["sizes"]["1"]
    store.write_text(json.dumps(data))
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as fresh:
        assert not _measured(fresh)


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, {"temperature": 0.0}, {"temperature": 0.8, "top_k": 40}])
def test_the_kernels_typed_once_decide_as_the_dispatched_ones(tiny_engine, sampling):
    """The round's kernels called through entry points typed once per context (kernels/typed.py: accept_round,
    emit_one, the draft's picks) decide exactly as numba's dispatch of the same kernels on the same rows, drafts
    and uniforms; rows of another type (not a decode's) go through the dispatcher."""
    with tiny_engine.generation("the cat sat", mode="fsd", tau=0.3, divergence="js", seed=3, **sampling) as g:
        ctx, n = g.ctx, g.ctx.n_vocab
        rng = np.random.default_rng(1)
        picks = DraftPicks(ctx, n, 3)
        base = rng.standard_normal(n).astype(np.float32) * 3
        for _ in range(3):  # draft rows near the target's: some slots pass the SD test, some are rescued or not
            picks.pick((base + rng.standard_normal(n).astype(np.float32)).copy())
        assert len(ctx.typed) == 1  # the pick, typed at its first call and reused
        d = ctx.buffers.drafts
        x, s = base + rng.standard_normal(n).astype(np.float32), ctx.sampling
        sampled = (s.temperature, s.top_k, s.top_p, s.min_p)
        stats, kept = np.zeros(3, np.float32), np.empty(d.kept.shape[1], np.int64)
        for kernel in (pick_kept, pick_kept_copy):
            args = (n, *sampled, 0.4, stats, kept, True) + (
                (d.rows[3 % len(d.rows)],) if kernel is pick_kept_copy else ()
            )
            assert ctx.typed.call(kernel, x.copy(), *args, d.summary) == kernel(x.copy(), *args, d.summary)
        P = np.stack([base + 0.5 * rng.standard_normal(n).astype(np.float32) for _ in range(4)])
        out, args = ctx.buffers.out, (ctx.n_vocab, ctx.rule, ctx.sampling)
        typed = len(ctx.typed)
        for seed in range(20):
            u = np.random.default_rng(seed).random(4)
            got = ctx.typed.call(accept_round, P.copy(), d, 3, *args, u, out, ctx.budget)
            got = got, out.reason[:3].copy(), out.divergence[:3].copy()
            want = accept_round(P.copy(), d, 3, *args, u, out, ctx.budget), out.reason[:3], out.divergence[:3]
            assert got[0] == want[0]
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[2], want[2])
            x = P[seed % 4]
            once = ctx.typed.call(emit_one, x, n, ctx.sampling, u[0], ctx.buffers.row_stats, out)
            np.testing.assert_array_equal(once, emit_one(x, n, ctx.sampling, u[0], ctx.buffers.row_stats, out))
        assert len(ctx.typed) == typed + 2  # accept_round and emit_one, once each
        strided = np.repeat(P[0], 2)[::2]  # rows of another type than a decode's: through the dispatcher
        assert ctx.typed.call(_head_sum, strided, 7) == _head_sum(P[0].copy(), 7) and len(ctx.typed) == typed + 2
    tiny_engine.generate("the cat", mode="ar", max_tokens=2)
    assert decoded(tiny_engine.target.logits(1)) and decoded(tiny_engine.target.logits(1)[0])
    assert not decoded(P.astype(np.float64)) and not decoded(np.asfortranarray(P)) and not decoded(P[:, ::2])
    ro = P.copy()
    ro.flags.writeable = False
    assert not decoded(ro)
