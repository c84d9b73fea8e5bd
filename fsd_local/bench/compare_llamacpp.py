"""Side by side with llama.cpp's `speculative-simple` example: greedy `sd` on the same pair, prompt, k and threads,
alternating `--repeats` times; prints each side's tokens/s and acceptance and whether the texts are identical.
Build the binary with `native/build.sh --tool llama-speculative-simple cpu` (docs/benchmarking.md)."""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess

from fsd_local.engine import Engine
from fsd_local.llama.bindings import default_threads


def run_llamacpp(binary, target, draft, prompt, n, k, threads, ctx):
    """k None: llama.cpp's own draft defaults (only greedy sampling and the run length are set)."""
    # option names of the llama.cpp that llama-cpp-python 0.3.36 vendors (older builds: --draft-max ...)
    if k is None:
        # the draft model's speculation type must be named (no draft-length option is given)
        cmd = [binary, "-m", target, "-md", draft, "--spec-type", "draft-simple", "-p", prompt, "-n", str(n)]
        cmd += ["--temp", "0", "--top-k", "1"]
        cmd += ["-t", str(threads), "-td", str(threads), "-c", str(ctx), "--ignore-eos", "-ngl", "0", "-ngld", "0"]
        return _parse(binary, subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800))
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
    return _parse(binary, subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800))


def _parse(binary, r):
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
    ap.add_argument("--demo", default="q4_1", help="demo pair when no --target: q4_1, f16, q4_0, wide")
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--prompts", help="a file of prompts, one per line (a ratio per prompt)")
    ap.add_argument("--chat", action="store_true", help="format each prompt with the target's chat template")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--defaults", action="store_true", help="each side at its own draft defaults (no -k)")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if not a.target:
        from fsd_local.pairs.demo import demo_pair

        d, t = demo_pair(precision=a.demo)
        a.target, a.draft = str(t), str(d)
    prompts = [a.prompt]
    if a.prompts:
        with open(a.prompts, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    k = None if a.defaults else a.k
    ours_all, theirs_all = [], []
    with Engine(target=a.target, draft=a.draft, n_ctx=a.ctx, n_threads=a.threads) as eng:
        for prompt in prompts:
            text = prompt
            if a.chat:  # the template's text, special tokens spelled out: both sides parse them the same way
                from fsd_local.llama.chat_template import ChatTemplate

                text = ChatTemplate.from_model(eng.target).render([{"role": "user", "content": prompt}])
            ours, theirs = [], []
            for _ in range(a.repeats):
                eng.reset()  # same cold prompt as the separate llama.cpp process
                kw = {} if k is None else {"draft_max": k, "draft_policy": "fixed"}
                out = eng.generate(text, mode="sd", max_tokens=a.n, ignore_eos=True, **kw)
                ours.append(out)
                theirs.append(run_llamacpp(a.binary, a.target, a.draft, text, a.n, k, a.threads, a.ctx))
            ours_all.append(ours)
            theirs_all.append(theirs)
            o = statistics.median(x.stats["tokens_per_second"] for x in ours)
            t = statistics.median(x["tokens_per_second"] for x in theirs)
            print(
                f"prompt {len(ours_all)}: fsd-local {o:6.2f} tok/s (k histogram {ours[-1].stats['k_histogram']}, "
                f"acceptance {ours[-1].stats['acceptance_rate']:.2f})  llama.cpp {t:6.2f} tok/s (acceptance "
                f"{theirs[-1]['acceptance_rate']})  ratio {o / t:.2f}x",
                flush=True,
            )
    print(
        f"pair: target {a.target}\n      draft  {a.draft}\n{'each at its defaults' if k is None else f'k={k}'} "
        f"n={a.n} threads={a.threads} greedy sd, {a.repeats} alternating runs per prompt, {len(prompts)} prompts"
    )
    o_tps = sum(sum(x.stats["tokens"] for x in r) for r in ours_all) / sum(
        sum(x.stats["seconds_total"] for x in r) for r in ours_all
    )
    t_tps = sum(sum(x["tokens"] for x in r) for r in theirs_all) / sum(sum(x["seconds"] for x in r) for r in theirs_all)
    print(f"fsd-local  sd: {o_tps:7.2f} tok/s over all prompts")
    print(f"llama.cpp    : {t_tps:7.2f} tok/s over all prompts")
    print(f"ratio fsd-local / llama.cpp: {o_tps / t_tps:.2f}x")
    split = {key: sum(x.stats["seconds"][key] for r in ours_all for x in r) for key in ("draft", "target", "other")}
    total = sum(x.stats["seconds_total"] for r in ours_all for x in r)
    print(
        f"fsd-local time split: draft {split['draft']:.2f}s target {split['target']:.2f}s other "
        f"{split['other']:.3f}s ({split['other'] / total:.1%} of wall time)"
    )


if __name__ == "__main__":
    main()
