"""What llama.cpp's weight repacking (--repack / --no-repack) is worth on this host: the same pair loaded twice,
repacked and not, generating alternately in one process so both see the same machine noise. Prints tokens/s
per mode and the ratio. Run on a host where repacking is safe (doctor says `repack: on`); the demo pair's
Q4_0 copies are what the CPU backend repacks (Q4_1 has no repacked layout).

    python benchmarks/repack_cost.py [--precision q4_0] [--tokens 128] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics

from fsd_local import Engine, ModelOptions
from fsd_local.llama.cpu_features import repack_choice
from fsd_local.pairs.demo import demo_pair

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="q4_0")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", help="a target GGUF instead of the demo pair's (with --draft)")
    ap.add_argument("--draft", help="its draft GGUF")
    a = ap.parse_args()
    print(f"host default: repack {repack_choice()}")
    draft, target = (a.draft, a.target) if a.target else demo_pair(precision=a.precision)
    engines = {}
    for repack in (True, False):
        opts = dict(n_ctx=1024, n_threads=a.threads, repack=repack)
        engines[repack] = Engine(target=ModelOptions(str(target), **opts), draft=ModelOptions(str(draft), **opts))
    runs: dict[tuple[bool, str], list[float]] = {}
    for _ in range(a.repeats):
        for mode, extra in (("ar", {}), ("sd", {"draft_max": 4}), ("fsd", {"tau": 0.2, "draft_max": 6})):
            for repack, eng in engines.items():
                eng.reset()
                out = eng.generate(PROMPT, mode=mode, max_tokens=a.tokens, ignore_eos=True, **extra)
                runs.setdefault((repack, mode), []).append(out.stats["tokens_per_second"])
    print(f"{a.precision} demo pair, {a.tokens} tokens, {a.threads} threads, median of {a.repeats} alternating runs")
    for mode in ("ar", "sd", "fsd"):
        on, off = (statistics.median(runs[(r, mode)]) for r in (True, False))
        print(f"{mode:4s} repack {on:7.1f} tok/s   no-repack {off:7.1f} tok/s   no-repack / repack {off / on:.2f}x")
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
