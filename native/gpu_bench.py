"""Timing loop for native/gpu_check.sh: ar / sd / fsd at two taus on the SmolLM2 demo pair, fully offloaded.

A stand-in written before `fsd-local bench` had a command line: the same prompts for every mode, modes
interleaved within each repeat (a noisy neighbour slows all alike), the median over repeats reported.

    python native/gpu_bench.py --out bench.json [--repeats 3] [--max-tokens 128] [--ngl -1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from fsd_local import Engine, ModelOptions
from fsd_local.backend import detect
from fsd_local.demo import demo_pair

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Write a short story about a robot who learns to paint."]
CONFIGS = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), "fsd tau=0.1": dict(mode="fsd", tau=0.1),
           "fsd tau=0.3": dict(mode="fsd", tau=0.3)}


def run(repeats: int, max_tokens: int, ngl: int) -> dict:
    draft, target = demo_pair()
    per = {name: {"tps": [], "acceptance": [], "tokens_per_round": []} for name in CONFIGS}
    with Engine(target=ModelOptions(str(target), n_ctx=2048, n_gpu_layers=ngl),
                draft=ModelOptions(str(draft), n_ctx=2048, n_gpu_layers=ngl, split_mode="none")) as eng:
        for name, s in CONFIGS.items():  # warm-up: kernels, Numba, CUDA graphs
            eng.generate(PROMPTS[0], max_tokens=16, **s)
        for _ in range(repeats):
            for name, s in CONFIGS.items():
                tokens = seconds = 0.0
                acc, tpr = [], []
                for prompt in PROMPTS:
                    eng.reset()  # every mode starts from an empty cache, as the others did
                    st = eng.generate(prompt, max_tokens=max_tokens, **s).stats
                    tokens += st["tokens"]
                    seconds += st["tokens"] / st["tokens_per_second"] if st["tokens_per_second"] else 0.0
                    acc.append(st["acceptance_rate"])
                    tpr.append(st["mean_tokens_per_round"])
                per[name]["tps"].append(tokens / seconds if seconds else 0.0)
                per[name]["acceptance"].append(statistics.mean(acc))
                per[name]["tokens_per_round"].append(statistics.mean(tpr))
    ar = statistics.median(per["ar"]["tps"])
    rows = [{"config": name, "tokens_per_second": statistics.median(v["tps"]),
             "speedup_vs_ar": statistics.median(v["tps"]) / ar if ar else None,
             "acceptance_rate": statistics.median(v["acceptance"]),
             "tokens_per_round": statistics.median(v["tokens_per_round"])} for name, v in per.items()]
    info = detect()
    return {"pair": "SmolLM2-135M drafting for its 44-layer upscaled copy (demo pair)", "ngl": ngl,
            "repeats": repeats, "max_tokens": max_tokens, "prompts": len(PROMPTS),
            "devices": [f"{d.name}: {d.description}" for d in info.gpus], "llama_cpp": info.llama_cpp,
            "rows": rows}


def table(result: dict) -> str:
    lines = [f"{'config':<14}{'tok/s':>9}{'vs ar':>8}{'accept':>8}{'tok/round':>11}"]
    for r in result["rows"]:
        lines.append(f"{r['config']:<14}{r['tokens_per_second']:>9.1f}{r['speedup_vs_ar'] or 0:>8.2f}"
                     f"{r['acceptance_rate']:>8.2f}{r['tokens_per_round']:>11.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file for the numbers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ngl", type=int, default=-1, help="GPU layers for both models (-1 = all)")
    a = p.parse_args(argv)
    result = run(a.repeats, a.max_tokens, a.ngl)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
