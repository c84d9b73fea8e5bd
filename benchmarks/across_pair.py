"""A pair of any two tokenizers in the engine (drafting/across.py; one tokenizer works too): tokens per target call,
acceptance and time of `ar`, greedy `sd` and `fsd` js at a tau, fixed k, over chat prompts, each from empty caches.

    python benchmarks/across_pair.py --target gemma-3-270m-q4_k_m.gguf --draft SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--prompts 6] [--tokens 64] [--k 4] [--tau 0.3] [--budget 0.1] [--threads 2] [--f16] [--conversation]
        [--self-map]

--f16 runs F16 copies of both files (pairs/demo.py `f16_copy`, written once into the cache folder), where greedy
token ids compare exactly. --conversation asks the prompts in turn in one chat (each reply kept: 2 x prompts
messages), caches kept between turns. --self-map: the draft drafts for a copy of itself whose end of generation is
another token, so the pair takes the map with every piece shared.

Printed per configuration: the reply tokens, target calls, tokens per target call, acceptance, tokens per second,
the largest loss per token of a reply (kernels/budget.py's; a budget B holds when it is <= B),
the draft model's decode seconds and, for a pair of two tokenizers, the follower's own time per round (tokenising
tails, comparing: llama.cpp's decode excluded) and its share of the draft's time; then how many greedy replies
equal `ar`'s ids (on quantized weights batch shapes may change a near tie: compare ids on F16/F32 only). The
draft length is fixed (k), so the cost store is not read to choose it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from time import perf_counter

from fsd_local import Engine

DATA = Path(__file__).resolve().parent.parent / "fsd_local" / "data"


def prompts(n: int) -> list[str]:
    lines = (DATA / "prompts-chat.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:n]


def run(eng: Engine, texts: list[str], tokens: int, conversation: bool = False, **settings) -> dict:
    """One configuration over every prompt, each from empty caches (`conversation`: one chat, caches kept)."""
    total = {"tokens": 0, "target_calls": 0, "drafted": 0, "accepted": 0, "seconds": 0.0, "rounds": 0}
    draft_s = follow_s = 0.0
    ids, losses = [], []
    messages: list[dict] = []
    eng.reset()
    for text in texts:
        if not conversation:
            eng.reset()
            messages = []
        messages.append({"role": "user", "content": text})
        d0 = eng.draft.decode_seconds if eng.draft else 0.0
        f0 = eng.across.follower.seconds if eng.across else 0.0
        c0 = _catch_up(eng)
        t = perf_counter()
        out = eng.chat(messages, max_tokens=tokens, temperature=0, **settings)
        messages.append({"role": "assistant", "content": out.text})
        total["seconds"] += perf_counter() - t
        draft_s += (eng.draft.decode_seconds if eng.draft else 0.0) - d0
        follow_s += (eng.across.follower.seconds if eng.across else 0.0) - f0
        catch_up = [b - a for a, b in zip(c0, _catch_up(eng))]
        for key, v in zip(("redecoded", "sync_tokens", "sync_seconds"), catch_up):
            total[key] = total.get(key, 0) + v
        st = out.stats
        total["tokens"] += len(out.token_ids)
        total["target_calls"] += st["target_calls"]
        total["rounds"] += st["rounds"]
        total["drafted"] += st.get("drafted", 0)
        total["accepted"] += st.get("accepted_sd", 0) + st.get("accepted_fuzzy", 0)
        ids.append(out.token_ids)
        losses.append(st["loss_per_token"])
    total["ids"] = ids
    total["loss_max"] = max(losses)
    total["draft_seconds"] = draft_s
    total["follow_seconds"] = follow_s
    return total


def _catch_up(eng: Engine) -> tuple[int, int, float]:
    """The follower's counters: cached tokens decoded again, tokens its syncs decoded, their decode seconds."""
    f = eng.across.follower if eng.across else None
    return (f.redecoded, f.sync_tokens, f.sync_seconds) if f else (0, 0, 0.0)


def pair_files(a) -> tuple[str, str]:
    """(draft, target) as asked: the files, their F16 copies, or the draft and its copy with another EOS."""
    from fsd_local.pairs.demo import f16_copy, upscale
    from fsd_local.paths import cache_dir

    draft, target = a.draft, a.target
    if a.f16:
        draft, target = (str(f16_copy(p, cache_dir() / "f16" / (Path(p).stem + ".F16.gguf"))) for p in (draft, target))
    if a.self_map:
        from gguf import GGUFReader

        r = GGUFReader(draft)
        arch = r.fields["general.architecture"].contents()
        n_layer, eos = (
            int(r.fields[f"{arch}.block_count"].contents()),
            int(r.fields["tokenizer.ggml.eos_token_id"].contents()),
        )
        del r
        twin = cache_dir() / "f16" / (Path(draft).stem + f".eos{eos + 1}.gguf")
        if not twin.exists():  # every piece the draft's: the map carries each token to itself
            upscale(draft, twin, list(range(n_layer)), overrides={"tokenizer.ggml.eos_token_id": eos + 1})
        target = str(twin)
    return draft, target


