"""What a CPU decode does to the loop's own time: the same work timed right after a decode (the caches hold the
model's weights, streamed through them) and again at once (warm), and the loop's own time per round on the
target against a light model with the same vocabulary, whose decode leaves the caches mostly as they were (as a
GPU's decode leaves the CPU's). Issue 27's per-round goals, read on this host.

    python benchmarks/cache_refill.py --target gemma-3-270m-q4_k_m.gguf [--light-vocab 262144] [--repeats 200]

Part 1 loads the target alone and, after each one-token decode (and each five-token verification), times the
draft's greedy pick of the row (kernels/sampling.py `pick_kept`), the acceptance kernel on the five rows
(`accept_round`, greedy sd) and a few lines of the round's Python bookkeeping, first cold and then warm.
Part 2 writes a light llama GGUF over the target's vocabulary size (16-wide, one layer, F16; needs the `gguf`
package of the test extra) and runs `bench --overhead`'s measurement (bench/overhead.py) on the target and on the
light model, each as its own draft, side by side: greedy sd, fsd js tau 0.3, chat's sampling.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import numpy as np

from fsd_local.kernels.accept import accept_round, round_out, rule_of, sampling_of
from fsd_local.kernels.budget import new_budget
from fsd_local.kernels.dense import new_summaries
from fsd_local.kernels.sampling import KEPT_MAX, pick_kept, pick_kept_copy
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.round import new_buffers
from fsd_local.settings import Settings

TEXT = "The history of the city begins in the early middle ages, when a small market grew up beside the river"
CHAT = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}


def _bookkeeping(seq: list[int], tok: int) -> int:
    """A few lines like the round's own Python after a decode: a list, a slice, a sum, a dict."""
    seq.append(tok)
    tail = seq[-8:]
    return sum(tail) + len({"tokens": tail, "origins": ["sd"] * len(tail)})


def _sampled_round(m: Model, tok: int, nv: int) -> tuple:
    """accept_round's arguments after the rows, for sd at temperature 0.7 alone with the model as its own draft:
    the drafts are the picks from the very rows the timed decodes give again (every one accepted, the bonus drawn:
    the self-pair's usual round)."""
    base = len(m.tokens)
    m.decode([tok] * 5, "from:0")  # what the timed piece's decode gives again
    rows = np.array(m.logits(5), copy=True)
    m.truncate(base)
    drafts, us = new_buffers(4, nv).drafts, np.full(5, 0.5)
    for i in range(4):
        drafts.rows[i] = rows[i]
        drafts.tokens[i], drafts.prob[i], _, drafts.kept_n[i] = pick_kept(
            rows[i], nv, 0.7, 0, 1.0, 0.0, 0.5, drafts.stats[i], drafts.kept[i], False, drafts.summary
        )
    s = Settings(mode="sd", draft_max=4, temperature=0.7)
    return drafts, 4, nv, rule_of(s), sampling_of(s), us, round_out(4, 0, False), new_budget(None, 4)


