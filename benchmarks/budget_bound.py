"""How many tokens per target call a per-reply quality budget could buy at most, on a fixed tau's replies
(docs/measurements/budget.md: the wide demo target at B 0.1).

    python benchmarks/budget_bound.py [wide|f16] --tau 0.15 --budgets 0.05,0.1,0.2 [--prompts FILE]

Runs fsd js at the fixed tau (greedy, k = 6 fixed, --tokens 64, chat turns) and records every rescue's loss, its
slot in its round and where the rounds end. Then, per reply, a clairvoyant policy that knew the whole reply in
advance refuses the rescues with the highest loss per token of round they give up (k - i at slot i of a round of
k drafts) until the reply fits B x its tokens: at its end only (weaker than the engine's guarantee), or at the end
of every round (as the engine's cap). The tokens per call it would reach, the tokens it gives up paid at k + 1
per call beyond the free room of the reply's last call, is roughly what a budget that keeps every reply within B
could hope for on these replies (the text after a refusal changes, so this is an estimate, not a proof).
"""

from __future__ import annotations

import argparse
import math

from fsd_local.bench.prompts import EXAMPLE_FILE, load_prompts
from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

K = 6


def rescues(completion) -> tuple[list[tuple[float, int, int]], list[int]]:
    """(loss, slot in its round, position in the reply) of every rescued token, and where each round ends (the
    reply's length after it): a round is a run of drafts closed by the target's token."""
    out, ends, slot = [], [], 0
    for pos, (origin, lp, top) in enumerate(zip(completion.origins, completion.logprobs, completion.top_logprobs)):
        if origin == "fuzzy":
            out.append((top[0][1] - lp, slot, pos))
        if origin == "target":
            ends.append(pos + 1)
            slot = 0
        else:
            slot += 1
    return out, ends


def refusals(found, ends, b: float, every_round: bool) -> list[tuple[float, int, int]]:
    """The rescues a clairvoyant policy refuses so that the reply's loss fits B x its tokens at its end (and, with
    every_round, at the end of every round, as the engine's cap): whenever a point does not fit, the kept rescue
    before it with the highest loss per token of round it gives up (K - slot) goes first."""
    kept: list[tuple[float, int, int]] = []
    refused = []
    start = 0
    for end in ends if every_round else ends[-1:]:
        kept += [r for r in found if start <= r[2] < end]
        start = end
        while kept and sum(r[0] for r in kept) > b * end + 1e-12:
            worst = max(kept, key=lambda r: r[0] / (K - r[1]))
            kept.remove(worst)
            refused.append(worst)
    return refused


def bound(replies, b: float, every_round: bool) -> tuple[float, int]:
    """(estimated tokens per call, refusals) of the clairvoyant policy at budget b. The tokens a refusal gives up
    cost calls only beyond the free room in the reply's calls ((K + 1) x calls - tokens, the last call's)."""
    tokens = calls = 0
    n_refused = 0
    for n_tokens, n_calls, found, ends in replies:
        refused = refusals(found, ends, b, every_round)
        given_up = sum(K - slot for _, slot, _ in refused)
        room = (K + 1) * n_calls - n_tokens
        n_refused += len(refused)
        tokens += n_tokens
        calls += n_calls + max(0, math.ceil((given_up - room) / (K + 1)))
    return tokens / calls, n_refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("demo", nargs="?", default="wide", choices=("wide", "f16"))
    ap.add_argument("--tau", type=float, default=0.15)
    ap.add_argument("--budgets", default="0.05,0.1,0.2")
    ap.add_argument("--prompts", default=str(EXAMPLE_FILE.with_name("prompts-chat.jsonl")))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    a = ap.parse_args()
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
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
                max_tokens=a.tokens,
                temperature=0.0,
                logprobs=True,
                top_logprobs=1,
            )
            replies.append((out.stats["tokens"], out.stats["target_calls"], *rescues(out)))
    n_tok = sum(r[0] for r in replies)
    n_calls = sum(r[1] for r in replies)
    loss = sum(r[0] for reply in replies for r in reply[2])
    worst = max(sum(r[0] for r in reply[2]) / reply[0] for reply in replies)
    fixed = n_tok / n_calls
    print(f"fixed tau {a.tau}: {fixed:.3f} tokens/call, mean loss {loss / n_tok:.4f}, worst reply {worst:.4f}")
    for b in (float(x) for x in a.budgets.split(",")):
        for every_round, what in ((False, "the reply's total only"), (True, "at every round's end")):
            rate, refused = bound(replies, b, every_round)
            print(f"B {b}, {what}: at most ~{rate:.3f} tokens/call ({rate / fixed:.3f}x), {refused} refusals")


if __name__ == "__main__":
    main()
