"""Speculative decoding with models that keep a recurrent state, on tiny F32 GGUFs the suite writes: a hybrid
target rolls a verify batch back by llama.cpp's snapshots, a Mamba target (no snapshots) and every draft (one
token a call) go back to a checkpoint kept in a spare sequence. sd and fsd at tau 0 are exact against ar, each
model's state is the accepted text after every round, and sampled sd keeps the target's distribution
(docs/design.md, "Models with a recurrent state")."""

from __future__ import annotations

import subprocess
import sys

import llama_cpp as lc
import numpy as np
import pytest
from test_engine import ALPHA, _chisquare_pvalue, _next_logits

from fsd_local import CacheTruncationError, Engine
from fsd_local.llama.kv_cache import check_rewindable
from fsd_local.llama.model import Model, ModelOptions
from support.tinymodels import write_tiny_gguf, write_tiny_lfm2_gguf, write_tiny_mamba_gguf

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = ["the fox walks at night", "we ran far away, very far", "a", "the cat sat on the mat"]
K = 4
# A state rewound right equals a fresh context's that evaluated the same text in the same decode calls (F32, one
# thread: to the last bit here); in other calls llama.cpp's sums round differently, by up to ~6e-4 on these models
# (test_engine.py allows 2e-2 for the tiny llamas). A state one token off moves the logits by more than 1
# (test_a_rollback_past_the_last_call...)
SAME_CALLS = 1e-5
OTHER_CALLS = 2e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models of one vocabulary: two LFM2 (hybrid) that agree about half the time, a llama and an LFM2 and
    two Mamba that share its token embeddings and output (weak blocks: they agree often), and a Mamba of its own."""
    d = tmp_path_factory.mktemp("rewind")
    llama = write_tiny_gguf(d / "llama.gguf", seed=2, block_scale=0.1)
    paths = {
        "hybrid_target": write_tiny_lfm2_gguf(d / "lfm2-t.gguf", seed=2, noise=0.06),
        "hybrid_draft": write_tiny_lfm2_gguf(d / "lfm2-d.gguf", seed=1),
        "llama": llama,
        "hybrid_like_llama": write_tiny_lfm2_gguf(d / "lfm2-l.gguf", seed=3, lexicon_of=llama, block_scale=0.1),
        "mamba": write_tiny_mamba_gguf(d / "mamba.gguf"),
        "mamba_like_llama": write_tiny_mamba_gguf(d / "mamba-l.gguf", n_embd=64, lexicon_of=llama, block_scale=0.3),
        "mamba_draft": write_tiny_mamba_gguf(d / "mamba-d.gguf", seed=3, n_embd=64, lexicon_of=llama, block_scale=0.3),
    }
    return {name: str(p) for name, p in paths.items()}


def _model(path: str, role: str = "target", **opts) -> Model:
    return Model(ModelOptions(path, n_ctx=256, n_threads=1, n_gpu_layers=0, **opts), role)


def _fresh_logits(path: str, *calls: list[int]) -> np.ndarray:
    """The last logits of a fresh context that decoded `calls`, one llama_decode each."""
    m = _model(path)
    try:
        for c in calls:
            m.decode(c, "last")
        return m.logits(1)[0].copy()
    finally:
        m.close()


def test_snapshots_are_sized_to_the_largest_proposal_and_the_draft_keeps_a_spare(models):
    with Engine(target=models["hybrid_target"], draft=models["hybrid_draft"], n_ctx=256, n_threads=1, draft_max=6) as e:
        assert lc.llama_n_rs_seq(e.target.ctx) == e.target.n_rs_seq == 7  # its drafts and one
        assert e.target.rollback_max == 7
        assert lc.llama_n_seq_max(e.draft.ctx) == 2 and e.draft.n_seq == 1  # sequence 0 and its checkpoint's
        assert e.draft.n_rs_seq == 0 and e.draft.rewinds
    with Engine(target=models["llama"], draft=models["mamba"], n_ctx=256, n_threads=1) as e:
        assert e.target.n_rs_seq == 0 and e.target.rollback_max == e.target.n_ctx  # a transformer: no snapshots
        assert lc.llama_n_seq_max(e.target.ctx) == 1
        assert lc.llama_n_seq_max(e.draft.ctx) == 2 and e.draft.rewinds  # Mamba: no snapshots, a checkpoint
        assert not e.policy.length.verify.redecode  # a transformer target decodes nothing again
    with Engine(target=models["mamba_like_llama"], draft=models["llama"], n_ctx=256, n_threads=1) as e:
        assert e.target.n_rs_seq == 0 and lc.llama_n_seq_max(e.target.ctx) == 2  # asked for snapshots, got a spare
        assert e.target.rewinds and e.target.redecodes and e.target.rollback_max == e.target.n_ctx
        assert e.policy.length.verify.redecode  # the policy prices what a rejection decodes again


TARGETS = {"hybrid": "hybrid_target", "recurrent": "mamba_like_llama"}  # snapshots; a checkpoint (no snapshots)


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("j", range(K + 1))
def test_a_rejection_at_every_position_leaves_both_states_at_the_accepted_text(models, kind, j):
    """One round by hand as the engine runs it: the draft decodes its drafts one a call, the target verifies them
    in one batch; the first j are accepted and the target's own token follows. Each model's next logits then equal
    a fresh context's on the accepted text."""
    path = models[TARGETS[kind]]
    t = _model(path, n_rs_seq=K + 1, checkpoint=True)  # as the engine loads a target
    d = _model(path, "draft", checkpoint=True)
    snapshots = kind == "hybrid"
    assert (t.n_rs_seq, t.redecodes) == ((K + 1, False) if snapshots else (0, True))
    try:
        text = t.tokenize(PROMPTS[0])
        for m in (t, d):
            m.decode(text[:-1], "none")
        d.decode([text[-1]], "last")
        d.checkpoint()
        drafts = []
        for i in range(K):
            drafts.append(int(np.argmax(d.logits(1)[0])))
            if i < K - 1:  # the last draft is never decoded
                d.decode_one(drafts[-1])
        t.checkpoint()  # as verify() does: where the target has no snapshots, a rejection comes back here
        t.decode([text[-1], *drafts], "from:0")
        target_next = int(np.argmax(t.logits(K + 1)[j]))
        nxt = target_next if j == K else (drafts[j] + 1) % 290  # a token other than draft j: it was rejected
        accepted = text + drafts[:j] + [nxt]
        # rolled back within the verify batch, or back to before it (nothing to roll back when all are accepted)
        assert t.keep_common_prefix(accepted) == (len(text) + j if snapshots or j == K else len(text) - 1)
        # the draft holds its checkpoint's text unless every draft it decoded was accepted
        assert d.keep_common_prefix(accepted) == len(text) + (min(j, K - 1) if j >= K - 1 else 0)
        head, last = text[:-1], text[-1]
        calls = {t: [head, [last, *drafts[:j]], [nxt]]}  # the verify batch rolled back to its first j + 1
        if not snapshots and j < K:  # back at its checkpoint: the accepted text decoded again, in one call
            calls[t] = [head, [last, *drafts[:j], nxt]]
        if j < K - 1:  # the draft back at its checkpoint: what it drafted past it decoded again, in one call
            calls[d] = [head, [last], [*drafts[:j], nxt]]
        else:  # every draft it decoded was accepted: nothing rewound
            calls[d] = [head, [last], *([x] for x in drafts[: K - 1]), [*drafts[K - 1 : j], nxt]]
        for m in (t, d):
            want = _fresh_logits(path, *calls[m])
            np.testing.assert_allclose(_next_logits(m, accepted), want, rtol=0, atol=SAME_CALLS, err_msg=m.role)
    finally:
        t.close()
        d.close()


