"""What the model process costs (a script, not a unit test): the same greedy request through the supervised
server (HTTP + the child's socket), through the server with the Engine in its own process (HTTP alone) and
through the Engine directly, interleaved, on the SmolLM2 demo pair; then the restart time after a SIGKILL.

    python benchmarks/serve_overhead.py [--repeats 8] [--max-tokens 128] [--threads 1] [--tau 0.2] [--restarts 3]

All sides run the same settings with ignore_eos (a fixed length) from a warm KV prefix (the prompt is the
same every time), one at a time: tokens/s is output tokens over the wall time of the whole request, as a
client sees it (a server's: from sending the request to the last event of the stream). Each repeat runs
every side, in a rotating order, so a busy neighbour slows all alike; ratios to the engine are taken within
each repeat and the median reported. `outside_ms` is the wall time of a request minus the time the engine
itself measured (prompt + generation): what the path around the engine costs per request, less sensitive to
a busy machine than the ratios. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

import httpx

from fsd_local import Engine, ModelOptions, Settings
from fsd_local.pairs.demo import demo_pair
from fsd_local.server import BackgroundServer

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def through_engine(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
    """(tokens, wall seconds, seconds the engine itself reports for prompt + generation)"""
    t = time.perf_counter()
    n = 0
    for piece in engine.stream(prompt, max_tokens=max_tokens):
        n += len(piece.token_ids)
        st = piece.completion.stats if piece.completion else None
    return n, time.perf_counter() - t, st["prompt_seconds"] + st["seconds_total"]


def through_server(url: str, prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "fsd" in chunk:  # the last chunk: usage and the engine's own statistics
                    n = chunk["usage"]["completion_tokens"]
                    inside = chunk["fsd"]["prompt_seconds"] + chunk["fsd"]["seconds_total"]
    return n, time.perf_counter() - t, inside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tau", type=float, default=0.2)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    args = ap.parse_args()

    d, t = (args.draft, args.target) if args.target else (str(p) for p in demo_pair())
    opts = [ModelOptions(p, n_ctx=1024, n_threads=args.threads) for p in (t, d)]
    settings = Settings(ignore_eos=True, tau=args.tau)
    t0 = time.perf_counter()
    srv = BackgroundServer.supervised(*opts, settings)
    first_start = time.perf_counter() - t0
    sup = srv.app.state.engine
    with Engine(target=opts[0], draft=opts[1], settings=settings) as engine, srv, BackgroundServer(engine) as inproc:
        prompt = engine.tokenize(PROMPT)
        assert sup.tokenize(PROMPT) == prompt
        sides = {
            "engine": lambda n: through_engine(engine, prompt, n),
            "server": lambda n: through_server(srv.url, prompt, n),
            "in_process_server": lambda n: through_server(inproc.url, prompt, n),
        }
        for run in sides.values():  # warm all: KV prefix, kernels, first-call costs
            run(args.max_tokens)
        names = list(sides)
        rates: dict[str, list[float]] = {name: [] for name in names}
        outside: dict[str, list[float]] = {name: [] for name in names}
        ratios: dict[str, list[float]] = {"server": [], "in_process_server": []}
        for rep in range(args.repeats):
            got = {}
            for side in names[rep % 3 :] + names[: rep % 3]:
                n, secs, inside = sides[side](args.max_tokens)
                assert n == args.max_tokens, (side, n)
                got[side] = n / secs
                rates[side].append(got[side])
                outside[side].append((secs - inside) * 1000)
            for side in ratios:
                ratios[side].append(got[side] / got["engine"])

        restart_seconds = []
        for _ in range(args.restarts):  # from the kill to /health ok, as a client polling it would see
            pid = sup.pid
            t_kill = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while sup.pid == pid or httpx.get(srv.url + "/health", timeout=60).status_code != 200:
                time.sleep(0.01)
            restart_seconds.append(time.perf_counter() - t_kill)
            through_server(srv.url, prompt, 8)  # its first request (proves it, resets the back-off)

    print(
        json.dumps(
            {
                "pair": [os.path.basename(t), os.path.basename(d)],
                "threads": args.threads,
                "tau": args.tau,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "tokens_per_second": {side: round(statistics.median(r), 2) for side, r in rates.items()},
                "over_engine_median": {side: round(statistics.median(r), 4) for side, r in ratios.items()},
                "over_engine": {side: [round(x, 4) for x in r] for side, r in ratios.items()},
                "outside_ms_median": {side: round(statistics.median(r), 2) for side, r in outside.items()},
                "first_start_seconds": round(first_start, 2),
                "restart_seconds": [round(s, 2) for s in restart_seconds],
                "child_load_seconds_last": round(sup.last_start_seconds, 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
