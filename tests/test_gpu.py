"""The SmolLM2 demo pair fully on the GPU: it really is there, it says what the CPU says, and the KV contract
holds. Skipped, with the reason, on a build or machine without a GPU; native/gpu_check.sh sets
FSD_REQUIRE_GPU=1 so that a missing GPU fails there instead of skipping."""

import os

import numpy as np
import pytest

from fsd_local import Engine
from fsd_local.llama.backend import detect
from fsd_local.llama.gguf_info import read
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.llama.placement import resolve

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
N_TOKENS = 32
# GPU kernels sum in another order than the CPU's, so a near-tie between two tokens can flip late in a greedy
# run; the first tokens must agree. (tests/test_real_pair.py asserts exact equality on the CPU, on F16.)
MIN_COMMON_PREFIX = 16
# the KV contract, in probabilities: one wrong cache entry moves them by far more than rounding does
KV_MAX_PROB_DIFF = 0.02


@pytest.fixture(scope="module")
def gpu():
    info = detect()
    if not info.gpus:
        kinds = [b for b in info.backends if b not in ("CPU", "BLAS", "RPC")]
        reason = f"no GPU device: this llama-cpp-python build has backends {', '.join(info.backends)}" + (
            "" if kinds else " (CPU-only; build one with native/build.sh cuda or native/gpu_check.sh)"
        )
        if os.environ.get("FSD_REQUIRE_GPU"):
            pytest.fail(reason)
        pytest.skip(reason)
    return info


def _device_used(gpu_before) -> int:
    after = {d.name: d.free for d in detect().gpus}
    return sum(before.free - after.get(before.name, before.free) for before in gpu_before)


@pytest.fixture(scope="module")
def gpu_engine(gpu, real_pair):
    draft, target = real_pair
    before = detect().gpus
    eng = Engine(
        target=ModelOptions(target, n_ctx=1024, n_gpu_layers=-1),
        draft=ModelOptions(draft, n_ctx=1024, n_gpu_layers=-1, split_mode="none"),
    )
    eng.device_bytes = _device_used(before)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def gpu_engine_f16(gpu, real_pair_f16):
    draft, target = real_pair_f16
    with Engine(
        target=ModelOptions(target, n_ctx=1024, n_gpu_layers=-1),
        draft=ModelOptions(draft, n_ctx=1024, n_gpu_layers=-1, split_mode="none"),
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def cpu_engine_f16(real_pair_f16):
    draft, target = real_pair_f16
    with Engine(
        target=ModelOptions(target, n_ctx=1024, n_gpu_layers=0), draft=ModelOptions(draft, n_ctx=1024, n_gpu_layers=0)
    ) as eng:
        yield eng


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_auto_placement_puts_the_whole_demo_pair_on_the_gpu(gpu, real_pair):
    draft, target = real_pair
    t, d, summary = resolve(ModelOptions(target), ModelOptions(draft), target_auto=True, draft_auto=True)
    assert (t.n_gpu_layers, d.n_gpu_layers) == (-1, -1), summary
    assert "all 44 layers" in summary and "all 30 layers" in summary


def test_both_models_are_fully_offloaded(gpu_engine, real_pair):
    # the weights of every block and the output head left the CPU: device memory dropped by at least that
    weights = sum(sum(i.layer_bytes) + i.output_bytes for i in map(read, real_pair))
    assert gpu_engine.device_bytes >= 0.9 * weights, (gpu_engine.device_bytes, weights)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_gpu_greedy_tokens_match_the_cpu_on_f16(gpu_engine_f16, cpu_engine_f16, prompt):
    # F16 weights: no per-batch-shape activation quantisation on either side (docs/measurements/numerics.md)
    cpu = cpu_engine_f16.generate(prompt, mode="ar", max_tokens=N_TOKENS).token_ids
    ar = gpu_engine_f16.generate(prompt, mode="ar", max_tokens=N_TOKENS).token_ids
    sd = gpu_engine_f16.generate(prompt, mode="sd", max_tokens=N_TOKENS)
    print(
        f"\n{prompt!r}: GPU ar agrees with CPU ar for {_common_prefix(ar, cpu)}/{N_TOKENS} tokens, "
        f"GPU sd with GPU ar for {_common_prefix(sd.token_ids, ar)}/{N_TOKENS}"
    )
    assert _common_prefix(ar, cpu) >= MIN_COMMON_PREFIX, (ar, cpu)
    assert _common_prefix(sd.token_ids, ar) >= MIN_COMMON_PREFIX, (sd.token_ids, ar)
    assert sd.stats["acceptance_rate"] > 0.2


def _probs(logits):
    z = np.exp(logits - logits.max())
    return z / z.sum()


def test_kv_caches_equal_a_fresh_gpu_evaluation_after_many_rounds(gpu_engine, real_pair):
    seq = gpu_engine.tokenize("Once upon a time, in a small village,")
    for _ in range(2):  # calls that extend each other, with fuzzy rescues and rejections in between
        out = gpu_engine.generate(seq, mode="fsd", tau=0.2, max_tokens=40)
        assert out.stats["drafted"] > out.stats["accepted_sd"] + out.stats["accepted_fuzzy"], "no rejection"
        seq = seq + out.token_ids + gpu_engine.tokenize(" and", add_special=False)
    for model, path in ((gpu_engine.target, real_pair[1]), (gpu_engine.draft, real_pair[0])):
        assert model.tokens == seq[: len(model.tokens)], "the cache is not a prefix of the accepted text"
        model.decode(seq[len(model.tokens) :], "last")
        got = _probs(model.logits(1)[0])
        fresh = Model(ModelOptions(path, n_ctx=1024, n_gpu_layers=-1))
        try:
            fresh.decode(seq, "last")
            want = _probs(fresh.logits(1)[0])
        finally:
            fresh.close()
        assert np.abs(got - want).max() < KV_MAX_PROB_DIFF
        assert got.argmax() == want.argmax()