def catch_up_line(name: str, r: dict) -> str:
    """The catch-up against the draft's time: the follower's own time, and the cached tokens it decoded again
    priced at most at what a drafted token's decode cost (they ride in the sync's batch with the new text)."""
    draft_s, drafting = r["draft_seconds"], r["draft_seconds"] - r["sync_seconds"]
    per_token = drafting / max(r["drafted"], 1)
    extra = r["redecoded"] * per_token
    decoded = r["sync_tokens"] + r["drafted"]
    return (
        f"catch-up {name}: own {r['follow_seconds'] * 1e3:.0f} ms = {r['follow_seconds'] / draft_s:.1%} of the "
        f"draft's decode time; syncs decoded {r['sync_tokens']} tokens in {r['sync_seconds']:.2f} s, "
        f"{r['redecoded']} of them cached tokens decoded again ({r['redecoded'] / decoded:.1%}"
        f" of {decoded} decoded), at most {extra * 1e3:.0f} ms at {per_token * 1e3:.1f} ms a "
        f"drafted token = {extra / draft_s:.1%}; own + that: {(r['follow_seconds'] + extra) / draft_s:.1%}"
    )


def pair_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every cross-family pair benchmark takes: the pair, the prompts, the reply, tau, threads."""
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tau", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair_arguments(ap)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.1, help="a quality budget B run beside tau (0: none)")
    ap.add_argument("--f16", action="store_true", help="F16 copies of both files")
    ap.add_argument("--conversation", action="store_true", help="the prompts as turns of one chat")
    ap.add_argument("--self-map", action="store_true", help="the draft for its own copy with another EOS")
    a = ap.parse_args()
    texts = prompts(a.prompts)
    draft, target = pair_files(a)
    configs = {"ar": {"mode": "ar"}, "sd": {"mode": "sd"}, f"fsd js {a.tau}": {"mode": "fsd", "tau": a.tau}}
    if a.budget:
        configs[f"fsd js B {a.budget:g}"] = {"mode": "fsd", "quality_budget": a.budget}
    with Engine(
        target=target, draft=draft, n_ctx=a.ctx, n_threads=a.threads, draft_policy="fixed", draft_max=a.k
    ) as eng:
        path = "map (two tokenizers)" if eng.across is not None else "same tokenizer"
        how = "one chat" if a.conversation else "each from empty caches"
        print(f"pair: {draft} -> {target}: {path}; {len(texts)} prompts x {a.tokens} tokens ({how}), greedy, k {a.k}")
        eng.generate("warm up", max_tokens=4, mode="sd")
        results = {name: run(eng, texts, a.tokens, a.conversation, divergence="js", **s) for name, s in configs.items()}
    head = (
        f"{'config':<14}{'tokens':>7}{'calls':>7}{'tok/call':>9}{'accept':>8}{'tok/s':>8}{'loss max':>9}{'draft s':>9}"
    )
    print(head + f"{'follow us/round':>17}{'follow/draft':>14}")
    for name, r in results.items():
        per_call = r["tokens"] / max(r["target_calls"], 1)
        accept = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
        follow = 1e6 * r["follow_seconds"] / max(r["rounds"], 1)
        share = r["follow_seconds"] / r["draft_seconds"] if r["draft_seconds"] else 0.0
        print(
            f"{name:<14}{r['tokens']:>7}{r['target_calls']:>7}{per_call:>9.2f}{accept:>8.2f}"
            f"{r['tokens'] / r['seconds']:>8.1f}{r['loss_max']:>9.3f}{r['draft_seconds']:>9.2f}{follow:>17.0f}"
            f"{share:>14.1%}"
        )
    for name, r in results.items():
        if r["draft_seconds"] and r.get("sync_tokens"):
            print(catch_up_line(name, r))
    sd, fsd = (results[n] for n in ("sd", f"fsd js {a.tau}"))
    ratio = (fsd["tokens"] / fsd["target_calls"]) / (sd["tokens"] / sd["target_calls"])
    print(f"fsd js {a.tau} / sd tokens per target call: {ratio:.2f}x")
    same = sum(x == y for x, y in zip(results["ar"]["ids"], sd["ids"]))
    print(f"greedy sd replies equal to ar's ids: {same} of {len(texts)}")


if __name__ == "__main__":
    main()
