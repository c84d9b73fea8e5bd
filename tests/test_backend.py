"""Backends, doctor, GPU placement and per-model load options, on this machine's build (CPU-only here).

What a GPU build adds is in test_gpu.py; everything here also holds on a GPU build."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp as lc
import pytest
from click.testing import CliRunner

from fsd_local.cli import cli
from fsd_local.cli.options import load_engine
from fsd_local.errors import ModelLoadError
from fsd_local.llama import backend, gguf_info
from fsd_local.llama.doctor import render, report
from fsd_local.llama.model import Model
from fsd_local.llama.options import KV_TYPES, ModelOptions
from fsd_local.llama.placement import Footprint, footprint, plan
from fsd_local.settings import Settings
from support.serving import free_port
from support.tinymodels import write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
PIN = re.search(r'"llama-cpp-python==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


@pytest.fixture(scope="module")
def info():
    return backend.detect()


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """(draft, target) tiny models with 32-wide heads: quantised KV caches need head sizes of 32."""
    d = tmp_path_factory.mktemp("wide")
    return (
        str(write_tiny_gguf(d / "draft.gguf", seed=1, n_head=2)),
        str(write_tiny_gguf(d / "target.gguf", seed=2, noise=0.1, n_head=2)),
    )


# ---------------------------------------------------------------- detection
def test_detection_reports_this_build(info):
    assert info.llama_cpp_python == lc.__version__ == PIN
    assert re.match(r"\d+\.\d+", info.llama_cpp) and re.match(r"\d+\.\d+", info.ggml)
    assert "CPU" in info.backends
    cpu = [d for d in info.devices if d.kind == "cpu"]
    assert cpu and cpu[0].total > 0 and 0 < cpu[0].free <= cpu[0].total
    assert info.gpu_offload == (bool(info.gpus) or info.rpc)
    assert all(d.kind in ("gpu", "igpu") and d.total > 0 for d in info.gpus)
    assert info.threads >= 1 and "CPU :" in info.system_info
    json.dumps(info.to_dict())


def test_backend_names_from_system_info():
    text = "CPU : SSE3 = 1 | AVX2 = 1 | CUDA : ARCHS = 890 | USE_GRAPHS = 1 | MTL : EMBED_LIBRARY = 1 | "
    assert backend.backends_from_system_info(text) == ["CPU", "CUDA", "Metal"]


def test_a_cpu_only_build_reports_no_gpu(info):
    if info.gpus:
        pytest.skip(f"this build has GPUs: {[d.name for d in info.gpus]}")
    assert not info.gpu_offload or info.rpc
    # llama.cpp counts RPC servers as offload targets: a CPU + RPC build says yes, but no local GPU
    want = "GPU offload: yes (no GPU device" if info.gpu_offload else "GPU offload: no"
    assert want in render({"fsd_local": "x", "backend": info.to_dict(), "models": {}})


# ---------------------------------------------------------------- GGUF headers
def test_gguf_header_of_a_tiny_model(tiny_pair):
    i = gguf_info.read(tiny_pair[1])
    assert (i.architecture, i.n_layer, i.n_embd, i.n_head, i.n_head_kv, i.vocab_size) == ("llama", 2, 64, 4, 4, 292)
    assert (i.head_dim_k, i.n_ctx_train, i.file_type, i.tensor_types) == (16, 512, None, {"f32": 21})
    assert i.quantisation == "f32" and not i.has_chat_template and i.tokenizer.startswith("SPM")
    per_block = 4 * 64 * 64 * 4 + 3 * 64 * 128 * 4 + 2 * 64 * 4  # attention, feed-forward, norms (f32)
    assert i.layer_bytes == [per_block, per_block]
    assert i.output_bytes == 292 * 64 * 4 + 64 * 4  # output.weight + output_norm
    assert i.kv_bytes(512, KV_TYPES["f16"], KV_TYPES["f16"]) == [512 * 2 * 64 * 2] * 2
    assert (i.kv_heads, i.recurrent, i.state_bytes) == ([4, 4], [False, False], 0)


def test_a_split_model_is_read_across_its_files(tiny_pair, tmp_path):
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(tiny_pair[1])
    writer = GGUFWriter(str(tmp_path / "split.gguf"), "llama", split_max_tensors=8)  # 21 tensors: 3 files
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(tmp_path.glob("split-*-of-00003.gguf"))
    whole, split = gguf_info.read(tiny_pair[1]), gguf_info.read(str(parts[0]))
    assert len(parts) == 3 and split.file_bytes == sum(p.stat().st_size for p in parts)
    assert (split.layer_bytes, split.output_bytes, split.tensor_types) == (
        whole.layer_bytes,
        whole.output_bytes,
        whole.tensor_types,
    )
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match="split part"):
        gguf_info.read(str(parts[0]))


def test_gguf_header_errors_are_clear(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(ModelLoadError, match="could not parse the GGUF header"):
        gguf_info.read(str(bad))
    with pytest.raises(ModelLoadError, match="not found"):
        gguf_info.read(str(tmp_path / "missing.gguf"))


# ---------------------------------------------------------------- doctor
def test_doctor_on_the_tiny_pair(tiny_pair, info):
    draft, target = tiny_pair
    r = report(target=target, draft=draft)
    assert r["compatible"] is True and r["compatibility_problem"] is None
    assert r["models"]["target"]["layers"] == 2 and r["models"]["draft"]["vocab_size"] == 292
    text = render(r)
    assert "draft -> target: compatible" in text and f"llama-cpp-python {lc.__version__}" in text
    if not info.gpus:
        assert (r["placement"]["target_ngl"], r["placement"]["draft_ngl"]) == (0, 0)
        assert "run on the CPU" in r["placement"]["summary"]


@pytest.mark.real
def test_doctor_on_the_real_pair(real_pair):
    draft, target = real_pair
    result = CliRunner().invoke(cli, ["doctor", "--json", "--target", target, "--draft", draft])
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    t, d = r["models"]["target"], r["models"]["draft"]
    assert (t["layers"], d["layers"], t["vocab_size"], d["vocab_size"]) == (44, 30, 49152, 49152)
    assert t["architecture"] == d["architecture"] == "llama"
    assert t["quantisation"] == d["quantisation"] == "Q4_1" and t["tokenizer"] == "BPE"
    assert t["chat_template"] and d["size_bytes"] == Path(draft).stat().st_size
    assert r["compatible"] is True


@pytest.mark.real
def test_doctor_says_gemma_cannot_draft_for_smollm2(real_pair, gemma_path):
    result = CliRunner().invoke(cli, ["doctor", "--target", real_pair[1], "--draft", gemma_path])
    assert result.exit_code == 1
    assert "INCOMPATIBLE: tokenizer types differ: draft uses SPM (sentencepiece), target uses BPE" in result.output
    assert "gemma3" in result.output and "262144 tokens" in result.output and "Q4_K_M" in result.output


def test_doctor_without_models_and_its_errors(tiny_pair):
    runner = CliRunner()
    result = runner.invoke(cli, ["doctor"])
    assert result.exit_code == 0 and "backends:" in result.output and "RPC:" in result.output
    result = runner.invoke(cli, ["doctor", "--draft", tiny_pair[0]])
    assert result.exit_code == 2 and "--draft given without --target" in result.output
    result = runner.invoke(cli, ["doctor", "--target", "/nowhere/x.gguf"])
    assert result.exit_code == 1 and "not found" in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------- placement arithmetic
FP_T = Footprint(layers=(100,) * 10, output=50, compute=20)  # all: 1070
FP_D = Footprint(layers=(10,) * 4, output=5, compute=5)  # all: 50


def test_footprint_counts_what_n_gpu_layers_moves():
    fp = Footprint(layers=(1, 2, 3, 4), output=100, compute=1000)
    assert fp.bytes_for(0) == 0
    assert fp.bytes_for(1) == 4 + 1000  # llama.cpp offloads the last layers first
    assert fp.bytes_for(4) == 10 + 1000  # every block, output head still on the CPU
    assert fp.bytes_for(5) == fp.bytes_for(-1) == fp.bytes_for(99) == 10 + 100 + 1000
    assert fp.most_layers_within(1110) == -1 and fp.most_layers_within(1009) == 3
    assert fp.most_layers_within(999) == 0


def test_plan_puts_everything_on_a_big_gpu():
    p = plan(FP_T, FP_D, [10_000], headroom=0)
    assert (p.draft_ngl, p.target_ngl) == (-1, -1)
    assert "draft all 4 layers" in p.summary and "target all 10 layers" in p.summary


def test_plan_fills_the_draft_first_then_as_much_target_as_fits():
    p = plan(FP_T, FP_D, [300 + 50 + 470], headroom=300)
    assert p.draft_ngl == -1 and p.target_ngl == 4  # after the draft's 50: 4 * 100 + 20 <= 470 < 5 * 100 + 20
    assert "4/10 layers on the GPU" in p.summary and "the rest on the CPU" in p.summary


def test_plan_when_not_even_the_draft_fits():
    p = plan(FP_T, FP_D, [30], headroom=0)
    assert (p.draft_ngl, p.target_ngl) == (2, 0)  # 2 * 10 + 5 <= 30
    assert "target on the CPU" in p.summary


def test_plan_on_a_cpu_only_build_chooses_zero_and_says_why():
    p = plan(FP_T, FP_D, [], no_gpu="CPU-only build")
    assert (p.draft_ngl, p.target_ngl) == (0, 0)
    assert p.summary.startswith("CPU-only build: draft and target run on the CPU")
    assert plan(FP_T, None, [], target_ngl=7).target_ngl == 7  # an explicit count is kept


def test_plan_respects_explicit_counts_and_places_the_rest():
    p = plan(FP_T, FP_D, [1000], target_ngl=9, headroom=0)  # target takes 920, 80 left for the draft
    assert (p.draft_ngl, p.target_ngl) == (-1, 9)
    p = plan(FP_T, FP_D, [1000], draft_ngl=0, headroom=0)
    assert (p.draft_ngl, p.target_ngl) == (0, 9)


def test_plan_over_two_gpus_and_rpc_servers():
    # the draft sits on GPU 1 only; the target may use what is left on both
    p = plan(FP_T, FP_D, [600, 100], draft_device=1, headroom=0)
    assert (p.draft_ngl, p.target_ngl) == (-1, 6)  # 600 + 50 left: 6 * 100 + 20
    p = plan(FP_T, FP_D, [40], rpc_free=2000, headroom=0)
    assert (p.draft_ngl, p.target_ngl) == (3, -1)  # RPC memory is the target's alone: 3 * 10 + 5 <= 40
    assert "on RPC servers" in p.summary and "target all 10 layers on the GPUs and RPC servers" in p.summary
    p = plan(FP_T, FP_D, [], rpc_free=2000, headroom=0)  # a CPU machine lending the target to RPC servers
    assert (p.draft_ngl, p.target_ngl) == (0, -1)
    assert "draft on the CPU;" in p.summary and "target all 10 layers on the RPC servers" in p.summary
    p = plan(FP_T, FP_D, [1000, 1000], target_devices=[0], headroom=0)  # --split-mode none
    assert p.target_ngl == 9


def test_footprint_of_a_real_header_follows_the_kv_cache_type(tiny_pair):
    i = gguf_info.read(tiny_pair[1])
    f16 = footprint(i, 4096)
    q8 = footprint(i, 4096, "q8_0", "q8_0")
    kv16 = 4096 * 2 * 64 * 2
    assert f16.layers[0] == i.layer_bytes[0] + kv16
    assert q8.layers[0] == i.layer_bytes[0] + kv16 * 34 // 64  # q8_0: 34 bytes per 32 values
    assert footprint(i, 4096, flash_attn=True).compute < f16.compute  # no attention-score buffer
    assert f16.output == i.output_bytes


# ---------------------------------------------------------------- per-model options reach llama.cpp
def _engine(pair, say=None, **options):
    draft, target = pair
    return load_engine(
        target,
        draft,
        None,
        n_ctx=512,
        n_threads=1,
        n_gpu_layers="auto",
        draft_n_gpu_layers="auto",
        settings=Settings(mode="sd", max_tokens=24),
        say=say,
        **options,
    )


def test_context_sizes_and_cache_types_per_model(wide_pair, info):
    said = []
    with _engine(wide_pair, say=said.append, draft_n_ctx=256, cache_type_k="q8_0", cache_type_v="q8_0") as eng:
        assert (eng.target.n_ctx, eng.draft.n_ctx) == (512, 256)
        assert (eng.target.opts.cache_type_k, eng.draft.opts.cache_type_v) == ("q8_0", "q8_0")  # draft follows
        q8 = eng.generate("the cat sat")
        state_q8 = lc.llama_state_seq_get_size(eng.target.ctx, 0)
        if not info.gpus:
            assert any("run on the CPU (0 GPU layers)" in s for s in said)
            assert eng.target.opts.n_gpu_layers == eng.draft.opts.n_gpu_layers == 0
    with _engine(wide_pair, draft_cache_type_k="q4_0", draft_cache_type_v="q4_0") as eng:
        assert (eng.target.opts.cache_type_k, eng.draft.opts.cache_type_k) == ("f16", "q4_0")
        f16 = eng.generate("the cat sat")
        state_f16 = lc.llama_state_seq_get_size(eng.target.ctx, 0)
    assert q8.token_ids == f16.token_ids  # a q8_0 cache changes nothing the tiny models can tell apart
    assert state_q8 < state_f16  # the same tokens take less KV space: llama.cpp got the type


def test_flash_attention_on_and_off_and_no_mmap_all_generate(wide_pair):
    outs = []
    for options in (dict(flash_attn="on"), dict(flash_attn="off"), dict(no_mmap=True)):
        with _engine(wide_pair, **options) as eng:
            assert eng.target.opts.flash_attn == {"on": True, "off": False}.get(options.get("flash_attn"))
            assert eng.draft.opts.use_mmap is not options.get("no_mmap", False)
            outs.append(eng.generate("we ran far").token_ids)
    assert len(outs[0]) == 24 and outs[0] == outs[1] == outs[2]


def test_bad_load_options_fail_clearly(wide_pair, tiny_pair):
    runner = CliRunner()
    base = ["generate", "--target", wide_pair[1], "--draft", wide_pair[0], "--max-tokens", "2", "x"]
    result = runner.invoke(cli, base + ["--flash-attn", "off", "--cache-type-v", "q8_0"])
    assert result.exit_code == 1 and "quantised V cache (q8_0) needs flash attention" in result.output
    result = runner.invoke(cli, base + ["--ngl", "-3"])
    assert result.exit_code == 2 and "use -1 for all" in result.output
    result = runner.invoke(cli, base + ["--tensor-split", "3,x"])
    assert result.exit_code == 2 and "proportions like 3,1" in result.output
    with pytest.raises(ModelLoadError, match="tensor split"):
        Model(ModelOptions(tiny_pair[1], tensor_split=[0.0, 0.0]))


# ---------------------------------------------------------------- RPC
def test_rpc_endpoints_are_checked():
    assert backend.parse_rpc_servers("127.0.0.1:50052, host:1") == ["127.0.0.1:50052", "host:1"]
    for bad in ("", "host", "host:port", ":50052"):
        with pytest.raises(ModelLoadError):
            backend.parse_rpc_servers(bad)


def test_a_build_without_rpc_says_so(info, tiny_pair):
    if info.rpc:
        pytest.skip("this build has the RPC backend")
    assert "RPC:         no: this build lacks the RPC backend" in render(
        {"fsd_local": "x", "backend": info.to_dict(), "models": {}}
    )
    with pytest.raises(ModelLoadError, match="no RPC backend; rebuild it with `native/build.sh PROFILE --rpc`"):
        Model(ModelOptions(tiny_pair[1], rpc_servers="127.0.0.1:50052"))


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_an_rpc_server_that_does_not_answer_is_an_error(info):
    if not info.rpc:
        pytest.skip(
            "this llama-cpp-python build lacks the RPC backend (doctor says so); "
            "rebuild with native/build.sh PROFILE --rpc to run this test"
        )
    # nothing listens there: ggml-rpc itself would abort the process, fsd-local must say so first
    with pytest.raises(ModelLoadError, match=r"RPC server 127\.0\.0\.1:\d+ did not answer"):
        backend.add_rpc_servers(f"127.0.0.1:{free_port()}")
    assert not backend.rpc_registered()


def _rpc_server_binary() -> str:
    """FSD_LOCAL_RPC_SERVER (a path), else ggml-rpc-server or rpc-server on PATH; skips when there is none."""
    path = os.environ.get("FSD_LOCAL_RPC_SERVER")
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            pytest.fail(f"FSD_LOCAL_RPC_SERVER={path} is not an executable file")
        return path
    server = shutil.which("ggml-rpc-server") or shutil.which("rpc-server")
    if not server:
        pytest.skip(
            "no ggml-rpc-server: build one with native/build.sh --rpc-server cpu, then put it on PATH "
            "or set FSD_LOCAL_RPC_SERVER=/path/to/ggml-rpc-server"
        )
    return server


# in a child process: RPC devices stay registered for the life of a process, and this server will be gone
RPC_CHILD = """
import sys
from fsd_local import Engine, ModelOptions
from fsd_local.llama.backend import detect
draft, target, endpoint = sys.argv[1:]
with Engine(target=target, draft=draft, n_ctx=512, n_threads=1, n_gpu_layers=0) as local:
    want = local.generate("the cat sat", mode="sd", max_tokens=24).token_ids
