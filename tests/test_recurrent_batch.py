"""Several sequences at once of models that keep a recurrent state, on tiny F32 GGUFs the suite writes: in one
batch decode each sequence goes back to its own spare sequence's checkpoint (snapshots are for one sequence only),
so greedy sd and fsd at tau 0 in a batch of 4 give what ar
gives alone, each sequence's state is its text afterwards, and serve runs such a pair several requests at once
(docs/design.md, "Models with a recurrent state")."""

from __future__ import annotations

import signal
import threading

import llama_cpp as lc
import numpy as np
import openai
import pytest
from test_recurrent_rewind import OTHER_CALLS, PAIRS, PROMPTS, TARGETS, _fresh_logits, _model
from test_recurrent_rewind import models as models  # the module's fixture: the same tiny models

from fsd_local import Engine
from fsd_local.llama.kv_cache import SequenceCache
from fsd_local.llama.seq_batch import SeqBatch
from support.serving import start_serve, wait_up

GREEDY = {"temperature": 0, "ignore_eos": True}
K = 4
N_SEQ = 3
# A batch decodes a sequence in other shapes than it alone, and llama.cpp's sums then round differently (by up to
# ~6e-4 on these models: OTHER_CALLS), so a greedy reply is the same only where each token leads its runner-up by
# more. These prompts' references lead by MARGIN at every token, for every target here (checked by `_decided`)
MARGIN = 5e-3
TEXTS = ["a very the", "the old sings on", "old on ran at dog", "a sea owl"]  # for generate, 64 tokens
ASKS = ["old on ran at dog", "a sea owl", "sat dog the fox very", "sat far man"]  # for chat, 24 tokens


def _decided(c):
    """c (a reference reply with top_logprobs=2), after checking each token leads its runner-up by MARGIN."""
    lead = min(top[0][1] - top[1][1] for top in c.top_logprobs)
    assert lead >= MARGIN, f"the reference has a near tie ({lead:.1e}): a batch may round it the other way"
    return c


def _next_logits_of(m, b: SeqBatch, s: int, seq: list[int]) -> np.ndarray:
    """Sequence s's logits after the rest of seq, decoded in one call (its cache must be a prefix of seq)."""
    assert m.seqs[s] == seq[: len(m.seqs[s])], f"{m.role} sequence {s} is not a prefix of its text"
    b.add(s, seq[len(m.seqs[s]) :], "last")
    b.decode()
    return b.rows(s)[-1].copy()


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("js", [(0, 2, 4), (1, 3, 0)])
def test_a_rejection_in_one_batch_rewinds_each_sequence_to_its_accepted_text(models, kind, js):
    """A round by hand as the batch runs it for three sequences: every draft decode holds one token of each, one
    target decode verifies them all; sequence s accepts its first js[s] drafts. Each sequence of each model then
    continues as a fresh context on its accepted text does."""
    path = models[TARGETS[kind]]
    t = _model(path, n_rs_seq=K + 1, checkpoint=True, n_seq=N_SEQ)  # as the engine loads a target
    d = _model(path, "draft", checkpoint=True, n_seq=N_SEQ)
    assert t.rewinds and d.rewinds and d.redecodes and lc.llama_n_seq_max(d.ctx) == 2 * N_SEQ
    tb, db = SeqBatch(t), SeqBatch(d)
    try:
        texts = [t.tokenize(p) for p in PROMPTS[:N_SEQ]]
        for m, b in ((t, tb), (d, db)):
            for s, text in enumerate(texts):
                b.add(s, text[:-1], "none")
            b.decode()
        for s, text in enumerate(texts):
            db.add(s, [text[-1]], "last")
        drafts: list[list[int]] = [[] for _ in texts]
        for i in range(K):
            if i == 0:
                db.decode()
                for s in range(N_SEQ):
                    d.checkpoint(s)  # as draft_all: after the first decode of a round drafting more than one
            for s in range(N_SEQ):
                drafts[s].append(int(np.argmax(db.rows(s)[-1])))
                if i < K - 1:  # the last draft is never decoded
                    db.add(s, [drafts[s][-1]], "last")
            if i < K - 1:
                db.decode()
        for s, text in enumerate(texts):
            t.checkpoint(s)  # as the batch's round: where the target has no snapshots, a rejection comes back here
            tb.add(s, [text[-1], *drafts[s]], "from:0")
        tb.decode()
        accepted = []
        for s, (text, j) in enumerate(zip(texts, js)):
            nxt = int(np.argmax(tb.rows(s)[j])) if j == K else (drafts[s][j] + 1) % 290  # draft j rejected
            accepted.append(text + drafts[s][:j] + [nxt])
            kept = t.keep_common_prefix(accepted[s], 0, s)
            assert kept == (len(text) + j if j == K else len(text) - 1), (s, j)  # several: spares, no snapshots
            assert d.keep_common_prefix(accepted[s], 0, s) == len(text) + (min(j, K - 1) if j >= K - 1 else 0)
        for m, b in ((t, tb), (d, db)):
            for s, seq in enumerate(accepted):
                want = _fresh_logits(path, seq)
                got = _next_logits_of(m, b, s, seq)
                np.testing.assert_allclose(got, want, rtol=0, atol=OTHER_CALLS, err_msg=f"{m.role} sequence {s}")
    finally:
        t.close()
        d.close()


