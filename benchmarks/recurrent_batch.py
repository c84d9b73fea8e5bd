"""What a verify decode of several sequences costs a hybrid target, rewound by a spare sequence's checkpoint each
(one sequence alone: by snapshots, as the engine loads it), beside a transformer of the same shape: llama.cpp
splits a batch of recurrent sequences into ubatches of equal length per sequence, so counts that differ between
sequences cost more ubatches.

Each sequence first holds 50 tokens; then each round checkpoints every sequence, decodes its `counts` tokens with
logits on every row (a verify batch) and rolls it back to the first (snapshots) or to the checkpoint (spares).
Median of `--rounds` after 5 warm-up rounds, and the spread (max - min). The models are the suite's tiny writers,
widened (512 wide, 6 blocks: LFM2 "ccacca" and a llama), F32.

    python benchmarks/recurrent_batch.py [--rounds 40] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter

from fsd_local.llama.model import Model, ModelOptions
from fsd_local.llama.seq_batch import SeqBatch

COUNTS = ([5], [5, 5, 5, 5], [5, 3, 1, 5], [1, 1, 1, 1])  # tokens a sequence: one verify batch each
BASE = 50
WARM = 5


def models(directory: Path) -> dict[str, tuple[Path, int]]:
    """name -> (GGUF, n_rs_seq): the widened hybrid with snapshots, the same with spares, the transformer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.tinymodels import write_tiny_gguf, write_tiny_lfm2_gguf

    wide = {"n_embd": 512, "n_ff": 1536, "n_head": 8}
    hybrid = write_tiny_lfm2_gguf(directory / "lfm2-wide.gguf", layers="ccacca", **wide)
    transformer = write_tiny_gguf(directory / "llama-wide.gguf", n_layer=6, **wide)
    # as the engine loads a target: snapshots for one sequence, spares for several (llama/model.py)
    return {"hybrid, as loaded": (hybrid, 5), "hybrid, spares": (hybrid, 0), "transformer": (transformer, 0)}


def verify_seconds(path: Path, n_rs_seq: int, counts: list[int], rounds: int, threads: int) -> tuple[float, float]:
    """(median, spread) seconds of one decode of every sequence's `counts` tokens."""
    n = len(counts)
    opts = ModelOptions(str(path), 2048, threads, n_gpu_layers=0, n_seq=n, n_rs_seq=n_rs_seq, checkpoint=True)
    m = Model(opts, "target")
    try:
        b = SeqBatch(m)
        for s in range(n):
            b.add(s, list(range(10, 10 + BASE)), "none")
        b.decode()
        times = []
        for _ in range(WARM + rounds):
            for s, c in enumerate(counts):
                m.checkpoint(s)
                b.add(s, list(range(70, 70 + c)), "from:0")
            t = perf_counter()
            b.decode()
            m.synchronize()
            times.append(perf_counter() - t)
            for s, c in enumerate(counts):  # the first token accepted: snapshots keep it, a spare goes back before it
                m.truncate(len(m.seqs[s]) - c + 1, s)
        kept = times[WARM:]
        return statistics.median(kept), max(kept) - min(kept)
    finally:
        m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        found = models(Path(d))
        for counts in COUNTS:
            row: dict = {"counts": counts}
            for name, (path, n_rs_seq) in found.items():
                med, spread = verify_seconds(path, n_rs_seq, list(counts), args.rounds, args.threads)
                row[name] = {"ms": round(med * 1e3, 3), "spread_ms": round(spread * 1e3, 3)}
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    names = list(rows[0])[1:]
    print(f"{'tokens a sequence':<18}" + "".join(f"{n:>22}" for n in names))
    for row in rows:
        cells = "".join(f"{row[n]['ms']:>12.2f} ms ±{row[n]['spread_ms']:<5.1f}" for n in names)
        print(f"{str(row['counts']):<18}{cells}")


if __name__ == "__main__":
    main()
