"""How many tokens per target call a per-reply quality budget could buy at most, on a fixed tau's replies
(README, "Quality budget": the wide demo target at B 0.1).

    python tests/budget_bound.py [wide|f16] --tau 0.15 --budgets 0.05,0.1,0.2 [--prompts FILE]

Runs fsd js at the fixed tau (greedy, k = 6 fixed, 64 tokens, chat turns) and records every rescue's loss and its
slot in its round. Then, per reply, a clairvoyant policy that knew the whole reply in advance and only had to keep
the reply's total loss within B x its tokens (no per-prefix cap, which is weaker than the engine's guarantee)
refuses the rescues with the highest loss per token of round they give up until the reply fits; each refusal at
slot i of a round of k drafts gives up k - i tokens. The tokens per call it would reach, with those tokens paid
at the fixed tau's own k + 1 tokens per call, is what any budget that keeps every reply within B could hope
for on these replies (the text after a refusal changes, so this is an estimate, not a proof).
"""

from __future__ import annotations

import argparse

from fsd_local.bench.prompts import load_prompts
from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

K = 6


def rescues(completion) -> list[tuple[float, int]]:
    """(loss, slot in its round) of every rescued token: a round is a run of drafts closed by the target's token."""
    out, slot = [], 0
    for origin, lp, top in zip(completion.origins, completion.logprobs, completion.top_logprobs):
        if origin == "fuzzy":
            out.append((top[0][1] - lp, slot))
        slot = 0 if origin == "target" else slot + 1
    return out


def bound(replies, b: float) -> tuple[float, int]:
    """(estimated tokens per call, refusals) of the clairvoyant per-reply policy at budget b."""
    tokens = calls = 0.0
    refusals = 0
    for n_tokens, n_calls, found in replies:
        over = sum(c for c, _ in found) - b * n_tokens
        given_up = 0
        for c, slot in sorted(found, key=lambda r: -r[0] / (K - r[1])):
            if over <= 1e-12:
                break
            over -= c
            given_up += K - slot
            refusals += 1
        tokens += n_tokens
        calls += n_calls + given_up / (K + 1)
    return tokens / calls, refusals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("demo", nargs="?", default="wide", choices=("wide", "f16"))
    ap.add_argument("--tau", type=float, default=0.15)
    ap.add_argument("--budgets", default="0.05,0.1,0.2")
    ap.add_argument("--prompts", default="fsd_local/data/prompts-chat.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    draft, target = demo_pair(precision=a.demo)
    replies = []
    with Engine(target=str(target), draft=str(draft), n_threads=a.threads, n_ctx=2048) as eng:
        for p in load_prompts(a.prompts):
            eng.reset()
            out = eng.generate(
                eng.chat_prompt([{"role": "user", "content": p.text}]),
                mode="fsd",
                divergence="js",
                tau=a.tau,
                draft_policy="fixed",
                draft_max=K,
                max_tokens=64,
                temperature=0.0,
                logprobs=True,
                top_logprobs=1,
            )
            replies.append((out.stats["tokens"], out.stats["target_calls"], rescues(out)))
    n_tok = sum(r[0] for r in replies)
    n_calls = sum(r[1] for r in replies)
    loss = sum(c for r in replies for c, _ in r[2])
    worst = max(sum(c for c, _ in r[2]) / r[0] for r in replies)
    fixed = n_tok / n_calls
    print(f"fixed tau {a.tau}: {fixed:.3f} tokens/call, mean loss {loss / n_tok:.4f}, worst reply {worst:.4f}")
    for b in (float(x) for x in a.budgets.split(",")):
        rate, refused = bound(replies, b)
        print(f"B {b}: at most ~{rate:.3f} tokens/call ({rate / fixed:.3f}x the fixed tau), {refused} refusals")


if __name__ == "__main__":
    main()