def cold_and_warm(path: str, threads: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Microseconds of each piece right after a decode and again at once: {piece: (cold, warm)}."""
    m = Model(ModelOptions(path, n_ctx=4096, n_threads=threads, n_threads_batch=threads))
    try:
        nv, seq = m.n_vocab, m.tokenize(TEXT)
        m.decode(seq, "last")
        s = Settings(mode="sd", draft_max=4)
        rule, samp, out, budget = rule_of(s), sampling_of(s), round_out(4, 0, False), new_budget(None, 4)
        drafts, us = new_buffers(4, nv).drafts, np.zeros(5)
        stats, kept, summary = np.zeros(3, np.float32), np.empty(KEPT_MAX, np.int64), new_summaries(1)[0]
        base, tok = len(m.tokens), int(np.argmax(m.logits(1)[0]))
        sampled = _sampled_round(m, tok, nv)
        pieces = {  # name: (rows the decode before it outputs, the work)
            "pick (1 row)": (
                1,
                lambda rows: pick_kept(rows[0], nv, 0.0, 0, 1.0, 0.0, 0.5, stats, kept, False, summary),
            ),
            "accept_round (5 rows)": (5, lambda rows: accept_round(rows, drafts, 4, nv, rule, samp, us, out, budget)),
            "T 0.7 pick, copied (1 row)": (
                1,
                lambda rows: pick_kept_copy(rows[0], nv, 0.7, 0, 1.0, 0.0, 0.5, stats, kept, False, copy, summary),
            ),
            "T 0.7 accept_round (5 rows)": (5, lambda rows: accept_round(rows, *sampled)),
            "bookkeeping": (1, lambda rows: _bookkeeping(list(seq), 7)),
        }
        copy = np.empty(nv, np.float32)
        for k, f in pieces.values():  # compiled before anything is timed
            f(np.zeros((k, nv), np.float32))
        times = {name: [0.0, 0.0] for name in pieces}
        for _ in range(repeats):
            for name, (k, f) in pieces.items():
                m.decode([tok] * k, "from:0")
                rows = m.logits(k)
                for j in range(2):  # cold, then warm
                    t = perf_counter()
                    f(rows)
                    times[name][j] += perf_counter() - t
                m.truncate(base)
        return {name: (c * 1e6 / repeats, w * 1e6 / repeats) for name, (c, w) in times.items()}
    finally:
        m.close()


def light_model(n_vocab: int, directory: Path) -> Path:
    """A 16-wide one-layer llama GGUF over n_vocab tokens (F16): a decode touches ~17 MB of weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.tinymodels import WORDS, write_tiny_gguf

    words = WORDS + [f"▁w{i}" for i in range(n_vocab - 259 - len(WORDS))]
    light = {"n_embd": 16, "n_layer": 1, "n_head": 2, "n_ff": 32, "dtype": np.float16}
    return write_tiny_gguf(directory / "light.gguf", seed=1, words=words, **light)


def own_time(path: str, threads: int, tokens: int, prompts: int) -> list[dict]:
    """bench --overhead's rows for the model as its own draft, k = 4: greedy sd, fsd js 0.3, chat's sampling."""
    from fsd_local.bench.overhead import measure
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.bench.runner import prompt_tokens
    from fsd_local.engine import Engine

    base = {"draft_policy": "fixed", "draft_max": 4, "logprobs": False}
    configs = [
        ("sd T 0", {**base, "mode": "sd"}),
        ("fsd js 0.3 T 0", {**base, "mode": "fsd", "tau": 0.3, "divergence": "js"}),
        ("sd chat sampling", {**base, "mode": "sd", "seed": 1, **CHAT}),
        ("sd T 0.7 alone", {**base, "mode": "sd", "seed": 1, "temperature": 0.7}),
        (
            "fsd js 0.3 T 0.7 alone",
            {**base, "mode": "fsd", "tau": 0.3, "divergence": "js", "seed": 1, "temperature": 0.7},
        ),
    ]
    with Engine(target=path, draft=path, n_threads=threads, draft_policy="fixed") as eng:
        return measure(eng, prompt_tokens(eng, load_prompts()[:prompts], False), configs, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a GGUF (Gemma 3 270M: vocabulary 262,144)")
    ap.add_argument("--draft", help="ignored: the target and the light model are each their own draft")
    ap.add_argument("--light-vocab", type=int, default=0, help="the light model's vocabulary (default: the target's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    a = ap.parse_args()
    print("part 1: us right after a decode (cold) and again at once (warm)")
    for name, (cold, warm) in cold_and_warm(a.target, a.threads, a.repeats).items():
        print(f"{name:>24}  cold {cold:8.1f}  warm {warm:8.1f}  cold/warm {cold / warm:5.1f}", flush=True)
    if not a.light_vocab:
        m = Model(ModelOptions(a.target, vocab_only=True))
        a.light_vocab = m.n_vocab
        m.close()
    vocab = a.light_vocab
    with tempfile.TemporaryDirectory() as d:
        light = str(light_model(vocab, Path(d)))
        print(f"part 2: the loop's own us per round, k = 4, {a.tokens} tokens x {a.prompts} prompts")
        rows = {"target": own_time(a.target, a.threads, a.tokens, a.prompts)}
        rows[f"light ({vocab} tokens)"] = own_time(light, a.threads, a.tokens, a.prompts)
    for who, rs in rows.items():
        for r in rs:
            own, per_draft, decode = r["own_us_per_round"], r["draft_us_per_draft_token"] or 0, r["decode_ms_per_round"]
            phases = f"draft {r['draft_us_per_round']:5.0f}  verify {r['verify_us_per_round']:5.0f}"
            line = f"own us/round {own:7.0f}  {phases}  us/draft tok {per_draft:6.1f}  decode ms/round {decode:6.1f}"
            print(f"{who:>24}  {r['config']:>22}  {line}")


if __name__ == "__main__":
    main()
