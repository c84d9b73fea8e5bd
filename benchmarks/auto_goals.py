"""The benchmark of issue 18's goals: `auto` against plain decoding and fixed draft lengths, for `sd` and fsd
(js, tau 0.2), greedy, on one demo pair, all configurations interleaved per prompt on one engine (bench's
runner), with the offline oracle (the best fixed k in 0..16 at this run's own costs and acceptance).

    python benchmarks/auto_goals.py --demo wide --fixed 3,7 [--prompts FILE] [--tokens 64] [--repeats 1]

Prints bench's table, then per rule: auto's tokens/s over ar, over the best measured fixed k, and over the
oracle's best k; and the loop's own share of wall time (outside the two models).
"""

from __future__ import annotations

import argparse

from fsd_local.bench.prompts import load_prompts
from fsd_local.bench.report import format_table
from fsd_local.bench.runner import Config, run_bench, summarise
from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a bicycle works to a ten-year-old.",
    "Give me five tips for staying focused while studying.",
    "Describe the water cycle in simple terms.",
    "What are the pros and cons of working from home?",
    "Write a friendly email inviting a colleague to lunch on Friday.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", default="wide")
    ap.add_argument("--fixed", default="3,7", help="fixed k to run beside auto (the oracle prices every k)")
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--prompts")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rules", default="sd,fsd")
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    a = ap.parse_args()
    if a.prompts:
        prompts = load_prompts(a.prompts)
    else:
        from fsd_local.bench.prompts import Prompt

        prompts = [Prompt(p) for p in PROMPTS]
    fixed = [int(k) for k in a.fixed.split(",") if k]
    configs = [Config("ar", 0.0)]
    for rule in a.rules.split(","):
        extra = ("js", 0.2) if rule == "fsd" else (None, None)
        configs.append(Config(rule, 0.0, *extra, a.k_max, "model", "auto"))
        configs += [Config(rule, 0.0, *extra, k, "model", "fixed") for k in fixed]
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    with Engine(str(target), str(draft), n_ctx=2048, n_threads=a.threads) as eng:
        data = run_bench(eng, prompts, configs, max_tokens=a.tokens, repeats=a.repeats, chat=True, ignore_eos=True)
    rows = summarise(data)
    print(format_table(rows))
    ar = next(r for r in rows if r["mode"] == "ar")["tokens_per_second"]
    for rule in a.rules.split(","):
        mine = [r for r in rows if r["mode"] == rule]
        auto = next(r for r in mine if r["draft_policy"] == "auto")
        best_fixed = max([ar] + [r["tokens_per_second"] for r in mine if r["draft_policy"] == "fixed"])  # (ar alone
        # when no fixed k ran: --fixed "")
        oracle = max(r["oracle_tokens_per_second"] or 0.0 for r in mine)
        oracle_k = max(mine, key=lambda r: r["oracle_tokens_per_second"] or 0.0)["oracle_k"]
        other = auto["time_share"]["other"]
        print(
            f"{rule}: auto {auto['tokens_per_second']:.2f} tok/s = {auto['tokens_per_second'] / ar:.2f}x ar, "
            f"{auto['tokens_per_second'] / best_fixed:.2f}x the best of ar and the fixed k run, "
            f"{auto['tokens_per_second'] / max(oracle, 1e-9):.2f}x the oracle (k={oracle_k}: {oracle:.2f} tok/s); "
            f"k histogram {auto['k_histogram']}; loop's own time {other:.1%} of wall time"
        )


if __name__ == "__main__":
    main()
