"""Every command that compiles kernels, in passes that share one kernel cache (issue 58's goal): pass 1 starts on an
empty cache with two commands at the same moment, later passes load what earlier ones wrote, and pass 3 starts
two at once again. Prints each command's exit code and the crashes (a negative code: killed by a signal).

    python benchmarks/kernel_cache_passes.py [--passes 3] [--demo q4_1 | --target T --draft D] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODES = ("fsd", "fsd-paper", "sd", "ar", "typical", "cascade", "relaxed", "fsd-entropy", "draft-only")
TIMEOUT = 900


def commands(models: list[str], prompts: Path) -> list[tuple[str, list[str]]]:
    gen = ["generate", *models, "--max-tokens", "16", "The three primary colours are"]
    out = [(f"generate {m}", [*gen, "--mode", m]) for m in MODES]
    out += [
        ("generate sampled", [*gen, "--temp", "0.8", "--seed", "1"]),
        ("generate top-p budget", [*gen, "--temp", "0.7", "--top-p", "0.9", "--quality-budget", "0.1"]),
        ("generate logprobs", [*gen, "--top-logprobs", "3", "--json"]),
        ("bench --kernels", ["bench", "--kernels", "--vocab", "32000", "--vocab", "262144", "--repeats", "1"]),
        ("bench --overhead", ["bench", "--overhead", *models, "--repeats", "1", "--max-tokens", "16"]),
        (
            "calibrate",
            [
                "calibrate",
                *models,
                "--prompts",
                str(prompts),
                "--max-tokens",
                "16",
                "--steps",
                "2",
                "--min-agreement",
                "0.9",
            ],
        ),
    ]
    return out


def start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fsd_local.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        return 124, err
    return p.returncode, err


def serve(models: list[str], env: dict) -> tuple[int, str]:
    """`fsd-local serve`, one completion through it, then Ctrl-C (130 is its clean exit)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [sys.executable, "-m", "fsd_local.cli", "serve", *models, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    body = b'{"model": "m", "prompt": "The sky is", "max_tokens": 8}'
    deadline = time.monotonic() + TIMEOUT
    answered = False
    while time.monotonic() < deadline and p.poll() is None and not answered:
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            answered = urllib.request.urlopen(req, timeout=300).status == 200
        except OSError:
            time.sleep(1)
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    rc, err = finish(p)
    return (rc if rc not in (0, 130) or answered else 1), err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--demo", default="q4_1")
    ap.add_argument("--target", help="a target GGUF instead of the demo pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--cache", help="the kernel cache to share (default: a new empty folder)")
    ap.add_argument("--only", type=int, help="the first N commands of each pass (and serve)")
    a = ap.parse_args()
    models = ["--target", a.target, "--draft", a.draft] if a.target else ["--demo", a.demo]
    tmp = Path(tempfile.mkdtemp(prefix="fsd-kcache-"))
    cache = Path(a.cache) if a.cache else tmp / "numba"
    prompts = tmp / "prompts.txt"
    prompts.write_text("The three primary colours are\nOnce upon a time\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), FSD_LOCAL_COSTS=str(tmp / "costs.json"))
    cmds = commands(models, prompts)[: a.only]
    rcs: list[int] = []

    def record(name: str, rc: int, err: str, seconds: float, note: str = "") -> None:
        print(f"  {name:<24} rc {rc:>4}  {seconds:.0f} s{note}", flush=True)
        if rc not in (0, 130):  # 130: serve's clean Ctrl-C
            print("   ", err.strip().splitlines()[-1:], flush=True)
        rcs.append(rc)

    for n in range(1, a.passes + 1):
        print(f"pass {n} ({'empty cache' if n == 1 and not a.cache else 'shared cache'})", flush=True)
        # the first two commands of passes 1 and 3 start at the same moment, the others one after another
        groups = [cmds[:2], *([c] for c in cmds[2:])] if n in (1, 3) else [[c] for c in cmds]
        for group in groups:
            t = time.monotonic()
            done = [finish(p) for p in [start(args, env) for _, args in group]]
            for (name, _), (rc, err) in zip(group, done):
                record(name, rc, err, time.monotonic() - t, " (started together)" if len(group) > 1 else "")
        t = time.monotonic()
        record("serve", *serve(models, env), time.monotonic() - t)
    runs, crashes = len(rcs), sum(rc < 0 for rc in rcs)
    print(f"{runs} runs, {crashes} crashes; cache {cache}")
    if not a.cache:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