def test_a_rollback_past_the_last_call_is_never_asked_of_llama_cpp(models):
    """llama.cpp answers True and keeps a wrong state when the dropped tokens were not all in the last decode call
    (llama-cpp-notes.md): truncate then empties the sequence instead, and the text evaluated again is right."""
    path = models["hybrid_target"]
    m = _model(path, n_rs_seq=K + 1)
    raw = _model(path, n_rs_seq=K + 1)
    try:
        text = m.tokenize(PROMPTS[1])
        for x in (m, raw):
            x.decode(text[:-3], "none")
            for tok in text[-3:]:
                x.decode_one(tok)
        assert m.truncate(len(text) - 2) == 0 and m.tokens == []  # one token a call: no snapshot holds it
        assert lc.llama_memory_seq_rm(raw.mem, 0, len(text) - 2, -1)  # what llama.cpp would have answered
        del raw.tokens[len(text) - 2 :]
        raw.decode_one(text[-2])
        assert np.abs(raw.logits(1)[0] - _fresh_logits(path, text[:-3], *([x] for x in text[-3:-1]))).max() > 1.0
        got = _next_logits(m, text[:-1])  # evaluated again, in one call
        np.testing.assert_allclose(got, _fresh_logits(path, text[:-1]), rtol=0, atol=SAME_CALLS)
        m.decode(text[-1:], "last")
        m.decode([5, 6, 7], "last")  # one call of 3: dropping 2 of them is a snapshot's
        assert m.truncate(len(text) + 1) == len(text) + 1
        want = _fresh_logits(path, text[:-1], text[-1:], [5], [8])
        np.testing.assert_allclose(_next_logits(m, [*text, 5, 8]), want, rtol=0, atol=SAME_CALLS)
    finally:
        m.close()
        raw.close()


