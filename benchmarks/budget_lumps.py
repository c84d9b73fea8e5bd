"""What one rescue costs against the room the sampled budget's per-prefix cap leaves (issue 28's misses).

    python benchmarks/budget_lumps.py --demo wide [--budgets 0.05,0.2] [--taus 0.5] [--prompts 6] [--tokens 96]
    python benchmarks/budget_lumps.py --target T.gguf --draft D.gguf

At chat's sampling (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1), fsd js, fixed k = 4,
one seed, each chat prompt once: per configuration, the loss per rescue (the reply's loss over its rescued
tokens; in tokens' worth of budget: that over B; a tau run charges it in those lumps, a budget slot by slot since
issue 28: kernels/budget.py), how many rescues were refused (sampled: slots opened to fewer than all their
rescues) and how many of those by the hard cap alone (worth their price), and each reply's spend (loss per token
over B; a tau row: loss per token).
"""

from __future__ import annotations

import argparse
import statistics

from fsd_local.bench.prompts import EXAMPLE_FILE, load_prompts
from fsd_local.bench.runner import prompt_tokens
from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

CHAT = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}
CHAT_PROMPTS = EXAMPLE_FILE.parent / "prompts-chat.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="wide", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--target", help="a target GGUF instead of a demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--budgets", default="0.05,0.2")
    ap.add_argument("--taus", default="0.5")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    configs = [{"quality_budget": float(b)} for b in a.budgets.split(",") if b]
    configs += [{"tau": float(t)} for t in a.taus.split(",") if t]
    with Engine(target=str(target), draft=str(draft), n_threads=a.threads) as eng:
        prompts = prompt_tokens(eng, load_prompts(CHAT_PROMPTS)[: a.prompts], True)
        for cfg in configs:
            charges, refused, capped, spend = [], 0, 0, []
            for p in prompts:
                eng.reset()
                fixed = {"mode": "fsd", "divergence": "js", "draft_policy": "fixed", "draft_max": 4, "seed": 1}
                st = eng.generate(p, max_tokens=a.tokens, **fixed, **CHAT, **cfg).stats
                if st["accepted_fuzzy"]:
                    charges.append(st["loss_sum"] / st["accepted_fuzzy"])
                refused, capped = refused + st["rescues_refused"], capped + st["rescues_capped"]
                spend.append(st["loss_sum"] / st["tokens"] / cfg.get("quality_budget", 1.0))
            b = cfg.get("quality_budget")
            mean = statistics.mean(charges) if charges else 0.0
            worth = f" ({mean / b:.1f} tokens' worth of B)" if b else ""
            label = f"B {b}" if b else f"tau {cfg['tau']}"
            print(f"{label}: loss per rescue {mean:.3f}{worth}; refused {refused}, by the cap alone {capped}")
            print(
                f"  spend{' / B' if b else ' per token'} by reply: " + " ".join(f"{s:.2f}" for s in spend), flush=True
            )


if __name__ == "__main__":
    main()
