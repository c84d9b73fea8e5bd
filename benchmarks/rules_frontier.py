"""Measure the lossy rules side by side on the F16 demo pair (docs/measurements/rules-frontier.md).

    python benchmarks/rules_frontier.py --out frontier.json [--repeats 2] [--max-tokens 64]

Greedy and temperature 0.7, the shipped prompt files (example + grounded), the draft length from the cost model
(`--draft-policy auto`, up to --k) or fixed (--policy fixed --k K), each mode at its own taus (a tau means
something else for every rule), plus the ar and sd baselines, interleaved as `fsd-local bench` does. Writes the
summary rows (with on_frontier, and on_frontier_tpr: the frontier with tokens per target call as the speed) as
JSON and prints the frontier of each temperature.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fsd_local import Engine
from fsd_local.bench import runner
from fsd_local.bench.frontier import frontier, frontier_rows, mark_frontier
from fsd_local.bench.prompts import EXAMPLE_FILE, load_prompts
from fsd_local.bench.report import format_table
from fsd_local.bench.runner import Config, run_bench, summarise
from fsd_local.pairs.demo import demo_pair

TAUS = {  # from a probe on 4 prompts: from little rescue to nearly all drafts accepted, for each rule
    "fsd": (0.1, 0.2, 0.3),
    "fsd-entropy": (0.15, 0.3, 0.6),
    "typical": (0.9, 0.97, 1.05),
    "cascade": (0.2, 0.5, 0.8),
    "relaxed": (0.05, 0.15, 0.3),
}
POLICY = {"draft_policy": "auto"}


def policy_settings(self, max_tokens: int, seed: int) -> dict:
    s = ORIGINAL(self, max_tokens, seed)
    if self.draft_max is not None:
        s.update(POLICY)  # auto: k per round from the cost model, up to draft_max
    return s


ORIGINAL = Config.settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--modes", default=",".join(TAUS))
    ap.add_argument("--prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    ap.add_argument("--policy", default="auto", choices=("auto", "fixed"))
    ap.add_argument("--k", type=int, default=8, help="draft length (fixed) or its upper bound (auto)")
    ap.add_argument("--threads", type=int, default=1, help="1 leaves the other core to a neighbour's benchmark")
    ap.add_argument("--taus", default="", help="mode=t1/t2/...;mode=... overrides the built-in taus")
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    args = ap.parse_args()
    Config.settings = policy_settings  # type: ignore[method-assign]
    POLICY["draft_policy"] = args.policy
    taus = dict(TAUS)
    for item in filter(None, args.taus.split(";")):
        mode, values = item.split("=")
        taus[mode] = tuple(float(v) for v in values.split("/"))
    prompts = load_prompts(str(EXAMPLE_FILE)) + load_prompts(str(EXAMPLE_FILE).replace("example", "grounded"))
    if args.prompts:
        prompts = prompts[: args.prompts]
    configs = []
    for t in (float(x) for x in args.temps.split(",")):
        configs += [Config("ar", t), Config("sd", t, draft_max=args.k)]
        for mode in args.modes.split(","):
            div = "js" if mode in runner.DIVERGENCE_MODES else None
            configs += [Config(mode, t, div, tau, args.k) for tau in taus[mode]]
    draft, target = (args.draft, args.target) if args.target else demo_pair(precision="f16")
    t0 = time.time()
    done = [0]

    def progress():
        done[0] += 1
        if done[0] % 10 == 0:
            print(f"{done[0]}/{len(configs) * len(prompts) * args.repeats} {time.time() - t0:.0f}s", file=sys.stderr)

    with Engine(target=str(target), draft=str(draft), n_ctx=1024, n_threads=args.threads) as eng:
        data = run_bench(eng, prompts, configs, max_tokens=args.max_tokens, repeats=args.repeats, progress=progress)
    rows = mark_frontier(summarise(data))
    for r, c in zip(rows, configs):
        r["k_mean"] = None if c.draft_max is None else _k_mean(data.runs[configs.index(c)])
    # the hardware-free speed: tokens per target call (ar: 1), against the same qualities
    for flag, quality in (("on_frontier_tpr", "target_logprob_mean"), ("on_frontier_tpr_agreement", "agreement")):
        for t in {r["temperature"] for r in rows}:
            at = [r for r in rows if r["temperature"] == t]
            pts = [None if r[quality] is None else (r["mean_tokens_per_round"], r[quality]) for r in at]
            for r, on in zip(at, frontier(pts)):
                r[flag] = on
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "prompts": len(prompts), "rows": rows}, f)
    print(format_table(rows))
    for t in sorted({r["temperature"] for r in rows}):
        print(f"\nfrontier at temperature {t:g}:")
        print(format_table(frontier_rows(rows, t)))


def _k_mean(runs) -> float | None:
    """Mean draft length the cost model chose (k_histogram of every run)."""
    hist: list[int] = []
    for run in runs:
        for k, n in enumerate(run.stats.get("k_histogram", [])):
            hist += [0] * (k + 1 - len(hist))
            hist[k] += n
    total = sum(hist)
    return sum(k * n for k, n in enumerate(hist)) / total if total else None


if __name__ == "__main__":
    main()