PAIRS = {  # (target, draft)
    "hybrid target, transformer draft": ("hybrid_like_llama", "llama"),
    "transformer target, hybrid draft": ("llama", "hybrid_like_llama"),
    "both hybrid": ("hybrid_target", "hybrid_draft"),
    "transformer target, recurrent draft": ("llama", "mamba"),
    "recurrent target, transformer draft": ("mamba_like_llama", "llama"),
    "both recurrent": ("mamba_like_llama", "mamba_draft"),
}


@pytest.mark.parametrize("pair", PAIRS)
def test_greedy_sd_and_fsd_at_tau_0_equal_ar_and_the_states_stay_the_text(models, pair):
    target, draft = (models[n] for n in PAIRS[pair])
    with Engine(target=target, draft=draft, n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=K) as eng:
        accepted_counts = set()
        for prompt in PROMPTS:
            ar = eng.generate(prompt, mode="ar", max_tokens=64, **GREEDY)
            assert len(set(ar.token_ids)) > 4  # varied text
            for mode in ("sd", "fsd"):
                rounds, out, held = [], None, len(eng.tokenize(prompt)) - 1
                for piece in eng.stream(prompt, mode=mode, tau=0.0, max_tokens=64, **GREEDY):
                    rounds.append(len(piece.token_ids))
                    out = piece.completion or out
                    # each rewind went back within the reply (snapshots, a checkpoint), never to an empty state
                    held = min(held, len(eng.target.tokens), len(eng.draft.tokens))
                assert held == len(eng.tokenize(prompt)) - 1, (prompt, mode)
                assert out is not None and out.token_ids == ar.token_ids, (prompt, mode)
                assert out.stats["drafted"] > 0
                accepted_counts |= {n - 1 for n in rounds[:-1] if n}  # the last round may be cut by max_tokens
            seq = eng.tokenize(prompt) + ar.token_ids
            for m in (eng.target, eng.draft):  # after the calls: each state is a prefix of the text
                want = _fresh_logits(m.path, seq)
                np.testing.assert_allclose(_next_logits(m, seq), want, rtol=0, atol=OTHER_CALLS, err_msg=m.role)
        if pair != "transformer target, recurrent draft":  # the Mamba and the llama never agree: all rejected
            assert accepted_counts >= set(range(K + 1)), accepted_counts  # a rejection at each position, and none


