"""The kernel cache across processes (kernels/jit_cache.py): every test runs tests/support/kernel_worker.py in
subprocesses with a cache directory of its own, and asserts what a later process loads and computes."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fsd_local.cli.main import cli
from fsd_local.kernels import jit_cache
from support import tinymodels as tm

WORKER = Path(__file__).parent / "support" / "kernel_worker.py"
TIMEOUT = 900  # a cold compile of every kernel takes ~70 s on 2 idle cores; two at once, or beside a busy core, more


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_pair) -> list[str]:
    d = tmp_path_factory.mktemp("kernel_cache")
    cross_draft = tm.write_tiny_gguf(d / "spm.gguf", seed=1, control=("<|im_end|>",))
    cross_target = tm.write_tiny_gguf(d / "bigbpe.gguf", seed=5, n_layer=3, n_embd=128, tokenizer="bpe")
    return [*tiny_pair, str(cross_draft), str(cross_target)]


def start(job: str, cache: Path, models: list[str]) -> subprocess.Popen:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), FSD_LOCAL_COSTS=str(cache.parent / f"costs-{job}.json"))
    return subprocess.Popen(
        [sys.executable, str(WORKER), job, *models],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent,
    )


def finish(p: subprocess.Popen) -> tuple[dict, list[str]]:
    """(the worker's JSON, its stderr lines from fsd-local); fails on any exit but 0 (a crash is -11)."""
    out, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 0, f"worker exited {p.returncode}:\n{err[-3000:]}"
    return json.loads(out), [line for line in err.splitlines() if line.startswith("fsd-local:")]


def run(job: str, cache: Path, models: list[str]) -> tuple[dict, list[str]]:
    return finish(start(job, cache, models))


def same(a: dict, b: dict) -> bool:
    """The same token ids, and the same divergences to float32 rounding: a kernel compiled beside loaded callees
    is optimised after linking them, and its reassociated sums may round differently from a fresh compile."""
    keys = ("rows", "long_rows", "argmax", "divergence")
    return all(np.allclose(a[k], b[k], rtol=1e-6, atol=1e-12) for k in keys if k in a or k in b) and a.get(
        "tokens"
    ) == b.get("tokens")


def entries(cache: Path) -> list[Path]:
    return sorted(cache.rglob(f"*{jit_cache.SUFFIX}"))


@pytest.fixture(scope="module")
def compiled_at_once(tmp_path_factory, models):
    """Two processes compiling every kernel at the same moment into one empty cache: (their results, the cache)."""
    cache = tmp_path_factory.mktemp("at_once") / "numba"
    both = [start("run", cache, models), start("run", cache, models)]
    return [finish(p) for p in both], cache


def test_two_processes_compiling_at_once_leave_a_cache_a_third_loads_whole(compiled_at_once, models):
    (first, said_1), (second, said_2) = compiled_at_once[0]
    cache = compiled_at_once[1]
    # a kernel one process loaded whole was compiled by the other, which reached what it calls
    assert set(first["unreached"]) & set(second["unreached"]) == set(), "the workload reaches every cached kernel"
    assert first["compiled"] > 0 and second["compiled"] > 0  # both compiled into the cache at once
    assert same(first, second)
    assert said_1 == said_2 == []
    for path in entries(cache):  # every entry whole and for this machine, whichever process wrote it last
        assert jit_cache.read_entry(path)[2] is None, path.name
    third, said = run("rows-first", cache, models)
    assert third["compiled"] == 0 and third["loaded"] > 0
    assert same(third, first)
    assert said == []


def test_every_kernel_compiled_beside_cached_callees_loads_in_a_third_process(compiled_at_once, models, tmp_path):
    """numba records that a kernel needs its parallel backend started only where a parallel callee was compiled in
    the same process: compiled beside callees loaded from the cache, such a kernel crashed when loaded first."""
    reference = compiled_at_once[0][0][0]
    cache = tmp_path / "numba"
    shutil.copytree(compiled_at_once[1], cache)
    again, said = run("recompile", cache, models)
    assert again["compiled"] > 50 and again["loaded"] > 50  # kernels compiled anew while their callees loaded
    assert said == []
    for job in ("rows-first", "run"):
        third, said = run(job, cache, models)
        assert third["compiled"] == 0, job
        assert same(third, reference), job
        assert said == []


def test_the_benchmark_kernel_compiled_after_a_generation_loads_again(models, tmp_path):
    """The reported order: a generation's kernels cached, then `bench --kernels` compiles its own beside them
    (cached), then `bench --kernels` again."""
    cache = tmp_path / "numba"
    run("divergence", cache, models)
    second = run("rows-first", cache, models)[0]
    third, said = run("rows-first", cache, models)
    assert second["compiled"] > 0 and third["compiled"] == 0
    assert same(third, second) and said == []


def _rewrite_header(path: Path, **fields) -> None:
    raw = path.read_bytes()
    start = len(jit_cache.MAGIC) + 4
    (n,) = struct.unpack_from("<I", raw, len(jit_cache.MAGIC))
    header = {**pickle.loads(raw[start : start + n]), **fields}
    new = pickle.dumps(header)
    path.write_bytes(jit_cache.MAGIC + struct.pack("<I", len(new)) + new + raw[start + n :])


def test_a_defective_entry_is_one_line_on_stderr_and_a_recompile(compiled_at_once, models, tmp_path):
    reference = compiled_at_once[0][0][0]
    cache = tmp_path / "numba"
    shutil.copytree(compiled_at_once[1], cache)
    # six entries the workload loads itself, each its kernel's only one (the others are linked into their callers')
    loaded = run("rows-first", cache, models)[0]["loaded_files"]
    files = {b: [p for p in entries(cache) if p.name.startswith(b + ".")] for b in loaded}
    alone = [f[0] for f in files.values() if len(f) == 1]
    assert len(alone) >= 7, loaded
    truncated, flipped, other_numba, other_cpu, swapped, foreign = alone[:6]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    raw = bytearray(flipped.read_bytes())
    raw[-10] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    _rewrite_header(other_numba, numba="0.1.0")
    header = jit_cache.read_entry(other_cpu)[0]
    assert header is not None
    _rewrite_header(other_cpu, cpu="('x86_64-unknown-linux-gnu', 'generic', '')", key=header["key"] + "x")
    shutil.copyfile(alone[6], swapped)  # a whole entry under another signature's name
    foreign.write_bytes(b"\x80\x04not an entry")
    result, said = run("rows-first", cache, models)
    assert same(result, reference)
    assert len(said) == 6, said
    problems = {
        truncated.name: "damaged (checksum",
        flipped.name: "damaged (checksum",
        other_numba.name: "written by numba 0.1.0",
        other_cpu.name: "compiled for another CPU",
        swapped.name: "holds another signature",
        foreign.name: "not an fsd-local kernel entry",
    }
    for name, problem in problems.items():
        assert any(name in line and problem in line and "compiling it again" in line for line in said), name
    again, said = run("rows-first", cache, models)  # the recompiles replaced them
    assert again["compiled"] == 0 and said == []


def test_an_unwritable_cache_is_one_line_and_kernels_still_run(models, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a cache "folder" under a plain file cannot be made
    result, said = run("divergence", blocked / "numba", models)
    assert result["divergence"] > 0
    assert len(said) == 1 and "cannot write the kernel cache" in said[0]


def test_state_and_clear_report_what_is_on_disk(compiled_at_once, monkeypatch, tmp_path):
    cache = tmp_path / "numba"
    shutil.copytree(compiled_at_once[1], cache)
    (cache / "0.1.0-0123456789abcdef").mkdir()  # an older version's folder
    (cache / "0.1.0-0123456789abcdef" / "x.nbc").write_bytes(b"12345")
    (cache / "someone-elses").mkdir()  # not ours: never counted nor deleted
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    s = jit_cache.state()
    assert s["path"] == str(jit_cache.kernel_cache_dir()) and s["kernels"] == len(entries(jit_cache.kernel_cache_dir()))
    assert s["kernels"] > 100 and s["defective"] == 0 and s["other_cpu"] == 0
    assert s["stale_folders"] == 1 and s["stale_bytes"] == 5
    shown = CliRunner().invoke(cli, ["doctor"])
    assert shown.exit_code == 0, shown.output
    line = next(x for x in shown.output.splitlines() if x.startswith("kernel cache:"))
    assert f"{s['path']}: {s['kernels']} kernels" in line and "1 folder of other versions" in line
    assert "fsd-local doctor --clear-kernel-cache" in shown.output
    cleared = CliRunner().invoke(cli, ["doctor", "--clear-kernel-cache"])
    assert cleared.exit_code == 0 and "kernel cache cleared" in cleared.output
    assert jit_cache.state()["kernels"] == 0 and jit_cache.state()["stale_folders"] == 0
    assert (cache / "someone-elses").is_dir()


def test_an_entry_from_other_kernel_sources_is_one_line_and_a_recompile(models, tmp_path):
    cache = tmp_path / "numba"
    first = run("divergence", cache, models)[0]
    entry = next(p for p in entries(cache) if p.name.startswith("divergence.divergence-"))
    _rewrite_header(entry, sources="0123456789abcdef")  # as if copied from an install of other kernel sources
    again, said = run("divergence", cache, models)
    assert same(again, first) and again["compiled"] > 0
    assert len(said) == 1 and entry.name in said[0] and "compiled from other kernel sources" in said[0]
    assert run("divergence", cache, models)[1] == []
