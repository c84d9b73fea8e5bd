"""The two paths across tokenizers side by side (drafting/across.py the map, drafting/text_draft.py the text path):
tokens per target call, acceptance and time of greedy `sd` and `fsd` js at a tau on each, beside `ar`, fixed k,
over chat prompts, each from empty caches (across_pair.py's `run`).

    python benchmarks/text_path.py --target gemma-3-270m-q4_k_m.gguf --draft SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--prompts 6] [--tokens 64] [--k 4] [--tau 0.3] [--threads 2]

Printed per path and configuration: the reply tokens, target calls, tokens per target call, acceptance (of the
proposed target tokens), tokens per second and the draft model's decode seconds; then each path's greedy `sd`
replies equal to `ar`'s ids. A pair of one tokenizer runs as such on both rows. The draft length is fixed (k), so
the cost store is not read to choose it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from across_pair import pair_arguments, prompts, run  # noqa: E402

from fsd_local import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair_arguments(ap)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048)
    a = ap.parse_args()
    texts = prompts(a.prompts)
    print(f"pair: {a.draft} -> {a.target}; {len(texts)} prompts x {a.tokens} tokens, greedy, k {a.k}")
    head = f"{'path':<6}{'config':<14}{'tokens':>7}{'calls':>7}{'tok/call':>9}{'accept':>8}{'tok/s':>8}{'draft s':>9}"
    rows, ar_ids = [], None
    for want in ("map", "text"):
        kw = dict(n_ctx=a.ctx, n_threads=a.threads, draft_policy="fixed", draft_max=a.k, across=want)
        with Engine(target=a.target, draft=a.draft, **kw) as eng:
            path = eng.pairing.path if eng.pairing is not None else "same"
            eng.generate("warm up", max_tokens=4, mode="sd")
            configs = {"sd": {"mode": "sd"}, f"fsd js {a.tau}": {"mode": "fsd", "tau": a.tau}}
            if ar_ids is None:
                configs = {"ar": {"mode": "ar"}, **configs}
            for name, s in configs.items():
                r = run(eng, texts, a.tokens, divergence="js", **s)
                ar_ids = r["ids"] if name == "ar" else ar_ids
                rows.append((path, name, r))
    print(head)
    for path, name, r in rows:
        per_call = r["tokens"] / max(r["target_calls"], 1)
        accept = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
        print(
            f"{path:<6}{name:<14}{r['tokens']:>7}{r['target_calls']:>7}{per_call:>9.2f}{accept:>8.2f}"
            f"{r['tokens'] / r['seconds']:>8.1f}{r['draft_seconds']:>9.2f}"
        )
    for path, name, r in rows:
        if name == "sd":
            same = sum(x == y for x, y in zip(ar_ids or [], r["ids"]))
            print(f"{path}: greedy sd replies equal to ar's ids: {same} of {len(texts)}")


if __name__ == "__main__":
    main()
