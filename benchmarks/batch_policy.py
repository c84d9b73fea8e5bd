"""What the batch draft-length policy (drafting/batch_length.py) chooses at 1..8 sequences, on measured costs: the
draft lengths, the expected tokens per second against plain decoding of the same batch, and a simulated session
(tests/support/batchsim.py: each sequence's acceptance learned online, 96 tokens each, generated traces) against
plain decoding and the best fixed k for the whole batch. Costs: the JSON benchmarks/batch_costs.py writes for the
target (rows over sequences) and for the draft (one row a sequence), or `--gpu` for a memory-bound pair whose
batch of 4 costs little more than 1 (no measurement: the shape the issue describes).

    python benchmarks/batch_policy.py --target-costs f16-target.json --draft-costs f16-draft.json [--layout unified]
    python benchmarks/batch_policy.py --gpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsd_local.drafting.batch_length import plan_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.autosim import trace  # noqa: E402
from support.batchsim import BatchCosts, extend, run_batch  # noqa: E402

K_MAX = 8
ACCEPTANCE = (0.5, 0.7, 0.8, 0.9)


def curves(target: dict, draft: dict, layout: str) -> dict[int, BatchCosts]:
    """Per number of sequences S: the target's seconds for n rows spread over the largest measured number of
    sequences <= S (and <= n), and the draft's for m rows over m sequences (the largest measured spread <= m)."""
    t = {(n, s): sec for n, s, sec in target[layout]}
    d = {(n, s): sec for n, s, sec in draft[layout]}
    spreads_t, spreads_d = sorted({s for _, s in t}), sorted({s for _, s in d})
    rows_t, rows_d = max(n for n, _ in t), max(n for n, _ in d)
    out = {}
    for count in range(1, 9):
        verify = [0.0] + [t[(n, max(s for s in spreads_t if s <= min(count, n)))] for n in range(1, rows_t + 1)]
        drafts = [0.0] + [d[(m, max(s for s in spreads_d if s <= m))] for m in range(1, rows_d + 1)]
        out[count] = BatchCosts(extend(verify, count * (K_MAX + 1) + 1), extend(drafts, count + 1))
    return out


def gpu() -> dict[int, BatchCosts]:
    verify = [0.0] + [0.020 * (1 + 0.01 * (n - 1)) for n in range(1, 80)]
    drafts = [0.0] + [0.002 * (1 + 0.01 * (m - 1)) for m in range(1, 10)]
    return dict.fromkeys(range(1, 9), BatchCosts(verify, drafts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-costs", help="batch_costs.py --out of the target")
    ap.add_argument("--draft-costs", help="batch_costs.py --role draft --out of the draft")
    ap.add_argument("--layout", choices=("unified", "per-slot"), default="unified")
    ap.add_argument("--gpu", action="store_true", help="a memory-bound pair instead of measured costs")
    ap.add_argument("--tokens", type=int, default=96, help="tokens a simulated sequence writes")
    ap.add_argument("--seeds", type=int, default=3, help="simulated batches per cell")
    a = ap.parse_args()
    if a.gpu:
        by_count, where = gpu(), "a memory-bound GPU-like pair (batch of 4: 1.03x one row)"
    else:
        with open(a.target_costs) as ft, open(a.draft_costs) as fd:
            target, draft = json.load(ft), json.load(fd)
        by_count, where = curves(target, draft, a.layout), f"{target['path']} ({a.layout} KV), {draft['path']}"
    print(f"costs: {where}; k <= {K_MAX}")
    print("expected: each sequence's k at acceptance a at every position; tokens/s and x plain decoding")
    print("simulated: x plain decoding of the same batch; best fixed k for the batch and its x plain\n")
    for acc in ACCEPTANCE:
        print(f"a = {acc}")
        print("seqs | ks       | exp tok/s | exp x plain | sim x plain | best fixed k (x plain)")
        for count in range(1, 9):
            c = by_count[count]
            plan = plan_batch([[acc] * K_MAX] * count, [K_MAX] * count, c.verify, c.draft)
            ks = str(plan.ks[0]) if len(set(plan.ks)) == 1 else ",".join(map(str, plan.ks))
            sim = {k: 0.0 for k in [None, *range(K_MAX + 1)]}
            for seed in range(a.seeds):
                traces = [trace(acc, a.tokens + K_MAX + 1, 100 * seed + i) for i in range(count)]
                for k in sim:
                    tokens, seconds = run_batch(traces, c, a.tokens, k=k, k_max=K_MAX)
                    sim[k] += tokens / seconds / a.seeds
            best = max(range(K_MAX + 1), key=lambda k: sim[k])
            print(
                f"{count:4d} | {ks:8s} | {plan.rate:9.1f} | {plan.rate / plan.plain_rate:11.2f} | "
                f"{sim[None] / sim[0]:11.2f} | {best} ({sim[best] / sim[0]:.2f})"
            )
        print()


if __name__ == "__main__":
    main()
