"""Models whose cache cannot be truncated (recurrent / hybrid architectures), on a real tiny Mamba GGUF.

Speculative decoding rewinds both models to the accepted prefix after every rejection. llama.cpp keeps one
rolling state per sequence for recurrent models, so `llama_memory_seq_rm` on a partial range fails; fsd_local
refuses such models at load (CacheTruncationError) instead of failing mid-generation.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import llama_cpp as lc
import pytest

from fsd_local import CacheTruncationError, Engine
from fsd_local.llama.bindings import init_backend
from fsd_local.llama.model import Model
from support.tinymodels import write_tiny_mamba_gguf


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    return str(write_tiny_mamba_gguf(tmp_path_factory.mktemp("mamba") / "mamba.gguf"))


def _assert_refusal_message(message: str, path: str, role: str) -> None:
    assert f"{role} model {path}" in message
    assert "(mamba)" in message
    assert "cannot be rewound" in message
    assert "use a transformer model" in message


@pytest.mark.parametrize("role", ["target", "draft"])
def test_engine_refuses_a_recurrent_model(role, mamba, tiny_pair):
    draft, target = tiny_pair
    kwargs = {"target": mamba, "draft": draft} if role == "target" else {"target": target, "draft": mamba}
    with pytest.raises(CacheTruncationError) as info:
        Engine(**kwargs, n_ctx=128, n_threads=1)
    _assert_refusal_message(str(info.value), mamba, role)


def test_engine_refuses_a_recurrent_model_without_a_draft(mamba):
    # autoregressive mode rewinds too (prefix reuse across calls), so a lone recurrent target is refused as well
    with pytest.raises(CacheTruncationError, match="cannot be rewound"):
        Engine(target=mamba, n_ctx=128, n_threads=1)


def test_cli_reports_a_recurrent_model_in_one_line(mamba, tiny_pair):
    draft, _ = tiny_pair
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsd_local.cli",
            "generate",
            "hi",
            "--target",
            mamba,
            "--draft",
            draft,
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    # before it, stderr may hold the placement notice (e.g. "CPU-only build of llama-cpp-python ...")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert errors == lines[-1:], r.stderr
    _assert_refusal_message(errors[0], mamba, "target")


@pytest.fixture
def raw_mamba_context(mamba):
    """The Mamba model loaded through llama_cpp directly: fsd_local.model.Model refuses it before a context
    exists, so this is the only way (short of patching the refusal) to reach its memory."""
    init_backend()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(mamba.encode(), mp)
    assert model, "llama.cpp could not load the tiny Mamba model"
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 128, 1, 1, 1
    cp.n_batch = cp.n_ubatch = 32
    ctx = lc.llama_init_from_model(model, cp)
    assert ctx
    try:
        yield model, ctx
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def _decode(ctx, tokens) -> None:
    batch = lc.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        assert lc.llama_decode(ctx, batch) == 0
    finally:
        lc.llama_batch_free(batch)


def test_llama_cpp_cannot_drop_a_partial_range_of_a_recurrent_state(raw_mamba_context):
    """Why the load-time refusal exists: the runtime check in Model.truncate would fire on the first rejection."""
    model, ctx = raw_mamba_context
    assert lc.llama_model_is_recurrent(model)
    mem = lc.llama_get_memory(ctx)
    tokens = [1, 260, 261, 262, 263, 264]  # <s> + five words of the shared vocabulary
    _decode(ctx, tokens)
    assert lc.llama_memory_seq_pos_max(mem, 0) == len(tokens) - 1

    assert not lc.llama_memory_seq_rm(mem, 0, 3, -1)  # rewind to position 3: refused
    assert lc.llama_memory_seq_pos_max(mem, 0) == len(tokens) - 1  # and nothing was dropped

    # Model.truncate's runtime check against this real memory (unbound: Model() itself refuses to load it)
    state = SimpleNamespace(mem=mem, tokens=list(tokens), role="draft", path="mamba.gguf")
    with pytest.raises(
        CacheTruncationError,
        match=r"draft model mamba\.gguf: llama\.cpp refused to drop KV "
        r"positions >= 3",
    ):
        Model.truncate(state, 3)
    assert state.tokens == tokens  # the mirror still matches the cache

    assert lc.llama_memory_seq_rm(mem, 0, 0, -1)  # dropping everything is allowed
    assert lc.llama_memory_seq_pos_max(mem, 0) == -1


def test_a_transformer_cache_drops_partial_ranges(tiny_pair):
    """The control: the same rewind on the tiny llama model succeeds, through fsd_local's Model."""
    from fsd_local.llama.model import ModelOptions

    m = Model(ModelOptions(tiny_pair[1], n_ctx=128, n_threads=1, n_gpu_layers=0), "target")
    try:
        tokens = [1, 260, 261, 262, 263, 264]
        m.decode(tokens)
        m.truncate(3)
        assert m.tokens == tokens[:3]
        assert lc.llama_memory_seq_pos_max(m.mem, 0) == 2
    finally:
        m.close()
