"""Every script in benchmarks/ runs to its end on the smallest inputs (the tiny pair, one prompt, a few tokens), so
that none of them rots unnoticed. What they print is measured on real pairs elsewhere; here only that they run and
print what they say they print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsd_local.kernels import jit_cache

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
TINY = ["--threads", "1"]


def _args(name: str, target: str, draft: str, tmp: Path, prompts: str) -> tuple[list[str], str]:
    """The smallest run of each script and a piece of what it must print."""
    pair = ["--target", target, "--draft", draft]
    return {
        "across_divergence": (pair + TINY + ["--prompts", "1", "--tokens", "6"], "positions"),
        "across_pair": (pair + TINY + ["--prompts", "1", "--tokens", "4", "--k", "2"], "tokens per target call"),
        "auto_goals": (pair + TINY + ["--prompts", prompts, "--tokens", "4", "--fixed", "2", "--k-max", "3"], "auto "),
        "batch_costs": (
            ["--target", target] + TINY + ["--rows", "3", "--seqs", "1,2", "--context", "8", "--passes", "1"],
            "rows | one-seq ctx",
        ),
        "batch_policy": (["--gpu", "--seeds", "1", "--tokens", "8"], "best fixed k"),
        "batch_clients": (
            pair + TINY + ["--clients", "2", "--requests", "2", "--prompts", "1", "--tokens", "4"],
            "ar: 2 at once / one at a time",
        ),
        "batch_join": (
            pair + TINY + ["--prompt-tokens", "40", "--tokens", "16", "--chunks", "8"],
            "worst gap while it joins",
        ),
        "cache_refill": (
            pair + TINY + ["--repeats", "2", "--tokens", "4", "--prompts", "1", "--light-vocab", "400"],
            "own us/round",
        ),
        "budget_lumps": (pair + TINY + ["--prompts", "1", "--tokens", "6", "--budgets", "0.1"], "loss per rescue"),
        "budget_bound": (pair + TINY + ["--prompts", prompts, "--tokens", "6", "--budgets", "0.1"], "B 0.1, "),
        "carry_cost": (["--draft-vocab", "50", "--target-vocab", "80", "--repeats", "1"], "us a round of 4"),
        "cold_auto": (
            pair
            + TINY
            + ["--prompts", "2", "--tokens", "4", "--ks", "2", "--repeats", "1", "--store", "empty"]
            + ["--sampling", "chat", "--conversation", "--rules", "sd,budget@0.1"],
            "auto ",
        ),
        "eos_rescue": (pair + TINY + ["--prompts", "2", "--tokens", "4", "--modes", "fsd:0.4"], "ended at an end of"),
        "follow_cost": (pair + TINY + ["--context", "40", "--rounds", "3", "--k", "2"], "re-decoded tokens"),
        "first_token": (pair + TINY + ["--repeats", "1", "--tokens", "2", "--empty-store"], "first request"),
        "chat_loops": (pair + TINY + ["--seeds", "1", "--only", "greedy", "--prompts", "1", "--max-tokens", "4"], "1 "),
        "json_overhead": (pair + TINY + ["--repeats", "1", "--people", "1", "--max-tokens", "6"], "json ms/tok"),
        "jump_forward": (
            pair + TINY + ["--prompts", "1", "--tokens", "8", "--configs", "ar,sd-k4", "--sampling", "greedy,chat"],
            "sd-k4     chat",
        ),
        "tools_jump_forward": (
            pair + TINY + ["--asks", "1", "--tokens", "8", "--configs", "sd-k4"],
            "sd-k4 ",
        ),
        "recurrent_batch": (TINY + ["--rounds", "2"], "hybrid, as loaded"),
        "record_traces": (pair + TINY + ["--prompts", "1", "--tokens", "4", "--out", str(tmp / "t.json")], "written"),
        "repack_cost": (pair + TINY + ["--tokens", "4", "--repeats", "1"], "no-repack / repack"),
        "rules_frontier": (
            pair
            + TINY
            + ["--out", str(tmp / "f.json"), "--repeats", "1", "--max-tokens", "4", "--temps", "0"]
            + ["--modes", "fsd", "--prompts", "1", "--k", "2", "--taus", "fsd=0.2"],
            "frontier at temperature 0",
        ),
        "text_path": (pair + TINY + ["--prompts", "1", "--tokens", "4", "--k", "2"], "greedy sd replies equal"),
        "onehot_speed": (["--n", "4096", "--repeats", "2"], "one-hot divergences, n=4096"),
        "kernel_cache_passes": (  # the suite's own (warm) kernel cache: compiling every kernel twice would take minutes
            pair + ["--passes", "1", "--only", "2", "--cache", str(jit_cache.cache_root())],
            "3 runs, 0 crashes",
        ),
        "policy_cost": (["--k-max", "4", "--rounds", "5"], "us a round (k_max 4"),
        "serve_load": (
            pair
            + TINY
            + ["--ctx", "512", "--clients", "2", "--requests", "2", "--prompts", "1", "--tokens", "4", "--modes", "ar"]
            + ["--alone", "1", "--repeats", "1", "--base", str(ROOT), "--soak", "8", "--warmup", "2", "--same-server"]
            + ["--soak-tokens", "4"],
            "; 5xx: 0",
        ),
        "serve_overhead": (pair + TINY + ["--repeats", "1", "--max-tokens", "4", "--restarts", "1"], "restart_seconds"),
        "sampled_overhead": (
            pair + TINY + ["--repeats", "1", "--tokens", "4", "--prompts", "1", "--light", "--against", str(ROOT)],
            "T 0.7 fsd js 0.3",
        ),
    }[name]


def test_every_script_has_a_smoke_run():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    with pytest.raises(KeyError):
        _args("not a script", "t", "d", Path("."), "p")
    for name in scripts:
        _args(name, "t", "d", Path("."), "p")  # KeyError: a new script without its smoke run here


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_script_runs_on_the_tiny_pair(name, tiny_pair, tmp_path):
    draft, target = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat on the mat"}) + "\n")
    args, expected = _args(name, target, draft, tmp_path, str(prompts))
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # no script may depend on where it is started from
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert expected in out.stdout, out.stdout[-2000:]
