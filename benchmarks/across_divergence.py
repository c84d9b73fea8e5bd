"""Where a draft and its target disagree, teacher-forced over the target's own greedy replies: at each position of
each reply, the target's row p and the draft's row carried onto the target's vocabulary q' (one vocabulary: q),
and what each rule would accept there. Not a timing: it prints shares and divergences.

    python benchmarks/across_divergence.py --target gemma-3-270m-q4_k_m.gguf --draft SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--prompts 6] [--tokens 64] [--tau 0.3]

Printed: the share of positions whose target argmax is a token the draft has no twin for (target-only), the
target's mean mass there, how often q''s argmax is p's (greedy sd's first slot), how often it is a proper prefix
of p's argmax (the same text, split shorter), JS(p, q') and its off-support part (ln 2 / 2 of p's target-only
mass), and the share of positions each reading of the divergence would accept at tau (a fuzzy rescue where the
lossless test fails), with the mean greedy loss (log p(top) - log p(draft)) of those rescues.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from across_pair import pair_arguments, prompts  # noqa: E402

from fsd_local import Engine  # noqa: E402
from fsd_local.llama.vocab_map import map_between  # noqa: E402

LN2 = float(np.log(2.0))


def softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    e[~np.isfinite(x)] = 0.0
    return e / e.sum()


def js(p: np.ndarray, q: np.ndarray) -> float:
    m = 0.5 * (p + q)
    a = p > 0
    b = q > 0
    return 0.5 * float(np.sum(p[a] * np.log(p[a] / m[a]))) + 0.5 * float(np.sum(q[b] * np.log(q[b] / m[b])))


def rows_of(eng: Engine, text: str, tokens: int, carried: np.ndarray | None):
    """The target's greedy reply, p and the draft's q (carried) at each of its positions, and the draft's mass the
    map does not carry there (`carried`: which draft tokens it carries)."""
    msgs = [{"role": "user", "content": text}]
    eng.reset()
    reply = eng.chat(msgs, max_tokens=tokens, mode="ar", temperature=0).token_ids
    prompt = eng.chat_prompt(msgs)
    seq = prompt + reply
    eng.reset()
    t, d, a = eng.target, eng.draft, eng.across
    assert d is not None
    t.decode(seq, f"from:{len(prompt) - 1}")
    p_rows = np.array(t.logits(len(reply) + 1)[:-1], np.float32)
    q_rows = np.full(p_rows.shape, -np.inf, np.float32)
    lost = np.zeros(len(reply))
    if a is None:
        d.decode(seq, f"from:{len(prompt) - 1}")
        q_rows[:, : d.n_vocab] = d.logits(len(reply) + 1)[:-1]
    else:
        a.start()
        for i in range(len(reply)):
            if a.sync(seq[: len(prompt) + i]):
                row = d.logits(1)[0]
                q_rows[i] = a.carry(row)
                lost[i] = 1.0 - softmax(row)[carried].sum()
    return reply, p_rows, q_rows, lost


def coarsening(eng: Engine) -> tuple[np.ndarray | None, np.ndarray | None]:
    """For each target token, the shared target token the draft writes first when it writes that token's text
    (itself for a shared token; -1: none): the target's row read at the draft's granularity; and which draft
    tokens the map carries."""
    a = eng.across
    if a is None:
        return None, None
    vm = map_between(a.draft.path, eng.target.path, a.draft, eng.target)
    pi = np.where(a.draft_of >= 0, np.arange(a.draft_of.shape[0]), -1)
    for t in np.flatnonzero(a.draft_of < 0).tolist():
        ids = a.follower._tokenize(eng.target.piece(t))
        pi[t] = vm.target_of[ids[0]] if ids else -1
    return pi, vm.target_of >= 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair_arguments(ap)
    a = ap.parse_args()
    keys = ("own_top", "p_own", "agree", "prefix", "js", "js_off", "js_coarse", "loss", "p_d", "lost")
    rec: dict[str, list[float]] = {k: [] for k in keys}
    with Engine(target=a.target, draft=a.draft, n_ctx=2048, n_threads=a.threads, draft_policy="fixed") as eng:
        across = eng.across
        n_t = eng.target.n_vocab
        own = across.draft_of < 0 if across is not None else np.zeros(n_t, bool)
        pi, carried = coarsening(eng)
        piece = eng.target.piece
        for text in prompts(a.prompts):
            reply, p_rows, q_rows, lost = rows_of(eng, text, a.tokens, carried)
            for i in range(len(reply)):
                if not np.isfinite(q_rows[i]).any():
                    continue
                p, q = softmax(p_rows[i]), softmax(q_rows[i])
                top, d = int(np.argmax(p)), int(np.argmax(q))
                coarse = p
                if pi is not None:
                    ok = pi >= 0
                    coarse = np.bincount(pi[ok], weights=p[ok], minlength=n_t)
                tb, db = piece(top), piece(d)
                rec["own_top"].append(float(own[top]))
                rec["p_own"].append(float(p[own].sum()))
                rec["agree"].append(float(top == d))
                rec["prefix"].append(float(top != d and len(db) < len(tb) and tb.startswith(db)))
                rec["js"].append(js(p, q))
                rec["js_off"].append(0.5 * LN2 * float(p[own].sum()))
                rec["js_coarse"].append(js(coarse, q))
                rec["loss"].append(float(np.log(p[top]) - np.log(max(p[d], 1e-300))))
                rec["p_d"].append(float(p[d]))
                rec["lost"].append(float(lost[i]))
    report(a, across is not None, {k: np.array(v) for k, v in rec.items()})


def report(a, mapped: bool, r: dict[str, np.ndarray]) -> None:
    n = r["js"].shape[0]
    fail = r["agree"] == 0
    print(f"pair: {a.draft} -> {a.target}: {'map' if mapped else 'same tokenizer'}; {n} positions")
    if not n:
        return
    print(
        f"target argmax is target-only: {r['own_top'].mean():.1%}; target's mass on target-only tokens: mean "
        f"{r['p_own'].mean():.3f}, median {np.median(r['p_own']):.3f}"
    )
    print(
        f"q' argmax == p argmax (greedy sd's test): {r['agree'].mean():.1%}; a proper prefix of it: "
        f"{r['prefix'].mean():.1%}; of the rejected, target argmax target-only {r['own_top'][fail].mean():.1%}, "
        f"draft's a prefix of it {r['prefix'][fail].mean():.1%}"
    )
    print(
        f"the draft's mass on its tokens the map does not carry: mean {r['lost'].mean():.3f}, "
        f"q90 {np.percentile(r['lost'], 90):.3f}"
    )
    if not fail.any():
        return
    for name in ("js", "js_off", "js_coarse"):
        v = r[name][fail]
        qs = " ".join(f"{x:.3f}" for x in np.percentile(v, (10, 50, 90)))
        print(f"at rejected slots {name:<10} q10/q50/q90 {qs}   mean {v.mean():.3f}")
    off = r["js_off"][fail] / np.maximum(r["js"][fail], 1e-12)
    print(f"at rejected slots, the off-support part of js: mean {off.mean():.1%}, median {np.median(off):.1%}")
    for name, tau in [("js", a.tau), ("js_coarse", a.tau)] + [("js", t) for t in (0.5, 0.6, 0.65)]:
        ok = fail & (r[name] <= tau)
        share = ok.sum() / fail.sum()
        loss = r["loss"][ok].mean() if ok.any() else 0.0
        pd = np.median(r["p_d"][ok]) if ok.any() else 0.0
        pre = r["prefix"][ok].mean() if ok.any() else 0.0
        print(
            f"{name} <= {tau}: rescues {ok.sum()} of {fail.sum()} rejected ({share:.1%}), accepted "
            f"{(~fail | ok).mean():.1%} (sd {(~fail).mean():.1%}); per rescue greedy loss mean {loss:.2f} nats, "
            f"p(draft) median {pd:.3f}, draft's a prefix of the argmax {pre:.1%}"
        )


if __name__ == "__main__":
    main()
