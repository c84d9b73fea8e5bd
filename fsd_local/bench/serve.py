"""`fsd-local bench --serve`: `clients` clients at once send `requests` chat requests to the OpenAI route of the app,
served in this process on a free loopback port, after two untimed ones; reports requests answered and refused
(503), latency quantiles, tokens/s, acceptance and this process's resident memory before and after."""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsd_local.server.running import BackgroundServer

if TYPE_CHECKING:
    from fsd_local.engine import Engine


def rss_mib() -> float | None:
    """This process's resident memory, where /proc says it (Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) / 1024 for line in text.splitlines() if line.startswith("VmRSS:")), None)


def _ask(url: str, prompt: str, max_tokens: int) -> tuple[float, dict | None, str | None]:
    """(seconds, reply or None when refused, Retry-After of a refusal)."""
    body = {"model": "bench", "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            raise
        return time.perf_counter() - t, None, exc.headers.get("Retry-After")
    return time.perf_counter() - t, reply, None


def measure(engine: Engine, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    with BackgroundServer(engine, model_name="bench") as srv:
        for p in prompts[:2]:
            _ask(srv.url, p, max_tokens)
        rss_before = rss_mib()
        with ThreadPoolExecutor(clients) as pool:
            t0 = time.perf_counter()
            done = list(pool.map(lambda i: _ask(srv.url, prompts[i % len(prompts)], max_tokens), range(requests)))
            wall = time.perf_counter() - t0
        rss_after = rss_mib()
    answered = [(s, r) for s, r, _ in done if r is not None]
    refused = [after for _, r, after in done if r is None]
    latencies = sorted(s for s, _ in answered)
    tokens = sum(r["usage"]["completion_tokens"] for _, r in answered)
    accepted = sum(r["fsd"]["accepted_sd"] + r["fsd"]["accepted_fuzzy"] for _, r in answered)
    drafted = sum(r["fsd"]["drafted"] for _, r in answered)
    return {
        "clients": clients,
        "requests": requests,
        "max_tokens": max_tokens,
        "answered": len(answered),
        "refused_503": len(refused),
        "retry_after_values": sorted(set(map(str, refused))),
        "wall_seconds": wall,
        "requests_per_second": len(answered) / wall,
        "latency_s": {
            "median": statistics.median(latencies) if latencies else None,
            "p90": latencies[int(0.9 * (len(latencies) - 1))] if latencies else None,
            "max": latencies[-1] if latencies else None,
        },
        "completion_tokens_per_second": tokens / wall,
        "acceptance_rate": accepted / drafted if drafted else None,
        "rss_mib": {"before": rss_before, "after": rss_after},
    }


def format_result(r: dict[str, Any]) -> str:
    lat = r["latency_s"]
    mem = r["rss_mib"]
    acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
    refused = f"{r['refused_503']} refused (503)"
    if r["retry_after_values"]:
        refused += f" with Retry-After {', '.join(r['retry_after_values'])}"
    lines = [
        f"{r['clients']} clients, {r['requests']} requests of {r['max_tokens']} tokens: {r['answered']} answered, "
        + refused,
        f"requests/s {r['requests_per_second']:.3f}   generated tokens/s {r['completion_tokens_per_second']:.1f}   "
        f"acceptance {acc}",
    ]
    if lat["median"] is not None:
        lines.append(f"latency s: median {lat['median']:.3f}  p90 {lat['p90']:.3f}  max {lat['max']:.3f}")
    if mem["before"] is not None and mem["after"] is not None:
        lines.append(f"resident memory MiB: {mem['before']:.1f} before, {mem['after']:.1f} after")
    return "\n".join(lines)