def _together(eng: Engine, prompts: list[str], **settings) -> list:
    """Each prompt's completion, all generated at once (a thread each)."""
    out: dict = {}

    def run(i: int, p: str) -> None:
        out[i] = eng.generate(p, **settings, **GREEDY)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    return [out.get(i) for i in range(len(prompts))]


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("mode", ["sd", "fsd"])
def test_greedy_sd_and_fsd_in_a_batch_of_4_equal_ar_alone_and_each_state_is_its_text(models, pair, mode, monkeypatch):
    """Every rewind goes back within the reply (snapshots, a checkpoint): the calls join empty sequences, so a
    sequence emptied on the way (`_emptied`, counted) would be a rewind that lost its state."""
    target, draft = (models[n] for n in PAIRS[pair])
    with Engine(target=target, draft=draft, n_ctx=512, n_threads=1) as eng:
        refs = [eng.generate(p, mode="ar", max_tokens=64, logprobs=True, top_logprobs=2, **GREEDY) for p in TEXTS]
        alone = [_decided(r).token_ids for r in refs]
    emptied = []
    keep = SequenceCache._emptied
    monkeypatch.setattr(SequenceCache, "_emptied", lambda m, s: emptied.append((m.role, s)) or keep(m, s))
    with Engine(target=target, draft=draft, n_ctx=2048, n_threads=1, parallel=4, draft_policy="fixed") as eng:
        out = _together(eng, TEXTS, mode=mode, tau=0.0, draft_max=K, max_tokens=64)
        assert [o.token_ids for o in out] == alone
        assert all(o.stats["drafted"] > 0 for o in out) and emptied == []
        for m in (eng.target, eng.draft):  # each sequence a prefix of one reply's text, and continuing as it does
            texts = [eng.tokenize(p) + a for p, a in zip(TEXTS, alone)]
            b = SeqBatch(m)
            for s in range(4):
                seq = next(x for x in texts if m.seqs[s] == x[: len(m.seqs[s])])
                want = _fresh_logits(m.path, seq)
                got = _next_logits_of(m, b, s, seq)
                np.testing.assert_allclose(got, want, rtol=0, atol=OTHER_CALLS, err_msg=f"{m.role} sequence {s}")


@pytest.mark.parametrize("target", ["hybrid_target", "mamba_like_llama"])
def test_a_regenerated_reply_in_a_batch_goes_back_to_its_prompts_state(models, target):
    """A call that joins an idle batch keeps its target's state at the prompt's end: the same prompt again (its
    sequence the one holding the longest common prefix) evaluates one token, and answers the same."""
    with Engine(target=models[target], draft=models["llama"], n_ctx=1024, n_threads=1, parallel=2) as eng:
        prompt = eng.tokenize(PROMPTS[0])
        first = eng.generate(prompt, mode="sd", draft_policy="fixed", draft_max=K, max_tokens=24, **GREEDY)
        again = eng.generate(prompt, mode="sd", draft_policy="fixed", draft_max=K, max_tokens=24, **GREEDY)
        assert first.stats["drafted"] > 0 and first.stats["prompt_evaluated"] == len(prompt)
        assert again.stats["prompt_evaluated"] == 1 and again.token_ids == first.token_ids


def test_serve_runs_a_hybrid_pair_several_requests_at_once(models):
    target, draft = models["hybrid_target"], models["hybrid_draft"]
    hello = [[{"role": "user", "content": p}] for p in ASKS]
    with Engine(target=target, draft=draft, n_ctx=2048, n_threads=1) as eng:
        refs = [eng.chat(h, max_tokens=24, mode="ar", temperature=0, logprobs=True, top_logprobs=2) for h in hello]
        alone = [_decided(r).text for r in refs]
    proc, url = start_serve(draft, target, "--ctx", "2048", "--parallel", "4", "--draft-policy", "fixed")
    try:
        wait_up(proc, url)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        replies: dict[int, str] = {}

        def ask(i: int) -> None:
            r = c.chat.completions.create(
                model="m", messages=hello[i], max_tokens=24, temperature=0, extra_body={"mode": "sd"}
            )
            assert r.model_extra["fsd"]["drafted"] > 0
            replies[i] = r.choices[0].message.content

        calls = [threading.Thread(target=ask, args=(i,)) for i in range(len(hello))]
        for th in calls:
            th.start()
        for th in calls:
            th.join(timeout=120)
        assert [replies.get(i) for i in range(len(hello))] == alone
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
