"""Jump-forward (issue 41's goals): what the tokens a JSON schema forces save when they are proposed free and
verified by the target, against the same replies without them.

    python benchmarks/jump_forward.py --demo f16|wide [--configs ar,sd-k4,sd-auto,fsd-k4,fsd-auto]
        [--sampling greedy,chat] [--tokens 160] [--prompts 6] [--repeats 1] [--empty-store]

Six chat prompts ask for a person's profile as JSON against PROFILE (5 fields: a string, an integer, an array of
enum values, a nested object and a boolean). Every configuration (a mode, fixed k 4 or the default policy) gets
two freshly loaded engines, jump_forward on and off, which reply to the same prompts interleaved (for each
prompt the side that goes first alternates), so a configuration's two sides see the same machine. `chat`
sampling is chat's defaults (settings.CHAT_DEFAULTS) with a seed per prompt. With --empty-store every engine
starts without measured costs (FSD_LOCAL_COSTS points at a new, empty file per engine); without it, at what the
store on disk holds (say which in every figure). Per configuration and side it prints tokens per target call,
tokens/s (the engine's generation time, after the prompt), the share of tokens forced (on: proposed forced and
kept; off: those the grammar forced along the reply, read back from its tokens, whose share s makes `ar`'s
ceiling 1 / (1 - s) tokens per call), and for greedy lossless modes whether the token ids are the same on both
sides (meaningful on F16 targets only: llama.cpp's quantised kernels depend on the batch shape).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from importlib.resources import files

from fsd_local.chain import Chain
from fsd_local.engine import Engine
from fsd_local.llama.model import Model
from fsd_local.pairs.demo import demo_pair
from fsd_local.settings import CHAT_DEFAULTS, Settings

PROFILE = json.loads(files("fsd_local").joinpath("data/profile-schema.json").read_text())
PEOPLE = [
    "a retired teacher from Lyon",
    "a young programmer in Tokyo",
    "a farmer in Kenya",
    "a chef in Rome",
    "a nurse in Toronto",
    "a fisherman in Norway",
]
CONFIGS = {
    "ar": {"mode": "ar"},
    "sd-k4": {"mode": "sd", "draft_policy": "fixed", "draft_max": 4},
    "sd-auto": {"mode": "sd"},
    "fsd-k4": {"mode": "fsd", "divergence": "js", "tau": 0.2, "draft_policy": "fixed", "draft_max": 4},
    "fsd-auto": {"mode": "fsd", "divergence": "js", "tau": 0.2},
}
LOSSLESS = ("ar", "sd-k4", "sd-auto")
# the per-phase breakdown: seconds inside the chain's hooks (llguidance's masks, forced tokens, the matcher's
# moves), and tokens each model decoded, by model; counted by wrapping those methods in this script only
CHAIN_HOOKS = ("draft_row", "target_rows", "push", "settle", "admit", "force")
meter = {"chain": 0.0, "decoded": {}}


def _instrument() -> None:
    for name in CHAIN_HOOKS:
        inner = getattr(Chain, name)

        def timed(self, *args, _inner=inner):
            t = time.perf_counter()
            try:
                return _inner(self, *args)
            finally:
                meter["chain"] += time.perf_counter() - t

        setattr(Chain, name, timed)
    decode, decode_one = Model.decode, Model.decode_one

    def counted(self, tokens, logits="last"):  # a prompt's batches output no row: they are not the reply's
        if logits != "none":
            meter["decoded"][self.role] = meter["decoded"].get(self.role, 0) + len(tokens)
        return decode(self, tokens, logits)

    def counted_one(self, token):
        meter["decoded"][self.role] = meter["decoded"].get(self.role, 0) + 1
        return decode_one(self, token)

    Model.decode, Model.decode_one = counted, counted_one


def profile_message(who: str) -> list[dict[str, str]]:
    content = (
        f"Describe {who} as a JSON profile with the fields name, age, languages (the languages they speak), "
        "address (city and country) and employed (true or false)."
    )
    return [{"role": "user", "content": content}]


def engine(target, draft, threads: int, empty_store: bool) -> Engine:
    if empty_store:
        os.environ["FSD_LOCAL_COSTS"] = os.path.join(tempfile.mkdtemp(), "costs.json")
    return Engine(target=str(target), draft=str(draft), n_threads=threads, n_ctx=2048)


def run_config(a, target, draft, settings: dict, sampling: str) -> dict[bool, list[dict]]:
    """Both sides of one configuration, interleaved prompt by prompt: each side's replies."""
    sides = {on: engine(target, draft, a.threads, a.empty_store) for on in (True, False)}
    replies: dict[bool, list[dict]] = {True: [], False: []}
    try:
        for r in range(a.repeats):
            for i, who in enumerate(PEOPLE[: a.prompts]):
                extra = dict(CHAT_DEFAULTS, seed=1000 * r + i) if sampling == "chat" else {}
                for on in (True, False) if (r + i) % 2 == 0 else (False, True):
                    meter["chain"], meter["decoded"] = 0.0, {}
                    out = sides[on].chat(
                        profile_message(who),
                        json_schema=PROFILE,
                        jump_forward=on,
                        max_tokens=a.tokens,
                        **settings,
                        **extra,
                    )
                    forcible = forced_along(sides[on], out.token_ids)
                    replies[on].append(
                        {
                            "ids": out.token_ids,
                            "finish": out.finish_reason,
                            "forcible": forcible,
                            "chain_seconds": meter["chain"],
                            "decoded": dict(meter["decoded"]),
                            **out.stats,
                        }
                    )
    finally:
        for e in sides.values():
            e.close()
    return replies