with Engine(target=ModelOptions(target, n_ctx=512, n_threads=1, rpc_servers=endpoint),
            draft=ModelOptions(draft, n_ctx=512, n_threads=1)) as remote:
    assert any(d.is_rpc for d in detect().devices), "no RPC device registered"
    got = remote.generate("the cat sat", mode="sd", max_tokens=24).token_ids
assert got == want, (got, want)
"""


def test_target_over_rpc_on_loopback(info, tiny_pair):
    if not info.rpc:
        pytest.skip(
            "this llama-cpp-python build lacks the RPC backend (doctor says so); "
            "rebuild with native/build.sh PROFILE --rpc to run this test"
        )
    server = _rpc_server_binary()
    port = free_port()
    proc = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 20
        while not _listening(port):
            assert time.time() < deadline and proc.poll() is None, "ggml-rpc-server did not start"
            time.sleep(0.2)
        child = subprocess.run(
            [sys.executable, "-c", RPC_CHILD, *tiny_pair, f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "FSD_LOCAL_VERBOSE": "1"},
        )  # llama.cpp's log on stderr
        assert child.returncode == 0, child.stderr[-4000:]
        # the target's layers really went to the server (not just equal tokens from a local run), the draft's not
        used = re.findall(rf"using device (RPC\d+) \(127\.0\.0\.1:{port}\)", child.stderr)
        assert len(used) == 1, child.stderr[-4000:]
        assert re.search(rf"layer +\d+ assigned to device {used[0]}\b", child.stderr), child.stderr[-4000:]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------- native/ scripts (dry runs only)
def _run(*args, ok=True):
    if not shutil.which("bash"):
        pytest.skip("bash is not available")
    r = subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_build_script_prints_the_pinned_rebuild_per_profile():
    out = _run("native/build.sh", "--dry-run", "cuda")
    assert "CMAKE_ARGS='-DGGML_CUDA=on'" in out
    assert (
        "pip install --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python -v "
        f"llama-cpp-python=={PIN}"
    ) in out
    out = _run("native/build.sh", "--dry-run", "--rpc", "--cuda-arch", "89", "cuda")
    assert "-DGGML_CUDA=on -DGGML_RPC=on -DCMAKE_CUDA_ARCHITECTURES=89" in out
    for profile, flag in (
        ("metal", "-DGGML_METAL=on"),
        ("vulkan", "-DGGML_VULKAN=on"),
        ("cpu", "-DGGML_NATIVE=on"),
        ("hip", "-DGGML_HIP=on"),
        ("sycl", "-DGGML_SYCL=on"),
    ):
        assert flag in _run("native/build.sh", "--dry-run", profile)
    out = _run("native/build.sh", "--dry-run", "--rpc-server", "--source", "/src/llama_cpp_python", "cpu")
    assert "cmake -S /src/llama_cpp_python/vendor/llama.cpp" in out and "--target ggml-rpc-server" in out
    out = _run("native/build.sh", "--dry-run", "--tool", "llama-speculative-simple", "--source", "/src/x", "cpu")
    assert "--target llama-speculative-simple" in out and "-DLLAMA_BUILD_EXAMPLES=on" in out
    out = _run("native/build.sh", "--dry-run", "--pack-source", "/tmp/x.tar.gz", "--source", "/src/llama_cpp_python")
    assert "tar -czf /tmp/x.tar.gz" in out and "vendor/llama.cpp/models" in out and "-C /src llama_cpp_python" in out
    out = _run("native/build.sh", "--dry-run", "opencl", ok=False)
    assert "unknown profile 'opencl': choose one of cpu-portable cpu cuda hip metal sycl vulkan" in out
    # the portable build: runtime CPU dispatch, and the backend modules kept for copying next to libllama
    out = _run("native/build.sh", "--dry-run", "cpu-portable")
    assert "-DGGML_NATIVE=off -DGGML_BACKEND_DL=on -DGGML_CPU_ALL_VARIANTS=on" in out
    assert "--config-settings=build-dir=" in out


def test_gpu_check_dry_run_shows_every_step_without_a_gpu():
    out = _run("native/gpu_check.sh", "--dry-run")
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=" in out and "-DLLAVA_BUILD=off" in out
    assert "FSD_REQUIRE_GPU=1" in out and "-m gpu tests/test_gpu.py" in out
    assert "fsd_local.cli bench --ngl -1 --draft-ngl -1 --modes fsd --taus 0.1,0.3" in out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to list mapped libraries")
def test_ggml_bindings_share_libllamas_copy_of_ggml():
    """One copy of each ggml library in the process: a second copy would be a second device registry
    (RPC servers or GPUs registered there are invisible to llama.cpp)."""
    import re

    import llama_cpp  # noqa: F401

    from fsd_local.llama import ggml as ggml_api

    ggml_api.lib().ggml_backend_dev_count()
    mapped = set(re.findall(r"/(libggml[\w.-]*\.so[\w.]*)", Path("/proc/self/maps").read_text()))
    stems = [m.split(".so")[0] for m in mapped]
    assert len(stems) == len(set(stems)), mapped
