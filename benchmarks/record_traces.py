"""Record acceptance traces of a demo pair for the `auto` policy's tests (tests/data/traces-*.json).

    python benchmarks/record_traces.py wide [--tokens 96] [--threads 2]

For each chat prompt of fsd_local/data/prompts-chat.jsonl (the first --prompts), the target writes its greedy reply
(`ar`); both models then evaluate prompt + reply in one batch, and every position of the reply is scored as a
round would score it: whether the draft's greedy pick is the target's (sd), and the Jensen-Shannon divergence
of the two rows (fsd at tau accepts where sd does or js <= tau). The file holds, per prompt, the reply's
positions as [sd, js] pairs: a teacher-forced trace (tests/support/autosim.py replays it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from fsd_local.bench.prompts import load_prompts
from fsd_local.engine import Engine
from fsd_local.kernels.divergence import divergence
from fsd_local.kernels.names import DIVERGENCES
from fsd_local.kernels.rows import row_lse
from fsd_local.pairs.demo import demo_pair

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def rows(model, tokens: list[int], first: int) -> np.ndarray:
    """The model's rows for positions first+1 .. len(tokens) after evaluating `tokens` from an empty cache."""
    model.clear()
    model.decode(tokens, f"from:{first}")
    return np.array(model.logits(len(tokens) - first), copy=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("demo", nargs="?", default="wide", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="where to write the traces [default: tests/data/traces-DEMO.json]")
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    a = ap.parse_args()
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    prompts = load_prompts(str(Path(__file__).resolve().parent.parent / "fsd_local/data/prompts-chat.jsonl"))
    js = DIVERGENCES.index("js")
    out = []
    with Engine(target=str(target), draft=str(draft), n_threads=a.threads, n_ctx=1024) as eng:
        for p in prompts[: a.prompts]:
            ids = eng.chat_prompt([{"role": "user", "content": p.text}])
            eng.reset()
            reply = eng.generate(ids, mode="ar", max_tokens=a.tokens).token_ids
            text = ids + reply
            first = len(ids) - 1  # the row after the prompt's last token scores the reply's first position
            pt, pd = rows(eng.target, text, first), rows(eng.draft, text, first)
            n = eng.n_vocab
            trace = []
            for i in range(len(reply)):
                x, y = pt[i], pd[i]
                sd = int(np.argmax(y[:n]) == np.argmax(x[:n]))
                dv = divergence(js, x, row_lse(x, n), y, row_lse(y, n), n, 50)
                trace.append([sd, round(float(dv), 5)])
            out.append(trace)
            print(f"{p.text[:40]!r}: {len(trace)} positions, sd {np.mean([t[0] for t in trace]):.2f}", flush=True)
    path = Path(a.out) if a.out else DATA / f"traces-{a.demo}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"demo": a.demo, "tokens": a.tokens, "traces": out}, separators=(",", ":")))
    print(f"written {path}")


if __name__ == "__main__":
    main()
