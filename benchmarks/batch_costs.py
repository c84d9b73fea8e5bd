"""What one decode of n rows costs when the rows come from 1, 2, 4 ... sequences of one context (llama/seq_batch.py):
the prices a batch of conversations pays per round. Every sequence first holds `--context` tokens of text; then
each (rows, sequences) is timed as one decode with logits on every row (as a verify is), the rows spread as evenly
as the sequences allow, fastest of `--passes`, sizes up then down (as drafting/calibration.py times them), the
caches cut back after each. Both KV layouts (unified, per-slot), and the same one-sequence decode on a context of
one sequence (what the engine pays today) for the cost of the machinery alone.

    python benchmarks/batch_costs.py --demo f16 [--role target|draft] [--rows 16] [--seqs 1,2,4] [--threads 2]
    python benchmarks/batch_costs.py --target PATH ...
    python benchmarks/batch_costs.py --demo f16 --idle 60    # one request alone: the machinery's own cost
"""

from __future__ import annotations

import argparse
import json
import statistics
from time import perf_counter

from fsd_local.llama.model import Model, ModelOptions
from fsd_local.llama.seq_batch import SeqBatch
from fsd_local.pairs.demo import demo_pair

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had, and "
    "wound the clockwork that turned the great lens. Ships passed far out on the grey water; some answered his "
    "light with their horns, and he wrote each one down in the log with the hour, the wind and the state of the sea."
)


def spread(n: int, s: int) -> list[int]:
    """n rows over s sequences, as evenly as they go (the first ones take the remainder)."""
    return [n // s + (i < n % s) for i in range(s)]


def time_batches(m: Model, sizes: list[tuple[int, int]], token: int, passes: int) -> dict[tuple[int, int], float]:
    """The fastest of `passes` decodes of each (rows, sequences), each sequence's run with logits on every row;
    every cache is as it was on return."""
    batch = SeqBatch(m)
    base = [len(t) for t in m.seqs]
    best = dict.fromkeys(sizes, float("inf"))

    def once(n: int, s: int) -> float:
        for seq, count in enumerate(spread(n, s)):
            batch.add(seq, [token] * count, "from:0")
        t = perf_counter()
        batch.decode()
        m.synchronize()
        took = perf_counter() - t
        for seq in range(s):
            m.truncate(base[seq], seq)
        return took

    once(*max(sizes))  # llama.cpp sizes its buffers for the largest batch
    for p in range(passes):
        for size in sizes if p % 2 == 0 else sizes[::-1]:
            best[size] = min(best[size], once(*size))
    return best


def idle(path: str, a) -> None:
    """One request alone: a one-row decode of sequence 0 on a context of one sequence and on contexts of
    max(--seqs) sequences whose others are empty, interleaved --idle times; the median of each."""
    n = max(int(s) for s in a.seqs.split(","))
    models = {
        "one-sequence context": load(path, 1, False, a),
        f"{n} sequences, unified": load(path, n, True, a, only=1),
        f"{n} sequences, per-slot": load(path, n, False, a, only=1),
    }
    token = models["one-sequence context"].tokenize("a")[-1]
    times: dict[str, list[float]] = {name: [] for name in models}
    try:
        for _ in range(a.idle):
            for name, m in models.items():
                t = perf_counter()
                m.decode([token])
                m.synchronize()
                times[name].append(perf_counter() - t)
                m.truncate(a.context)
    finally:
        for m in models.values():
            m.close()
    base = statistics.median(times["one-sequence context"])
    print(f"{path}: one row of one request, median of {a.idle} interleaved")
    for name, ts in times.items():
        print(f"{name:26s} {statistics.median(ts) * 1e3:7.2f} ms  ({statistics.median(ts) / base:.3f}x)")


def load(path: str, n_seq: int, unified: bool, a, only: int | None = None) -> Model:
    n_ctx = n_seq * (a.context + a.rows + 8) if not unified else n_seq * (a.context + a.rows) + 8
    opts = ModelOptions(path, n_ctx=n_ctx, n_threads=a.threads, n_seq=n_seq, kv_unified=unified, n_batch=512)
    m = Model(opts, a.role)
    text = (m.tokenize(TEXT) * (a.context // 40 + 1))[: a.context]
    batch = SeqBatch(m)
    for seq in range(only or n_seq):  # one sequence a decode: n_seq prompts may not fit one batch
        batch.add(seq, text, "none")
        batch.decode()
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", choices=("f16", "wide", "q4_1"), default="f16")
    ap.add_argument("--role", choices=("target", "draft"), default="target")
    ap.add_argument("--target", help="a GGUF instead of the demo pair's model")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seqs", default="1,2,4")
    ap.add_argument("--context", type=int, default=128, help="tokens each sequence holds before the timed decodes")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also write the seconds as JSON (benchmarks/batch_policy.py reads it)")
    ap.add_argument("--idle", type=int, default=0, help="instead: one request alone on each context, N times")
    a = ap.parse_args()
    path = a.target or str(demo_pair(precision=a.demo)[a.role == "target"])
    if a.idle:
        idle(path, a)
        return
    seqs = [int(s) for s in a.seqs.split(",")]
    sizes = [(n, s) for n in range(1, a.rows + 1) for s in seqs if s <= n]
    print(f"{path}, {a.threads} threads, {a.context} tokens of context a sequence, fastest of {a.passes}")
    single = load(path, 1, False, a)
    try:
        alone = time_batches(single, [(n, 1) for n in range(1, a.rows + 1)], single.tokenize("a")[-1], a.passes)
    finally:
        single.close()
    record = {
        "path": path,
        "threads": a.threads,
        "context": a.context,
        "one-seq": [[n, t] for (n, _), t in alone.items()],
    }
    for unified in (True, False):
        m = load(path, max(seqs), unified, a)
        try:
            got = time_batches(m, sizes, m.tokenize("a")[-1], a.passes)
        finally:
            m.close()
        layout = "unified" if unified else "per-slot"
        record[layout] = [[n, s, t] for (n, s), t in got.items()]
        print(f"\n{layout} KV, {max(seqs)} sequences; ms per decode (x one row of one sequence, one-sequence context)")
        print("rows | one-seq ctx | " + " | ".join(f"{s} seq" for s in seqs))
        one = alone[(1, 1)]
        for n in range(1, a.rows + 1):
            cells = [f"{got[(n, s)] * 1e3:7.1f} ({got[(n, s)] / one:4.2f}x)" if s <= n else " " * 15 for s in seqs]
            print(f"{n:4d} | {alone[(n, 1)] * 1e3:7.1f} ({alone[(n, 1)] / one:4.2f}x) | " + " | ".join(cells))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(record, fh)


if __name__ == "__main__":
    main()