SAMPLED = {  # (target, draft) of a few words each: the hybrid target has snapshots, the Mamba one a checkpoint
    "hybrid": lambda d: (
        write_tiny_lfm2_gguf(d / "t.gguf", seed=2, noise=1.0, byte_tokens=False),
        write_tiny_lfm2_gguf(d / "d.gguf", seed=1, byte_tokens=False),
    ),
    "recurrent": lambda d: (
        write_tiny_mamba_gguf(d / "t.gguf", seed=0, byte_tokens=False),
        write_tiny_mamba_gguf(d / "d.gguf", seed=1, byte_tokens=False),
    ),
}


@pytest.mark.parametrize("kind", SAMPLED)
def test_sampled_sd_keeps_the_targets_two_token_distribution(tmp_path, kind):
    """The first two tokens of sampled sd (a round of 3 drafts; after a rejection the second comes from the next
    round, both states rewound) against the target's own p(t1) p(t2 | t1)."""
    t_path, d_path = (str(p) for p in SAMPLED[kind](tmp_path))
    with Engine(target=t_path, draft=d_path, n_ctx=128, n_threads=1, draft_policy="fixed", draft_max=3) as eng:
        prompt = eng.tokenize("the sky")
        n_vocab = eng.n_vocab

        def probs(seq):
            row = _fresh_logits(t_path, seq).astype(np.float64)[:n_vocab]
            p = np.exp(row - row.max())
            return p / p.sum()

        p1 = probs(prompt)
        joint = np.concatenate([p1[a] * probs(prompt + [a]) for a in range(n_vocab)])
        counts = np.zeros(n_vocab * n_vocab, np.int64)
        rejected = 0
        for seed in range(3000):
            out = eng.generate(prompt, mode="sd", max_tokens=4, seed=seed, temperature=1.0, ignore_eos=True)
            counts[out.token_ids[0] * n_vocab + out.token_ids[1]] += 1
            rejected += out.origins[0] == "target"
    assert rejected > 300  # the second token often followed a rewind
    assert _chisquare_pvalue(counts, joint) > ALPHA


def test_a_second_chat_turn_in_sd_reuses_the_first_and_equals_a_fresh_evaluation(models):
    # words only (no control or byte tokens): a reply whose text tokenizes back to its own tokens, as a real
    # model's does
    words = {"mode": "sd", "temperature": 0, "logit_bias": {t: float("-inf") for t in range(3 + 256)}}
    msgs = [{"role": "user", "content": "where does the fox go at night?"}]
    pair = {"target": models["hybrid_target"], "draft": models["hybrid_draft"]}
    with Engine(**pair, n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=K) as eng:
        first = eng.chat(msgs, max_tokens=24, **words)
        msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and the owl?"}]
        second = eng.chat(msgs, max_tokens=24, **words)
        assert second.stats["prompt_evaluated"] < second.stats["prompt_tokens"] - len(first.token_ids)
        assert second.stats["drafted"] > second.stats["accepted_sd"] > 0
        eng.reset()
        again = eng.chat(msgs, max_tokens=24, **words)
        plain = eng.chat(msgs, max_tokens=24, **{**words, "mode": "ar"})
    assert again.stats["prompt_evaluated"] == again.stats["prompt_tokens"]
    assert second.token_ids == again.token_ids == plain.token_ids


