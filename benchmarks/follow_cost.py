"""The cost of a draft of another vocabulary following the text (drafting/follow.py) at a long context: rounds of a
reply after CONTEXT target tokens, each as the loop would run it, and what the catch-up costs against the draft's
own drafting.

    python benchmarks/follow_cost.py --target gemma-3-270m-q4_k_m.gguf --draft SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--context 4096] [--rounds 64] [--k 4] [--threads 2]

The text is the packaged prompt files rendered as chat turns with the target's template, repeated until it holds
CONTEXT target tokens, and the reply the text after it. Each round the draft proposes its own first k tokens of
what the reply says next (decoded one by one as drafting does, up to the first the map cannot carry), a random
number of them is accepted (as the target tokens they are carried to), and the target emits its own next token of
the reply; then `sync` brings the draft to the text.
Printed per round: the follower's own time (tokenising the tail, comparing; llama.cpp's decode excluded), the
tokens it decoded and, of them, those decoded again (cached tokens of the accepted text that a tail tokenised
differently replaced: what one vocabulary never decodes), its decode time against the drafting decodes, and what
tokenising the whole text again would cost instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from time import perf_counter

import numpy as np

from fsd_local.drafting.follow import BACK, TextFollower
from fsd_local.llama.bindings import lc
from fsd_local.llama.chat_template import ChatTemplate
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.llama.vocab_map import map_between

DATA = Path(__file__).resolve().parent.parent / "fsd_local" / "data"


def long_text(target: Model, n_tokens: int) -> list[int]:
    """At least n_tokens target tokens of chat turns: the prompt files' prompts as user messages, each answered
    with the next one, rendered by the target's template."""
    prompts = [
        json.loads(line)["prompt"]
        for name in ("prompts-grounded.jsonl", "prompts-chat.jsonl", "prompts-example.jsonl")
        for line in (DATA / name).read_text().splitlines()
        if line.strip()
    ]
    template = ChatTemplate.from_model(target)
    messages: list[dict] = []
    tokens: list[int] = []
    while len(tokens) < n_tokens:
        for i in range(0, len(prompts) - 1, 2):
            messages += [{"role": "user", "content": prompts[i]}, {"role": "assistant", "content": prompts[i + 1]}]
        tokens = target.tokenize(template.render(messages, add_generation_prompt=False))
    return tokens


def first_tokens(model: Model, data: bytes, special: bool = False) -> list[int]:
    """The model's tokens of data, bytes in (a window may start or end inside a character)."""
    buf = (lc.llama_token * (len(data) + 8))()
    n = lc.llama_tokenize(model.vocab, data, len(data), buf, len(buf), False, special)
    return list(buf[: max(n, 0)])


def report(a, f: TextFollower, seq, draft: Model, own, sync_decode, draft_decode, decoded, redecoded, drafted):
    """What the rounds measured, and tokenising the whole text instead."""
    text = bytes(f.text)
    t = perf_counter()
    all_ids = f._tokenize(text)
    full = perf_counter() - t
    us = np.array(own) * 1e6
    print(f"rounds {a.rounds} (k {a.k}, back {a.back}), context {len(seq)} target tokens, {len(draft.tokens)} draft")
    print(
        f"follower's own time per round: mean {us.mean():.0f} us, median {np.median(us):.0f}, p95 "
        f"{np.percentile(us, 95):.0f} (tokenising the whole text instead: {full * 1e3:.1f} ms, {len(all_ids)} tokens)"
    )
    print(
        f"tokens decoded per sync: mean {np.mean(decoded):.2f}, max {max(decoded)}; of them re-decoded (cached but "
        f"changed): mean {np.mean(redecoded):.2f}, max {max(redecoded)}; far back {f.far_back}, misaligned "
        f"{f.misaligned}"
    )
    total = sum(sync_decode) + sum(draft_decode)
    n_decoded = sum(decoded) + sum(drafted)
    print(
        f"re-decoded tokens (the catch-up's extra work over one vocabulary's): {sum(redecoded)} = "
        f"{sum(redecoded) / max(1, n_decoded):.1%} of the {n_decoded} tokens the draft decoded"
    )
    print(
        f"sync decode {sum(sync_decode) * 1e3:.0f} ms = {sum(sync_decode) / total:.1%} of the draft's decode time "
        f"(drafting {sum(draft_decode) * 1e3:.0f} ms); own time {sum(own) * 1e3:.1f} ms = "
        f"{sum(own) / (total + sum(own)):.1%} of the draft's time"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--back", type=int, default=BACK, help="draft tokens before a change tokenised again")
    a = ap.parse_args(argv)
    target = Model(ModelOptions(a.target, vocab_only=True), "target")
    draft = Model(ModelOptions(a.draft, n_ctx=a.context + 8 * a.rounds + 64, n_threads=a.threads), "draft")
    target_of = map_between(a.draft, a.target, draft, target).target_of
    whole = long_text(target, a.context + (a.k + 1) * a.rounds + 64)
    seq, reply = whole[: a.context], b"".join(target.piece(t) for t in whole[a.context :])
    f = TextFollower(draft, target, a.back)
    t = perf_counter()
    f.sync(seq)
    prefill = perf_counter() - t
    print(f"context {a.context} target tokens -> {len(draft.tokens)} draft tokens: first sync {prefill:.2f} s")
    rng = np.random.default_rng(a.seed)
    own, sync_decode, draft_decode, decoded, redecoded, drafted = [], [], [], [], [], []
    at = 0  # bytes of the reply written
    for _ in range(a.rounds):
        # the draft proposes its own split of what comes next, as far as the map carries it
        proposals, pos = [], at
        for d in first_tokens(draft, reply[at : at + 64])[: a.k]:
            piece = draft.piece(d)
            if target_of[d] < 0 or reply[pos : pos + len(piece)] != piece:  # not carried, or cut by the window
                break
            proposals.append(d)
            pos += len(piece)
        d0, synced = draft.decode_seconds, len(draft.tokens)
        for p in proposals[: a.k - 1]:  # drafting: d_k is sampled, never fed
            draft.decode_one(p)
        draft_decode.append(draft.decode_seconds - d0)
        drafted.append(len(proposals[: a.k - 1]))
        n = int(rng.integers(0, len(proposals) + 1))
        accepted = [int(target_of[d]) for d in proposals[:n]]
        at += sum(len(draft.piece(d)) for d in proposals[:n])
        nxt = first_tokens(target, reply[at : at + 64])[0]  # the target's own next token
        at += len(target.piece(nxt))
        start = len(seq) - 1
        seq = seq + accepted + [nxt]
        before, seconds, d0 = list(draft.tokens), f.seconds, draft.decode_seconds
        f.sync(seq, start)
        kept = next(
            (j for j, (x, y) in enumerate(zip(before, draft.tokens)) if x != y), min(len(before), len(draft.tokens))
        )
        own.append(f.seconds - seconds)
        sync_decode.append(draft.decode_seconds - d0)
        decoded.append(len(draft.tokens) - kept)
        # decoded again: cached tokens of the accepted text (the synced text and the accepted proposals) the sync
        # replaced; a rejected proposal's place is decoded anew with one vocabulary too
        redecoded.append(max(0, min(len(before), synced + n) - kept))
    report(a, f, seq, draft, own, sync_decode, draft_decode, decoded, redecoded, drafted)
    draft.close()
    target.close()


if __name__ == "__main__":
    sys.exit(main())