def forced_along(eng: Engine, ids: list[int]) -> int:
    """How many of a reply's tokens the grammar forced where they stand (read back: the reply walked through a
    new chain)."""
    chain = Chain(Settings(json_schema=PROFILE), eng.n_vocab, eng.target)
    n = 0
    for t in ids:
        if chain.finished:
            break
        n += chain.constraint.forced(1) == [t]
        chain.settle(0, t)
    return n


def summary(replies: list[dict]) -> dict:
    tokens = sum(len(r["ids"]) for r in replies)  # the reply's: an end of generation a round decoded is not one
    seconds = sum(r["seconds_total"] for r in replies)
    calls = sum(r["target_calls"] for r in replies)
    forced = sum(r.get("forced_accepted", 0) for r in replies)
    forcible = sum(r["forcible"] for r in replies)
    phase = {k: sum(r["seconds"][k] for r in replies) for k in ("target", "draft", "other")}
    chain = sum(r["chain_seconds"] for r in replies)
    decoded = {m: sum(r["decoded"].get(m, 0) for r in replies) for m in ("target", "draft")}
    return {
        "ms_per_token": {
            "target": 1000 * phase["target"] / tokens,
            "draft": 1000 * phase["draft"] / tokens,
            "chain": 1000 * chain / tokens,
            "rest": 1000 * (phase["other"] - chain) / tokens,
        },
        "decoded_per_token": {m: decoded[m] / tokens for m in decoded},
        "chain_share": chain / seconds if seconds else 0.0,
        "tokens": tokens,
        "target_calls": calls,
        "tokens_per_call": tokens / calls if calls else 0.0,
        "tok_s": tokens / seconds if seconds else 0.0,
        "forced_share": forced / tokens if tokens else 0.0,
        "forcible_share": forcible / tokens if tokens else 0.0,
        "stopped": sum(r["finish"] == "stop" for r in replies),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="f16", choices=("wide", "f16", "q4_1"))
    ap.add_argument("--target", help="a target GGUF instead of a demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sampling", default="greedy,chat")
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens: room for the whole profile")
    ap.add_argument("--prompts", type=int, default=len(PEOPLE))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--empty-store", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    _instrument()
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    store = "EMPTY" if a.empty_store else "as on disk"
    print(f"target {target}; cost store {store}; {a.prompts} prompts x {a.repeats}, max_tokens {a.tokens}", flush=True)
    head = f"{'config':9s} {'sampling':8s} {'tok/call on':>11s} {'off':>6s} {'ratio':>6s} "
    print(head + f"{'tok/s on':>9s} {'off':>6s} {'ratio':>6s} {'forced on':>9s} {'off':>5s} same ids", flush=True)
    results = []
    for sampling in a.sampling.split(","):
        for name in a.configs.split(","):
            replies = run_config(a, target, draft, CONFIGS[name], sampling)
            on, off = summary(replies[True]), summary(replies[False])
            same = None
            if sampling == "greedy" and name in LOSSLESS:
                same = all(x["ids"] == y["ids"] for x, y in zip(replies[True], replies[False]))
            row = {"config": name, "sampling": sampling, "store": store, "on": on, "off": off, "same_ids": same}
            results.append(row)
            per_call = on["tokens_per_call"] / off["tokens_per_call"] if off["tokens_per_call"] else 0.0
            speed = on["tok_s"] / off["tok_s"] if off["tok_s"] else 0.0
            print(
                f"{name:9s} {sampling:8s} {on['tokens_per_call']:11.2f} {off['tokens_per_call']:6.2f} {per_call:6.2f} "
                f"{on['tok_s']:9.2f} {off['tok_s']:6.2f} {speed:6.2f} {on['forced_share']:9.0%} "
                f"{off['forcible_share']:5.0%} "
                f"{'-' if same is None else same}",
                flush=True,
            )
    print("\nper reply token: ms in the target, the draft, the chain, the rest of the loop; tokens each decoded")
    print(
        f"{'config':9s} {'sampling':8s} side {'target':>7s} {'draft':>6s} {'chain':>6s} {'rest':>6s} {'share':>6s} "
        f"{'t.dec':>6s} {'d.dec':>6s}"
    )
    for row in results:
        for side in ("on", "off"):
            m, d, sm = row[side]["ms_per_token"], row[side]["decoded_per_token"], row[side]
            print(
                f"{row['config']:9s} {row['sampling']:8s} {side:4s} {m['target']:7.2f} {m['draft']:6.2f} "
                f"{m['chain']:6.2f} {m['rest']:6.2f} {sm['chain_share']:6.1%} {d['target']:6.2f} {d['draft']:6.2f}"
            )
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
