"""Time to the first token of a freshly loaded engine's first request against a later request of the same length
(issue 27's first-request rule), default settings (`auto`), chat.

    python benchmarks/first_token.py --demo wide [--repeats 3] [--empty-store]

Each repeat loads a new Engine, sends one chat message and times from the call to its first streamed piece; then,
on the same engine with its cache emptied, the same message again (the same length: a later request). With
--empty-store the engine starts without any measured costs (a machine that never ran the pair: FSD_LOCAL_COSTS
points at an empty file) instead of the store earlier runs left.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from time import perf_counter

from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

MESSAGE = [{"role": "user", "content": "Explain how a bicycle works to a ten-year-old."}]


def first_piece_seconds(eng: Engine) -> float:
    eng.reset()
    t = perf_counter()
    stream = eng.chat_stream(MESSAGE, max_tokens=16)
    next(p for p in stream if p.token_ids)
    seconds = perf_counter() - t
    stream.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="wide", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--empty-store", action="store_true")
    a = ap.parse_args()
    draft, target = demo_pair(precision=a.demo)
    for r in range(a.repeats):
        if a.empty_store:
            os.environ["FSD_LOCAL_COSTS"] = os.path.join(tempfile.mkdtemp(), "costs.json")
        with Engine(target=str(target), draft=str(draft), n_threads=a.threads) as eng:
            first = first_piece_seconds(eng)
            later = min(first_piece_seconds(eng) for _ in range(2))
        print(f"repeat {r}: first request {first:.3f} s, later {later:.3f} s, ratio {first / later:.2f}", flush=True)


if __name__ == "__main__":
    main()
