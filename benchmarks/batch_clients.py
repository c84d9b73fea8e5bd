"""Several clients on one Engine at once (issue 42's goals, through the Python API): each client a thread sending
chat requests (the chat prompts, max_tokens each) to one Engine, on an Engine with parallel=N (batched) and on
one with parallel=1 (the same requests taking turns); aggregate tokens per second = every reply's tokens / wall
seconds from the first request to the last reply; with --alone also one client on the parallel=N Engine (the
batch machinery with no load). Each configuration in a fresh process with no cost store (FSD_LOCAL_COSTS=off:
EMPTY), interleaved per repeat; ratios side by side, and how often the batch drafted each k (a call a round).

    python benchmarks/batch_clients.py --demo f16 --clients 4 --requests 8 --tokens 64 --modes ar,fsd --alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from time import perf_counter

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "fsd_local" / "data" / "prompts-chat.jsonl"
MODES = {
    "ar": {"mode": "ar"},
    "sd": {"mode": "sd"},
    "fsd": {"mode": "fsd", "divergence": "js", "tau": 0.2},
}


def child(a) -> dict:
    from fsd_local import Engine

    parallel, mode, clients = (a.child + ":0").split(":")[:3]
    n_clients = int(clients) or a.clients
    prompts = [json.loads(line)["prompt"] for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[: a.prompts]
    settings = {**MODES[mode], "max_tokens": a.tokens, "temperature": 0.0, "ignore_eos": True}
    n_ctx = 1024 * int(parallel)
    with Engine(target=a.target, draft=a.draft, n_ctx=n_ctx, n_threads=a.threads, parallel=int(parallel)) as eng:
        eng.chat([{"role": "user", "content": "Hi"}], **{**settings, "max_tokens": 4})  # untimed: first touches
        todo = list(range(a.requests))
        lock = threading.Lock()
        tokens = [0] * n_clients

        def client(c: int) -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    r = todo.pop(0)
                msg = [{"role": "user", "content": prompts[r % len(prompts)]}]
                tokens[c] += len(eng.chat(msg, **settings).token_ids)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
        t0 = perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = perf_counter() - t0
        ks = dict(sorted(eng.batch.k_counts.items())) if eng.batch is not None else {}
    return {"tokens": sum(tokens), "seconds": wall, "rate": sum(tokens) / wall, "ks": ks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", choices=("f16", "wide", "q4_1"), default="f16")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8, help="requests in all, shared by the clients")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", default="ar,fsd")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--alone", action="store_true", help="also one client on the parallel=N Engine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.target is None:
        from fsd_local.pairs.demo import demo_pair

        d, t = demo_pair(precision=a.demo)
        a.target, a.draft = str(t), str(d)
    if a.child:
        print(json.dumps(child(a)))
        return
    configs = [f"{p}:{m}" for m in a.modes.split(",") for p in (1, a.clients)]
    configs += [f"{a.clients}:{m}:1" for m in a.modes.split(",")] if a.alone else []
    print(f"target {a.target}\ndraft {a.draft}\n{a.clients} clients, {a.requests} requests x {a.tokens} tokens")
    print("cost store EMPTY (FSD_LOCAL_COSTS=off), each configuration a fresh process, greedy, ignore_eos")
    rates: dict[str, list[float]] = {c: [] for c in configs}
    env = {**os.environ, "FSD_LOCAL_COSTS": "off"}
    base = [sys.executable, __file__, "--target", a.target, "--draft", a.draft, "--threads", str(a.threads)]
    base += ["--clients", str(a.clients), "--requests", str(a.requests), "--prompts", str(a.prompts)]
    base += ["--tokens", str(a.tokens)]
    for r in range(a.repeats):
        for c in configs:
            out = subprocess.run([*base, "--child", c], capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(f"{c} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            rates[c].append(res["rate"])
            ks = " ".join(f"k{k}:{n}" for k, n in res["ks"].items())
            print(
                f"repeat {r} {c:>8}: {res['tokens']} tokens in {res['seconds']:.2f} s = {res['rate']:.1f} tok/s", end=""
            )
            print(f" (batch's k, a call a round: {ks})" if ks else "")
    mean = {c: sum(v) / len(v) for c, v in rates.items()}
    print("\nconfig (parallel:mode[:clients]) | tok/s (mean)")
    for c in configs:
        print(f"{c:>32} | {mean[c]:.1f}")
    n = a.clients
    for m in a.modes.split(","):
        print(f"{m}: {n} at once / one at a time = {mean[f'{n}:{m}'] / mean[f'1:{m}']:.2f}")
        if m != "ar" and f"{n}:ar" in mean:
            print(f"{m} at {n} at once / ar at {n} at once = {mean[f'{n}:{m}'] / mean[f'{n}:ar']:.2f}")
        if f"{n}:{m}:1" in mean:
            print(f"{m}: one client, parallel={n} / parallel=1 = {mean[f'{n}:{m}:1'] / mean[f'1:{m}']:.3f}")


if __name__ == "__main__":
    main()
