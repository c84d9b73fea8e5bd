"""The cost-realistic demo target (pairs/wide.py): a model padded with zeros to a wider shape computes the same
function (docs/models.md, "The demo pairs"). Checked on tiny models the tests write, through llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from fsd_local.errors import ModelLoadError
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.pairs.wide import estimate_bytes, widen
from support.tinymodels import write_tiny_gguf

TEXT = "the cat sat on the mat, and the dog ran far away!"


def _logits(path, text=TEXT):
    m = Model(ModelOptions(str(path), n_ctx=256, n_threads=1))
    try:
        toks = m.tokenize(text)
        m.decode(toks, "from:0")
        m.synchronize()
        return np.array(m.logits(len(toks)))
    finally:
        m.close()


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    # 4 heads of 16 dims, 2 KV heads (GQA groups of 2): padding must keep each head's KV head
    path = tmp_path_factory.mktemp("wide") / "narrow.gguf"
    write_tiny_gguf(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_layer=3, logit_scale=4.0)
    return path


def test_padded_model_computes_the_narrow_function(narrow, tmp_path):
    base = _logits(narrow)
    wide = widen(narrow, tmp_path / "wide.gguf", blocks=[0, 1, 2], width=192, ffn=320, quantize=None)
    m = Model(ModelOptions(str(wide), n_ctx=64, n_threads=1))
    assert (m.meta("llama.embedding_length"), m.meta("llama.attention.head_count")) == ("192", "12")
    m.close()
    got = _logits(wide)
    assert np.abs(got - base).max() < 1e-3 * max(1.0, np.abs(base).max())
    assert (got.argmax(1) == base.argmax(1)).all()
    # repeated blocks are the narrow model with those blocks repeated, widened
    rep = widen(narrow, tmp_path / "rep.gguf", blocks=[0, 1, 1, 2], width=96, ffn=96, quantize=None)
    rep_narrow = widen(narrow, tmp_path / "rep_narrow.gguf", blocks=[0, 1, 1, 2], width=64, ffn=96, quantize=None)
    a, b = _logits(rep), _logits(rep_narrow)
    assert np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(b).max())
    assert np.abs(b - base).max() > 1e-2  # and repeating a block does change the function


def test_q8_0_through_llama_cpps_quantiser(narrow, tmp_path):
    base = _logits(narrow)
    est = estimate_bytes(narrow, [0, 1, 2], 128, 192)
    wide = widen(narrow, tmp_path / "wide-q8.gguf", blocks=[0, 1, 2], width=128, ffn=192, quantize="q8_0")
    size = wide.stat().st_size
    assert 0.8 * est < size < 1.2 * est + 2**20, (est, size)
    got = _logits(wide)
    scale = np.abs(base).max()
    assert np.abs(got - base).max() < 0.05 * scale  # Q8_0 rounding only
    assert (got.argmax(1) == base.argmax(1)).mean() >= 0.9
    assert not list(tmp_path.glob("*.partial"))  # temporary files are gone


def test_bad_shapes_are_refused(narrow, tmp_path):
    with pytest.raises(ModelLoadError, match="head dim"):
        widen(narrow, tmp_path / "x.gguf", blocks=[0], width=100, ffn=192, quantize=None)
    with pytest.raises(ModelLoadError, match="no blocks"):
        widen(narrow, tmp_path / "x.gguf", blocks=[0, 7], width=128, ffn=192, quantize=None)
    assert not list(tmp_path.iterdir())
