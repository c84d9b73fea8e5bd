"""A pair of any two tokenizers in the engine (drafting/across.py; one tokenizer works too): tokens per target call,
acceptance and time of `ar`, greedy `sd` and `fsd` js at a tau, fixed k, over chat prompts, each from empty caches.

    python benchmarks/across_pair.py --target gemma-3-270m-q4_k_m.gguf --draft SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--prompts 6] [--tokens 64] [--k 4] [--tau 0.3] [--threads 2]

Printed per configuration: the reply tokens, target calls, tokens per target call, acceptance, tokens per second,
the draft model's decode seconds and, for a pair of two tokenizers, the follower's own time per round (tokenising
tails, comparing: llama.cpp's decode excluded) and its share of the draft's time; then how many greedy replies
equal `ar`'s ids (on quantized weights batch shapes may change a near tie: compare ids on F16/F32 only). The
draft length is fixed (k), so the cost store is not read to choose it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from time import perf_counter

from fsd_local import Engine

DATA = Path(__file__).resolve().parent.parent / "fsd_local" / "data"


def prompts(n: int) -> list[str]:
    lines = (DATA / "prompts-chat.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:n]


def run(eng: Engine, texts: list[str], tokens: int, **settings) -> dict:
    """One configuration over every prompt, each from empty caches."""
    total = {"tokens": 0, "target_calls": 0, "drafted": 0, "accepted": 0, "seconds": 0.0, "rounds": 0}
    draft_s = follow_s = 0.0
    ids = []
    for text in texts:
        eng.reset()
        d0 = eng.draft.decode_seconds if eng.draft else 0.0
        f0 = eng.across.follower.seconds if eng.across else 0.0
        t = perf_counter()
        out = eng.chat([{"role": "user", "content": text}], max_tokens=tokens, temperature=0, **settings)
        total["seconds"] += perf_counter() - t
        draft_s += (eng.draft.decode_seconds if eng.draft else 0.0) - d0
        follow_s += (eng.across.follower.seconds if eng.across else 0.0) - f0
        st = out.stats
        total["tokens"] += len(out.token_ids)
        total["target_calls"] += st["target_calls"]
        total["rounds"] += st["rounds"]
        total["drafted"] += st.get("drafted", 0)
        total["accepted"] += st.get("accepted_sd", 0) + st.get("accepted_fuzzy", 0)
        ids.append(out.token_ids)
    total["ids"] = ids
    total["draft_seconds"] = draft_s
    total["follow_seconds"] = follow_s
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tau", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    a = ap.parse_args()
    texts = prompts(a.prompts)
    configs = {"ar": {"mode": "ar"}, "sd": {"mode": "sd"}, f"fsd js {a.tau}": {"mode": "fsd", "tau": a.tau}}
    with Engine(
        target=a.target, draft=a.draft, n_ctx=a.ctx, n_threads=a.threads, draft_policy="fixed", draft_max=a.k
    ) as eng:
        path = "map (two tokenizers)" if eng.across is not None else "same tokenizer"
        print(f"pair: {a.draft} -> {a.target}: {path}; {len(texts)} prompts x {a.tokens} tokens, greedy, k {a.k}")
        eng.generate("warm up", max_tokens=4, mode="sd")
        results = {name: run(eng, texts, a.tokens, divergence="js", **s) for name, s in configs.items()}
    head = f"{'config':<14}{'tokens':>7}{'calls':>7}{'tok/call':>9}{'accept':>8}{'tok/s':>8}{'draft s':>9}"
    print(head + f"{'follow us/round':>17}{'follow/draft':>14}")
    for name, r in results.items():
        per_call = r["tokens"] / max(r["target_calls"], 1)
        accept = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
        follow = 1e6 * r["follow_seconds"] / max(r["rounds"], 1)
        share = r["follow_seconds"] / r["draft_seconds"] if r["draft_seconds"] else 0.0
        print(
            f"{name:<14}{r['tokens']:>7}{r['target_calls']:>7}{per_call:>9.2f}{accept:>8.2f}"
            f"{r['tokens'] / r['seconds']:>8.1f}{r['draft_seconds']:>9.2f}{follow:>17.0f}{share:>14.1%}"
        )
    sd, fsd = (results[n] for n in ("sd", f"fsd js {a.tau}"))
    ratio = (fsd["tokens"] / fsd["target_calls"]) / (sd["tokens"] / sd["target_calls"])
    print(f"fsd js {a.tau} / sd tokens per target call: {ratio:.2f}x")
    same = sum(x == y for x, y in zip(results["ar"]["ids"], sd["ids"]))
    print(f"greedy sd replies equal to ar's ids: {same} of {len(texts)}")


if __name__ == "__main__":
    main()
