"""How often a lossy rule ends a reply where the target would write on (issue 37): greedy, each mode at a lossy
tau, fixed k, the chat prompts; for every reply that ended at an end-of-generation token, the target alone is
asked what it writes after the same text (one plain step): a reply it would not end there was cut by a rescued end.

    python benchmarks/eos_rescue.py --demo f16 [--k 4] [--prompts 24] [--tokens 256] [--modes fsd:0.4,cascade:0.4]

Prints per mode: replies, those that ended at an end of generation, those the target would have continued
("cut"), and the mean reply length against `ar`'s on the same prompts (greedy, so `ar` is the target's own text).
F16 targets only (token ids comparable across batch shapes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsd_local.bench.prompts import load_prompts
from fsd_local.engine import Engine
from fsd_local.pairs.demo import demo_pair

CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "fsd_local" / "data" / "prompts-chat.jsonl"
ISSUE_PROMPT = "Explain why the sky is blue to a ten-year-old."  # issue 37's reply cut at 21 tokens (k 4, tau 0.4)
MODES = "fsd:0.4,fsd-paper:0.4,fsd-entropy:0.6,typical:0.5,cascade:0.4,relaxed:0.2"


def target_ends_here(eng: Engine, ids: list[int]) -> bool:
    """Whether the target's own next token after `ids` (greedy) ends the reply."""
    eng.reset()
    out = eng.generate(ids, mode="ar", max_tokens=1)
    return out.finish_reason == "stop" and not out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="f16", choices=("f16",))
    ap.add_argument("--target", help="an F16/F32 target GGUF instead of the demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--modes", default=MODES, help="mode:tau,... (default: %(default)s)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.demo)
    prompts = [ISSUE_PROMPT] + [p.text for p in load_prompts(str(CHAT_PROMPTS))][: a.prompts - 1]
    rows = []
    with Engine(target=str(target), draft=str(draft), n_threads=a.threads, n_ctx=2048) as eng:
        chats = [eng.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
        plain = [eng.generate(ids, mode="ar", max_tokens=a.tokens) for ids in chats]
        ar = [len(out.token_ids) for out in plain]
        ended = sum(out.finish_reason == "stop" for out in plain)
        mean = sum(ar) / len(ar)
        print(f"{'ar':22s} {len(chats)} replies, {ended} ended at an end of generation; mean {mean:.1f} tokens")
        for spec in a.modes.split(","):
            mode, _, tau = spec.partition(":")
            ended = cut = 0
            lengths = []
            for ids in chats:
                eng.reset()
                out = eng.generate(
                    ids, mode=mode, tau=float(tau), draft_policy="fixed", draft_max=a.k, max_tokens=a.tokens
                )
                lengths.append(len(out.token_ids))
                if out.finish_reason == "stop":
                    ended += 1
                    cut += not target_ends_here(eng, ids + out.token_ids)
            row = {
                "mode": mode,
                "tau": float(tau),
                "replies": len(chats),
                "ended": ended,
                "cut": cut,
                "mean_tokens": sum(lengths) / len(lengths),
                "ar_mean_tokens": sum(ar) / len(ar),
            }
            rows.append(row)
            print(
                f"{mode:12s} tau {float(tau):4.2f}  {row['replies']} replies, {ended} ended at an end of generation, "
                f"{cut} of them where the target writes on; mean {row['mean_tokens']:.1f} tokens (ar "
                f"{row['ar_mean_tokens']:.1f})",
                flush=True,
            )
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
