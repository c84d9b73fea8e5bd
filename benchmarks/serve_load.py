"""`fsd-local serve` under load, through the real server (a fresh `fsd-local serve` process per configuration,
its models in the supervised model process, cost store EMPTY: FSD_LOCAL_COSTS=off):

- `--clients` clients share `--requests` chat requests (the first `--prompts` chat prompts, `--tokens` each,
  greedy, ignore_eos) on `--parallel N` against `--parallel 1` (the same requests taking turns); aggregate
  tokens/s from the first request to the last reply, per mode;
- one request at a time (`--alone`): this tree's server (default --parallel) against another tree's (`--base`,
  e.g. /work/main), interleaved, best of `--repeats`;
- `--soak SECONDS`: 16 clients of mixed requests (modes, streams, streams closed early, tools, JSON schemas, the
  Ollama route); answers by status code, 5xx counted, memory (RSS of the server and its model process) after
  the warm-up and at the end.

    python benchmarks/serve_load.py --demo f16 --clients 4 --requests 8 --tokens 64 --modes ar,fsd --alone 6
    python benchmarks/serve_load.py --demo f16 --soak 240
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from time import perf_counter

import httpx

ROOT = Path(__file__).resolve().parent.parent
CHAT_PROMPTS = ROOT / "fsd_local" / "data" / "prompts-chat.jsonl"
MODES = {"ar": {"mode": "ar"}, "sd": {"mode": "sd"}, "fsd": {"mode": "fsd", "divergence": "js", "tau": 0.2}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok"]}


def prompts(n: int) -> list[str]:
    lines = [json.loads(line)["prompt"] for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()]
    return lines[:n]


class Server:
    """`fsd-local serve` of the tree at `root` on a free port, until stop()."""

    def __init__(self, a, root: Path, *extra: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "fsd_local.cli", "serve", "--target", a.target, "--draft", a.draft]
        cmd += ["--ctx", str(a.ctx), "--threads", str(a.threads), "--port", str(self.port), *extra]
        env = {**os.environ, "FSD_LOCAL_COSTS": "off", "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start: {self.proc.stderr.read().decode()[-3000:]}")
            time.sleep(0.2)

    def rss_mib(self) -> float:
        """Resident memory of the server process and its children (the model process)."""
        pids = [self.proc.pid]
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():  # children of any of its threads
            try:
                pids += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        total = 0.0
        for pid in pids:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        return total

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def chat(url: str, prompt: str, tokens: int, mode: dict, **kw) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, **mode, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=600)


def load(url: str, ps: list[str], clients: int, requests: int, tokens: int, mode: dict) -> tuple[int, float, list]:
    """(tokens, seconds, each reply's statistics): `clients` threads sharing `requests` greedy chat requests."""
    todo, lock, made, stats = list(range(requests)), threading.Lock(), [0] * clients, []

    def client(c: int) -> None:
        while True:
            with lock:
                if not todo:
                    return
                r = todo.pop(0)
            reply = chat(url, ps[r % len(ps)], tokens, mode, temperature=0.0, ignore_eos=True)
            reply.raise_for_status()
            made[c] += reply.json()["usage"]["completion_tokens"]
            stats.append(reply.json()["fsd"])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(made), perf_counter() - t0, stats


def rounds_seen(stats: list) -> str:
    """What the replies' rounds were: k chosen (histogram over rounds), acceptance, target rows per verify."""
    ks: list[int] = []
    rows: Counter[int] = Counter()
    secs: Counter[int] = Counter()
    for st in stats:
        hist = st.get("k_histogram") or []
        ks += [0] * (len(hist) - len(ks))
        for k, n in enumerate(hist):
            ks[k] += n
        for n, count, seconds in st.get("verify_by_batch") or []:
            rows[n] += count
            secs[n] += seconds
    drafted = sum(st.get("drafted", 0) for st in stats)
    accepted = sum(st.get("accepted_sd", 0) + st.get("accepted_fuzzy", 0) for st in stats)
    verify = " ".join(f"{n}:{rows[n]}x{1000 * secs[n] / rows[n]:.1f}ms" for n in sorted(rows))
    return f"k histogram {ks}, accepted {accepted}/{drafted}, verify rows:count x mean [{verify}]"


def throughput(a, ps: list[str]) -> None:
    """Passes interleaved (every mode and --parallel in each pass) so that ratios compare neighbouring runs; with
    --same-server each pass runs its modes on one server per --parallel, in the order m1..mk mk..m1 (a mode's
    rate is the mean of its two runs), so that no ratio compares two processes."""
    modes = a.modes.split(",")
    single = modes if a.single is None else [m for m in a.single.split(",") if m]
    print(f"\n== {a.clients} clients, {a.requests} requests x {a.tokens} tokens: --parallel {a.clients} vs 1, ")
    print(f"{a.repeats} interleaved passes; --parallel 1 for {single}; one server a pass: {a.same_server}")
    rates: dict[str, list[float]] = {}
    for r in range(a.repeats):
        for p, ms in [(a.clients, modes), (1, single)]:
            runs = [[m] for m in ms] if not a.same_server else [ms + ms[::-1]] if ms else []
            for order in runs:
                srv = Server(a, ROOT, "--parallel", str(p))
                try:
                    seen: dict[str, list[float]] = {}
                    for m in order:
                        chat(srv.url, "Hi", 4, MODES[m])  # untimed: first touches
                        n, s, stats = load(srv.url, ps, a.clients, a.requests, a.tokens, MODES[m])
                        seen.setdefault(m, []).append(n / s)
                        print(
                            f"pass {r} --parallel {p} {m:>4}: {n} tokens in {s:.2f} s = {n / s:.1f} tok/s; "
                            f"{rounds_seen(stats)}",
                            flush=True,
                        )
                finally:
                    srv.stop()
                for m, xs in seen.items():
                    rates.setdefault(f"{p}:{m}", []).append(sum(xs) / len(xs))
    c = a.clients
    for m in modes:
        for other, label in [(f"1:{m}", f"{m} one at a time"), (f"{c}:ar", f"ar at {c}")]:
            if other == f"{c}:{m}" or other not in rates:
                continue
            each = [x / y for x, y in zip(rates[f"{c}:{m}"], rates[other], strict=True)]
            print(
                f"{m} at {c} / {label}: per pass {' '.join(f'{x:.3f}' for x in each)}; "
                f"mean {sum(each) / len(each):.3f}; best/best {max(rates[f'{c}:{m}']) / max(rates[other]):.3f}"
            )


def alone(a, ps: list[str]) -> None:
    """One request at a time on this tree's server (default --parallel) and on --base's, interleaved."""
    print(f"\n== one request at a time: {a.alone} requests x {a.tokens} tokens, ar, best of {a.repeats}")
    trees = {"this": ROOT, "base": Path(a.base)}
    best: dict[str, float] = {}
    for r in range(a.repeats):
        for name, root in trees.items():
            srv = Server(a, root)
            try:
                chat(srv.url, "Hi", 4, MODES["ar"])
                n, s, _ = load(srv.url, ps, 1, a.alone, a.tokens, MODES["ar"])
            finally:
                srv.stop()
            best[name] = max(best.get(name, 0.0), n / s)
            print(f"repeat {r} {name} ({root}): {n} tokens in {s:.2f} s = {n / s:.1f} tok/s", flush=True)
    print(f"this / base, one at a time = {best['this'] / best['base']:.3f}")


def soak(a, ps: list[str]) -> None:
    print(f"\n== soak: 16 clients of mixed requests for {a.soak} s, default --parallel, --tokens {a.soak_tokens}")
    srv = Server(a, ROOT)
    codes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    refused: dict[str, str] = {}  # the first answer of each kind and status that was not 200
    stop = threading.Event()
    rss: list[float] = []

    def one(rng: random.Random) -> None:
        p, n = rng.choice(ps), a.soak_tokens
        mode = MODES[rng.choice(list(MODES))]
        kind = rng.choice(["whole", "stream", "cancel", "tools", "json", "ollama"])
        kinds[kind] += 1
        body = {"model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": n, **mode}
        if kind == "tools":
            body.update(tools=TOOLS, tool_choice=rng.choice(["auto", "required"]))
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
        if kind in ("stream", "cancel"):
            with httpx.stream(
                "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=600
            ) as r:
                codes[str(r.status_code)] += 1
                if r.status_code != 200:
                    r.read()
                    refused.setdefault(f"{kind} {r.status_code}", r.text[:300])
                for i, _ in enumerate(r.iter_lines()):
                    if kind == "cancel" and i == 4:
                        break
            return
        if kind == "ollama":
            ob = {"model": "m", "messages": body["messages"], "options": {"num_predict": n, **mode}}
            r = httpx.post(srv.url + "/api/chat", json=ob, timeout=600)
        else:
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=600)
        codes[str(r.status_code)] += 1
        if r.status_code != 200:
            refused.setdefault(f"{kind} {r.status_code}", f"{body.get('mode')}: {r.text[:300]}")

    def client(c: int) -> None:
        rng = random.Random(c)
        while not stop.is_set():
            try:
                one(rng)
            except httpx.HTTPError as exc:
                codes[type(exc).__name__] += 1

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(a.warmup)
        rss.append(srv.rss_mib())
        while time.monotonic() - t0 < a.soak:
            time.sleep(5)
            rss.append(srv.rss_mib())
        stop.set()
        for t in threads:
            t.join(600)
        health = httpx.get(srv.url + "/health", timeout=30).json()
    finally:
        srv.stop()
    fives = sum(n for c, n in codes.items() if c.startswith("5"))
    print(f"requests by kind: {dict(sorted(kinds.items()))}")
    print(f"answers by status: {dict(sorted(codes.items()))}; 5xx: {fives}")
    for what, text in sorted(refused.items()):
        print(f"first {what}: {text}")
    print(
        f"RSS (server + model process), MiB: after {a.warmup} s warm-up {rss[0]:.0f}, end {rss[-1]:.0f}, "
        f"max {max(rss):.0f}; samples every 5 s: {' '.join(f'{x:.0f}' for x in rss)}"
    )
    print(f"health at the end: {health['status']}, slots {[s['state'] for s in health['slots']]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", choices=("f16", "wide", "q4_1"), default="f16")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", default="ar", help="comma-separated, for the --parallel comparison ('' skips it)")
    ap.add_argument("--single", help="modes also run with --parallel 1 (comma-separated; default: --modes)")
    ap.add_argument("--same-server", action="store_true", help="each pass runs its modes on one server (ABBA)")
    ap.add_argument("--alone", type=int, default=0, help="requests one at a time against --base (0 skips it)")
    ap.add_argument("--base", default="/work/main", help="the tree --alone compares against")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--soak", type=int, default=0, help="seconds of the 16-client soak (0 skips it)")
    ap.add_argument("--soak-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=30)
    a = ap.parse_args()
    if a.target is None:
        from fsd_local.pairs.demo import demo_pair

        d, t = demo_pair(precision=a.demo)
        a.target, a.draft = str(t), str(d)
    ps = prompts(a.prompts)
    print(f"target {a.target}\ndraft {a.draft}\ncost store EMPTY (FSD_LOCAL_COSTS=off), a fresh server each time")
    if a.modes:
        throughput(a, ps)
    if a.alone:
        alone(a, ps)
    if a.soak:
        soak(a, ps)


if __name__ == "__main__":
    main()
