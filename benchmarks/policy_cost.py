"""What `auto`'s cost model (drafting/cost_model.py) costs a round: choose_k and the round's observations, timed
after it has settled on synthetic costs (a memory-bound target: 25 ms + 0.3 ms a token, acceptance 0.8).

    python benchmarks/policy_cost.py [--k-max 16] [--rounds 200]
"""

from __future__ import annotations

import argparse
import random
from time import perf_counter

from fsd_local.drafting.cost_model import CostModel

MS = 1e-3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    cm = CostModel(a.k_max, draft_cost_prior=0.0)
    rng = random.Random(0)
    for _ in range(20):  # settle: rounds as the engine reports them
        k = cm.choose_k()
        if k:
            cm.observe_draft(k, 0.0)
            n_acc = 0
            while n_acc < k and rng.random() < 0.8:
                n_acc += 1
            cm.observe_acceptance(k, n_acc)
        cm.observe_verify(k + 1, 25 * MS + 0.3 * MS * (k + 1))
    t = perf_counter()
    for _ in range(a.rounds):
        cm.choose_k()
        cm.observe_verify(5, 26 * MS)
        cm.observe_acceptance(4, 2)
    per = (perf_counter() - t) / a.rounds
    print(f"cost model: choose_k + observations {per * 1e6:.1f} us a round (k_max {a.k_max}, {a.rounds} rounds)")


if __name__ == "__main__":
    main()
