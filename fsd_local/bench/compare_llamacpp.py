"""Side by side with llama.cpp's own `speculative-simple` example on the same pair, prompt and k.

    native/build.sh --tool llama-speculative-simple cpu    # from the llama.cpp that llama-cpp-python vendors
    python -m fsd_local.compare_llamacpp \\
        --binary ~/.cache/fsd-local/build/llama-speculative-simple-cpu/bin/llama-speculative-simple

Both run greedy standard speculative decoding (`sd`, tau = 0) with a fixed draft length and no p_min early
stop, on the same thread count; the two runs alternate `--repeats` times so machine noise hits both alike.
Reported: tokens/s of each (llama.cpp's own "decoded N tokens in T seconds" line; ours the same span),
acceptance, and whether the generated text is identical.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess

from fsd_local.engine import Engine
from fsd_local.llama.bindings import default_threads


def run_llamacpp(binary, target, draft, prompt, n, k, threads, ctx):
    # option names of the llama.cpp that llama-cpp-python 0.3.36 vendors (older builds: --draft-max ...)
    cmd = [
        binary,
        "-m",
        target,
        "-md",
        draft,
        "--spec-type",
        "draft-simple",
        "-p",
        prompt,
        "-n",
        str(n),
        "--spec-draft-n-max",
        str(k),
        "--spec-draft-n-min",
        "0",
        "--spec-draft-p-min",
        "0",
        "--temp",
        "0",
        "--top-k",
        "1",
        "-t",
        str(threads),
        "-td",
        str(threads),
        "-c",
        str(ctx),
        "--ignore-eos",
        "-ngl",
        "0",
        "-ngld",
        "0",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"{binary} failed ({r.returncode}): {log[-2000:]}")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    acc = re.search(r"accept\s+=\s+([\d.]+)%", log)
    return {
        "tokens": int(m.group(1)),
        "seconds": float(m.group(2)),
        "tokens_per_second": float(m.group(3)),
        "acceptance_rate": float(acc.group(1)) / 100 if acc else None,
        "output": r.stdout,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, help="path to llama-speculative-simple")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if not a.target:
        from fsd_local.pairs.demo import demo_pair

        d, t = demo_pair()
        a.target, a.draft = str(t), str(d)
    ours, theirs = [], []
    with Engine(target=a.target, draft=a.draft, n_ctx=a.ctx, n_threads=a.threads) as eng:
        for _ in range(a.repeats):
            eng.reset()  # same cold prompt as the separate llama.cpp process
            out = eng.generate(a.prompt, mode="sd", draft_max=a.k, max_tokens=a.n, ignore_eos=True)
            ours.append(out)
            theirs.append(run_llamacpp(a.binary, a.target, a.draft, a.prompt, a.n, a.k, a.threads, a.ctx))
    o_tps = statistics.median(o.stats["tokens_per_second"] for o in ours)
    t_tps = statistics.median(t["tokens_per_second"] for t in theirs)
    same = all(o.text in t["output"] for o, t in zip(ours, theirs))
    print(
        f"pair: target {a.target}\n      draft  {a.draft}\nk={a.k} n={a.n} threads={a.threads} greedy sd, "
        f"{a.repeats} alternating runs each"
    )
    print(
        f"fsd-local  sd: {o_tps:7.2f} tok/s  acceptance {ours[0].stats['acceptance_rate']:.3f}  "
        f"runs {[round(o.stats['tokens_per_second'], 2) for o in ours]}"
    )
    print(
        f"llama.cpp    : {t_tps:7.2f} tok/s  acceptance {theirs[0]['acceptance_rate']:.3f}  "
        f"runs {[t['tokens_per_second'] for t in theirs]}"
    )
    print(f"ratio fsd-local / llama.cpp: {o_tps / t_tps:.2f}x   same text: {same}")
    sec = ours[0].stats["seconds"]
    print(f"fsd-local time split: draft {sec['draft']:.2f}s target {sec['target']:.2f}s other {sec['other']:.3f}s")


if __name__ == "__main__":
    main()
