"""Load check for `fsd-local serve` (a script, not a unit test): N concurrent clients against the server on the
SmolLM2 demo pair, then RSS before/after a run of further requests.

    python tests/serve_load.py --clients 8 --requests 64 --max-tokens 32 [--tau 0.2] [--threads 2] [--max-queue N]

Prints one JSON object: requests answered and refused (503, with the Retry-After values sent; the queue has
the server's default depth unless --max-queue says otherwise), requests per second, latency quantiles,
generated tokens per second, acceptance, and the process's RSS (MiB) before and after the memory run. The
server runs in this process (BackgroundServer), so /proc/self/status measures it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from fsd_local import Engine
from fsd_local.pairs.demo import demo_pair
from fsd_local.server import BackgroundServer
from fsd_local.settings import SERVER_MAX_QUEUE

TOPICS = ["the sea", "a city at night", "bread", "a mountain", "rain", "a library", "the moon", "a garden"]


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--memory-requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tau", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-queue", type=int, default=SERVER_MAX_QUEUE)
    args = ap.parse_args()

    draft, target = demo_pair()
    with (
        Engine(target=str(target), draft=str(draft), n_ctx=2048, n_threads=args.threads) as engine,
        BackgroundServer(engine, max_queue=args.max_queue) as srv,
        httpx.Client(base_url=srv.url, timeout=600, limits=httpx.Limits(max_connections=args.clients)) as http,
    ):

        def ask(i: int) -> tuple[float, dict | None]:
            body = {
                "model": "demo",
                "max_tokens": args.max_tokens,
                "tau": args.tau,
                "messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]}."}],
            }
            t = time.perf_counter()
            r = http.post("/v1/chat/completions", json=body)
            if r.status_code == 503:
                refused.append(r.headers.get("retry-after"))
                return time.perf_counter() - t, None
            r.raise_for_status()
            return time.perf_counter() - t, r.json()

        refused: list[str | None] = []
        for i in range(2):  # first calls compile and warm caches
            ask(i)
        with ThreadPoolExecutor(args.clients) as pool:
            t0 = time.perf_counter()
            results = [x for x in pool.map(ask, range(args.requests)) if x[1] is not None]
            wall = time.perf_counter() - t0
            refused_main = list(refused)
            latencies = sorted(lat for lat, _ in results)
            tokens = sum(r["usage"]["completion_tokens"] for _, r in results)
            accepted = sum(r["fsd"]["accepted_sd"] + r["fsd"]["accepted_fuzzy"] for _, r in results)
            drafted = sum(r["fsd"]["drafted"] for _, r in results)

            rss_before = rss_mib()
            list(pool.map(ask, range(args.memory_requests)))
            rss_after = rss_mib()

    print(
        json.dumps(
            {
                "clients": args.clients,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "tau": args.tau,
                "max_queue": args.max_queue,
                "answered": len(results),
                "refused_503": len(refused_main),
                "retry_after_values": sorted(set(map(str, refused_main))),
                "requests_per_second": round(len(results) / wall, 3),
                "latency_s": {
                    "median": round(statistics.median(latencies), 3),
                    "p90": round(latencies[int(0.9 * (len(latencies) - 1))], 3),
                    "max": round(latencies[-1], 3),
                },
                "completion_tokens_per_second": round(tokens / wall, 1),
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "rss_mib": {
                    "before": round(rss_before, 1),
                    f"after_{args.memory_requests}_requests": round(rss_after, 1),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
