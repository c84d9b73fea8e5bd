"""Loop check for chat's default sampling (a script, not a unit test): first messages to the SmolLM2 demo pair,
greedy against `fsd-local chat`'s defaults (settings.CHAT_DEFAULTS) and other candidates, several seeds.

    python benchmarks/chat_loops.py [--seeds 3] [--max-tokens 128] [--tau 0.2] [--threads 1]

A reply "loops" when one span of 2 to 32 tokens repeats 3 or more times back to back. Prints each reply's
longest repeat and its end, then one summary line per setting.
"""

from __future__ import annotations

import argparse

from fsd_local import Engine
from fsd_local.pairs.demo import demo_pair
from fsd_local.settings import CHAT_DEFAULTS

FIRST = [
    "Write a short poem about the sea.",
    "Hi! Who are you?",
    "Tell me about Paris.",
    "What should I cook tonight?",
    "Describe a sunset.",
]
CANDIDATES = {
    "greedy": dict(temperature=0.0),
    "chat defaults": dict(CHAT_DEFAULTS),
    "temperature 1.0, same truncation": {**CHAT_DEFAULTS, "temperature": 1.0},
    "temperature 1.0, min-p 0.1 alone": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    "greedy, repeat penalty 1.1": dict(temperature=0.0, repeat_penalty=1.1),
    "chat defaults without the repeat penalty": {**CHAT_DEFAULTS, "repeat_penalty": 1.0},
}


def longest_repeat(ids: list[int]) -> int:
    """How many times one span (2 to 32 tokens) repeats back to back, at most, in ids."""
    best = 1
    for period in range(2, 33):
        run = 0
        for i in range(period, len(ids)):
            run = run + 1 if ids[i] == ids[i - period] else 0
            best = max(best, 1 + run // period)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only", help="run only the candidates whose name contains one of these (comma separated)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tau", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=len(FIRST), help="the first N first messages")
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    args = ap.parse_args()
    draft, target = (args.draft, args.target) if args.target else demo_pair()
    summary = []
    with Engine(target=str(target), draft=str(draft), n_ctx=2048, n_threads=args.threads) as eng:
        for name, settings in CANDIDATES.items():
            if args.only and not any(w in name for w in args.only.split(",")):
                continue
            seeds = [None] if settings["temperature"] == 0 else list(range(1, args.seeds + 1))
            loops = runs = 0
            for seed in seeds:
                for msg in FIRST[: args.prompts]:
                    eng.reset()
                    messages = [{"role": "user", "content": msg}]
                    c = eng.chat(messages, max_tokens=args.max_tokens, tau=args.tau, seed=seed, **settings)
                    r = longest_repeat(c.token_ids)
                    loops, runs = loops + (r >= 3), runs + 1
                    print(f"{name:34} seed {seed}  {msg!r:38} repeat x{r:<3} ...{c.text[-60:]!r}", flush=True)
            summary.append(f"{name:34} {loops}/{runs} first replies loop")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
