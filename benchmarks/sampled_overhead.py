"""The loop's own time per round under the samplings a user meets, taken from outside the loop as issue 39 took it:
the wall time of each `Engine.generate` call minus the time inside llama.cpp's decode and synchronize calls, per
round, best of the repeats. A temperature alone (0.7: what an OpenAI-API client sends, every row untruncated) with
fsd js 0.3 and sd, chat's defaults with fsd js 0.3, greedy sd and fsd js 0.3; each model its own draft, fixed k 4.
With --against, the same configurations in a second checkout of fsd-local (say, main before a change), in fresh
processes that alternate with this checkout's repeat by repeat, so that each ratio comes from one run on a host
whose speed drifts. --light adds a light model of the target's vocabulary (benchmarks/cache_refill.py: its decode
leaves the CPU's caches as a GPU's does), --demo the engine-side share of the wall time on the demo pair.

    python benchmarks/sampled_overhead.py --target gemma-3-270m-q4_k_m.gguf [--against DIR] [--light] [--demo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter

HERE = Path(__file__).resolve().parent
CHAT = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}
FSD = {"mode": "fsd", "tau": 0.3, "divergence": "js"}
CONFIGS = {
    "T 0.7 fsd js 0.3": {**FSD, "temperature": 0.7},
    "T 0.7 sd": {"mode": "sd", "temperature": 0.7},
    "chat fsd js 0.3": {**FSD, **CHAT},
    "greedy sd": {"mode": "sd"},
    "greedy fsd js 0.3": FSD,
}
DEMO = {"T 0.7 fsd js 0.2": {**FSD, "tau": 0.2, "temperature": 0.7}, "T 0.7 sd": {"mode": "sd", "temperature": 0.7}}


def run_configs(eng, texts: list[str], configs: dict, tokens: int) -> dict:
    """One pass over every configuration: per configuration, the rounds, the calls' own seconds (outside
    llama.cpp), the statistics' `other` seconds, the draft and verify phases outside their decodes, the policy and
    advance phases, the wall seconds."""
    base = {"draft_policy": "fixed", "draft_max": 4, "logprobs": False, "seed": 1}
    ids = [eng.tokenize(t) for t in texts]
    models = [m for m in (eng.target, eng.draft) if m is not None]
    out = {}
    for label, s in configs.items():
        eng.reset()
        eng.generate(ids[0], **base, **s, max_tokens=8)  # untimed: kernels, caches
        row = {"rounds": 0, "own": 0.0, "other": 0.0, "verify_own": 0.0, "wall": 0.0, "tokens": 0}
        row |= {"draft_own": 0.0, "policy": 0.0, "advance": 0.0}
        for p in ids:
            eng.reset()
            inside = sum(m.decode_seconds for m in models)
            t = perf_counter()
            st = eng.generate(p, **base, **s, max_tokens=tokens).stats
            wall = perf_counter() - t
            row["own"] += wall - (sum(m.decode_seconds for m in models) - inside)
            row["rounds"] += st["rounds"]
            row["tokens"] += st["tokens"]
            row["other"] += st["seconds"]["other"]
            row["verify_own"] += st["phase_seconds"]["verify"] - st["seconds"]["target"]
            row["draft_own"] += st["phase_seconds"]["draft"] - st["seconds"]["draft"]
            row["policy"] += st["phase_seconds"]["policy"]
            row["advance"] += st["phase_seconds"]["advance"]
            row["wall"] += st["seconds_total"]
        out[label] = row
    return out


def _worker_main(spec: dict) -> None:
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.engine import Engine

    texts = [p.text for p in load_prompts()[: spec["prompts"]]]
    draft = spec.get("draft") or spec["target"]
    with Engine(target=spec["target"], draft=draft, n_threads=spec.get("threads", 2), draft_policy="fixed") as eng:
        print(json.dumps(run_configs(eng, texts, spec["configs"], spec["tokens"])))


def _run(checkout: Path, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(HERE / "sampled_overhead.py"), "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker in {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(checkouts: dict[str, Path], spec: dict, repeats: int) -> dict[str, dict[str, list[dict]]]:
    """{checkout: {config: [one row per repeat]}}, the checkouts alternating repeat by repeat."""
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name in checkouts}
    for _ in range(repeats):
        for name, path in checkouts.items():
            for label, row in _run(path, spec).items():
                runs[name].setdefault(label, []).append(row)
    return runs


def report(title: str, runs: dict[str, dict[str, list[dict]]]) -> None:
    names = list(runs)
    repeats = len(next(iter(runs[names[0]].values())))
    print(f"{title}: the loop's own us per round (outside llama.cpp, best of {repeats})")
    for label in runs[names[0]]:
        best = {n: min(r["own"] / r["rounds"] * 1e6 for r in runs[n][label]) for n in names}
        cells = "  ".join(f"{n} {best[n]:7.0f}" for n in names)
        ratio = f"  ratio {best[names[0]] / best[names[1]]:.2f}" if len(names) > 1 else ""
        rounds = runs[names[0]][label][0]["rounds"]
        print(f"{label:>22}  {cells}{ratio}  (rounds {rounds})", flush=True)


def report_share(runs: dict[str, dict[str, list[dict]]]) -> None:
    print("demo pair: engine-side share of the wall time (stats seconds.other; the verify phase outside the decode)")
    for name, configs in runs.items():
        for label, rows in configs.items():
            other = min(r["other"] / r["wall"] for r in rows)
            verify = min(r["verify_own"] / r["wall"] for r in rows)
            own = min(r["own"] / r["rounds"] * 1e6 for r in rows)
            shares = f"other {other:6.2%}  verify outside decode {verify:6.2%}"
            print(f"{name:>8} {label:>18}  {shares}  own us/round {own:6.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--target", help="a GGUF, its own draft (Gemma 3 270M: vocabulary 262,144)")
    ap.add_argument("--draft", help="ignored: the target and the light model are each their own draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", type=Path, help="a second checkout of fsd-local to run side by side")
    ap.add_argument("--light", action="store_true", help="also a light model of the target's vocabulary")
    ap.add_argument("--demo", action="store_true", help="also the demo pair's engine-side share, 256 tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write every repeat's figures here")
    a = ap.parse_args()
    if a.worker:
        return _worker_main(json.loads(a.worker))
    sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's fsd_local (the workers get it through PYTHONPATH)
    checkouts = {"this": HERE.parent} | ({"against": a.against.resolve()} if a.against else {})
    spec = {"target": a.target, "configs": CONFIGS, "tokens": a.tokens, "prompts": a.prompts, "threads": a.threads}
    record: dict[str, dict] = {}
    if a.target:
        record["target"] = measure(checkouts, spec, a.repeats)
        report("target", record["target"])
    if a.light:
        from cache_refill import light_model

        from fsd_local.llama.model import Model
        from fsd_local.llama.options import ModelOptions

        m = Model(ModelOptions(a.target, vocab_only=True))
        vocab = m.n_vocab
        m.close()
        with tempfile.TemporaryDirectory() as d:
            light = str(light_model(vocab, Path(d)))
            record["light"] = measure(checkouts, {**spec, "target": light}, a.repeats)
            report(f"light model ({vocab} tokens)", record["light"])
    if a.demo:
        from fsd_local.pairs.demo import demo_pair

        draft, target = demo_pair()
        demo = {**spec, "target": str(target), "draft": str(draft), "configs": DEMO, "tokens": 256}
        record["demo"] = measure(checkouts, demo, a.repeats)
        report_share(record["demo"])
    if a.json:
        a.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
