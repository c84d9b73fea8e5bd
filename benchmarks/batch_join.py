"""A long prompt joining a busy batch (issue 42, chunked prefill): three clients stream `ar` replies on one Engine
(parallel=4); once each has streamed, a fourth call with a prompt of --prompt-tokens joins. Printed per chunk size:
the running streams' worst gap between pieces while the prompt is evaluated, their median gap before it, and the
joining call's time to its first token. Each chunk size in a fresh process, cost store EMPTY.

    python benchmarks/batch_join.py --demo f16 --prompt-tokens 1024 --chunks 32,64,256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from time import perf_counter

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "fsd_local" / "data" / "prompts-chat.jsonl"


def child(a) -> dict:
    from fsd_local import Engine

    text = " ".join(json.loads(line)["prompt"] for line in CHAT_PROMPTS.read_text().splitlines() if line.strip())
    settings = {"mode": "ar", "temperature": 0.0, "ignore_eos": True}
    with Engine(target=a.target, draft=a.draft, n_ctx=4096, n_threads=a.threads, parallel=4) as eng:
        eng.batch.prefill_chunk = int(a.child)
        long = (eng.tokenize(text) * (1 + a.prompt_tokens // len(eng.tokenize(text))))[: a.prompt_tokens]
        eng.generate("Hi", max_tokens=4, **settings)  # untimed: first touches
        times: list[list[float]] = [[] for _ in range(3)]
        streaming = threading.Barrier(4)

        def client(c: int) -> None:
            prompt = json.loads(CHAT_PROMPTS.read_text().splitlines()[c])["prompt"]
            for n, _ in enumerate(eng.stream(prompt, max_tokens=a.tokens, **settings)):
                times[c].append(perf_counter())
                if n == min(8, a.tokens // 4):
                    streaming.wait(60)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(3)]
        for t in threads:
            t.start()
        streaming.wait(60)
        t0 = perf_counter()
        stream = eng.stream(long, max_tokens=4, **settings)
        next(stream)
        first = perf_counter()
        for _ in stream:
            pass
        for t in threads:
            t.join()
    gaps = [b - x for ts in times for x, b in zip(ts, ts[1:]) if b > t0 and x < first]
    before = [b - x for ts in times for x, b in zip(ts, ts[1:]) if b <= t0]
    return {
        "worst_gap": max(gaps, default=0.0),
        "median_before": statistics.median(before),
        "first_token": first - t0,
        "chunks": sum(1 for c in eng.batch.chunks if c[2] == "target"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", choices=("f16", "wide", "q4_1"), default="f16")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=160, help="each running stream's reply")
    ap.add_argument("--chunks", default="32,64,256", help="prefill chunk sizes (256: a decode of n_batch / 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.target is None:
        from fsd_local.pairs.demo import demo_pair

        d, t = demo_pair(precision=a.demo)
        a.target, a.draft = str(t), str(d)
    if a.child:
        print(json.dumps(child(a)))
        return
    print(f"target {a.target}\n3 streams of {a.tokens} tokens (ar, greedy); a {a.prompt_tokens}-token prompt joins")
    print("cost store EMPTY (FSD_LOCAL_COSTS=off), each chunk size a fresh process\n")
    print("chunk | target chunks | median gap before (ms) | worst gap while it joins (ms) | its first token (s)")
    env = {**os.environ, "FSD_LOCAL_COSTS": "off"}
    base = [sys.executable, __file__, "--target", a.target, "--draft", a.draft, "--threads", str(a.threads)]
    base += ["--prompt-tokens", str(a.prompt_tokens), "--tokens", str(a.tokens)]
    for c in a.chunks.split(","):
        out = subprocess.run([*base, "--child", c], capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"chunk {c} failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{c:>5} | {r['chunks']:>13} | {1e3 * r['median_before']:>22.1f} | {1e3 * r['worst_gap']:>29.1f} |"
            f" {r['first_token']:>18.2f}"
        )


if __name__ == "__main__":
    main()