@pytest.mark.parametrize("kind", TARGETS)
def test_a_host_copy_of_the_state_takes_a_truncate_back_past_every_snapshot_and_checkpoint(models, kind):
    """keep_state, then decodes one token a call (no snapshot or checkpoint holds the state before them):
    truncating to the copy's length loads it, and the next logits equal a fresh context's on the same calls."""
    path = models[TARGETS[kind]]
    m = _model(path, n_rs_seq=K + 1, checkpoint=True)
    try:
        text = m.tokenize(PROMPTS[1])
        m.decode(text[:-1], "none")
        m.keep_state()
        for tok in text[-1:] + [5, 6, 7]:
            m.decode_one(tok)
        m.checkpoint()  # a spare's checkpoint past the copy: a truncate below it goes to the copy
        m.decode([8, 9], "last")
        assert m.truncate(len(text) - 1) == len(text) - 1 and m.tokens == text[:-1]
        got = _next_logits(m, [*text, 5])
        np.testing.assert_allclose(got, _fresh_logits(path, text[:-1], [text[-1], 5]), rtol=0, atol=SAME_CALLS)
        assert m.truncate(3) == 0 and m.tokens == []  # nothing kept holds 3 tokens or fewer: emptied
    finally:
        m.close()


@pytest.mark.parametrize("target", ["hybrid_target", "mamba_like_llama"])
def test_a_regenerated_reply_and_an_edited_last_message_go_back_to_the_state_kept_for_them(models, target):
    """The state kept at each prompt's end and each reply's end: regenerating a reply evaluates only the prompt's
    last token, editing the last message only what follows the reply before it; each reply equals a fresh
    evaluation's, and the states are the text after."""
    words = {"mode": "sd", "temperature": 0, "logit_bias": {t: float("-inf") for t in range(3 + 256)}}
    pair = {"target": models[target], "draft": models["llama"]}
    with Engine(**pair, n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=K) as eng:
        prompt = eng.tokenize(PROMPTS[0])
        first = eng.generate(prompt, max_tokens=24, **words)
        again = eng.generate(prompt, max_tokens=24, **words)  # regenerated: back to the prompt's end
        assert again.stats["prompt_evaluated"] == 1 and again.token_ids == first.token_ids
        msgs = [{"role": "user", "content": "where does the fox go at night?"}]
        reply = eng.chat(msgs, max_tokens=16, **words)
        msgs += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "and the owl?"}]
        second = eng.chat(msgs, max_tokens=16, **words)
        msgs[-1] = {"role": "user", "content": "and the cat, at dawn?"}  # the last message edited
        edited = eng.chat(msgs, max_tokens=16, **words)
        assert edited.stats["prompt_evaluated"] < edited.stats["prompt_tokens"] - len(reply.token_ids)
        assert second.stats["drafted"] > 0 and edited.stats["drafted"] > 0
        seq = [*eng.target.tokens, 5]  # the state is the text it records
        np.testing.assert_allclose(_next_logits(eng.target, seq), _fresh_logits(models[target], seq), atol=OTHER_CALLS)
        eng.reset()
        fresh = eng.chat(msgs, max_tokens=16, **words)
        assert fresh.stats["prompt_evaluated"] == fresh.stats["prompt_tokens"]
        assert edited.token_ids == fresh.token_ids == eng.chat(msgs, max_tokens=16, **{**words, "mode": "ar"}).token_ids


def test_what_cannot_be_rewound_is_refused_naming_the_model(models):
    m = _model(models["mamba"])  # loaded by hand with neither snapshots nor a checkpoint
    try:
        with pytest.raises(CacheTruncationError) as info:
            check_rewindable([m], "sd")
        msg = str(info.value)
        assert f"target model {models['mamba']} (mamba)" in msg and "neither snapshots nor a checkpoint" in msg
        assert "checkpoint=True" in msg and "mode 'sd'" in msg
    finally:
        m.close()


def test_cli_runs_fsd_with_a_hybrid_pair(models):
    r = subprocess.run(
        [sys.executable, "-m", "fsd_local.cli", "generate", PROMPTS[0], "--threads", "1", "--max-tokens", "16"]
        + ["--target", models["hybrid_target"], "--draft", models["hybrid_draft"], "--tau", "0.4"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "[length] 16 tokens" in r.stderr
