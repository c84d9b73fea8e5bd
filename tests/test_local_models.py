"""Models already on disk (pairs/stores.py, local.py, names.py): stores laid out by the tests in the formats
Ollama, huggingface-hub, LM Studio and llama.cpp write, from tiny GGUF models that share a vocabulary (and one
that does not); what `fsd-local models --local` lists, the names --target/--draft accept, what can draft for what,
broken stores, and the header index."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsd_local.cli import cli
from fsd_local.errors import ModelLoadError
from fsd_local.pairs import stores
from fsd_local.pairs.header_index import HeaderIndex
from fsd_local.pairs.local import format_listing, list_local_models
from fsd_local.pairs.names import resolve
from support.localstores import hub_file, isolate, llamacpp_file, lmstudio_file, ollama_model, sha256
from support.tinymodels import write_tiny_gguf

SPLIT = "acme/Tiny-GGUF/split/tiny-split-00001-of-00003.gguf"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Five GGUF files: four of one vocabulary (292 tokens) in four sizes, one of another (36 tokens, smallest)."""
    d = tmp_path_factory.mktemp("family")
    (d / "split").mkdir()
    return {
        "other": write_tiny_gguf(d / "other-vocab.gguf", n_layer=1, n_embd=32, byte_tokens=False),
        "small": write_tiny_gguf(d / "tiny-small.gguf", n_layer=1, n_embd=32),
        "split": write_tiny_gguf(d / "split" / "tiny-split.gguf", n_layer=2, n_embd=48, split_max_tensors=8),
        "medium": write_tiny_gguf(d / "tiny-medium.gguf", n_layer=2, n_embd=64),
        "big": write_tiny_gguf(d / "tiny-big.gguf", n_layer=3, n_embd=96),
    }


@pytest.fixture
def layout(tmp_path, monkeypatch, family):
    """One model or more in each store, in its app's own format."""
    s = isolate(monkeypatch, tmp_path)
    ollama_model(s["ollama"], "tiny:big", family["big"], projector=family["other"])  # the projector is ignored
    ollama_model(s["ollama"], "tiny:small", family["small"])
    hub_file(s["huggingface"], "acme/Tiny-GGUF", "tiny-medium.gguf", family["medium"])
    for part in sorted(family["split"].parent.iterdir()):
        hub_file(s["huggingface"], "acme/Tiny-GGUF", f"split/{part.name}", part)
    lmstudio_file(s["lmstudio"], "lmstudio-community", "Other-GGUF", family["other"])
    llamacpp_file(s["llama.cpp"], "acme/Tiny-GGUF", "tiny-small.gguf", family["small"])
    return s


def listing(tmp_path):
    return list_local_models(index=HeaderIndex(tmp_path / "index.json"))


def test_every_store_is_listed_with_architecture_size_quantisation_and_drafts(layout, family, tmp_path):
    index = HeaderIndex(tmp_path / "index.json")
    found = list_local_models(index=index)
    assert index.read_now == 5  # 6 models, one of them a hard link of another: its header is read once
    by_name = {m.name: m for m in found.models}
    assert list(by_name) == [
        "tiny:big",
        "tiny:small",
        "acme/Tiny-GGUF/split/tiny-split-00001-of-00003.gguf",  # a split model once, by its first part
        "acme/Tiny-GGUF/tiny-medium.gguf",
        "lmstudio-community/Other-GGUF/other-vocab.gguf",
        "acme/Tiny-GGUF/tiny-small.gguf",  # llama.cpp's acme_Tiny-GGUF_tiny-small.gguf, named by its manifest
    ]
    assert found.unusable == []
    assert [m.store for m in by_name.values()] == [
        "ollama",
        "ollama",
        "huggingface",
        "huggingface",
        "lmstudio",
        "llama.cpp",
    ]
    big = by_name["tiny:big"]
    assert big.path == str(layout["ollama"] / "blobs" / f"sha256-{sha256(family['big'])}")
    assert (big.architecture, big.quantisation, big.n_vocab, big.n_layer) == ("llama", "f32", 292, 3)
    assert big.size_bytes == os.path.getsize(family["big"])
    split_parts = sorted(family["split"].parent.iterdir())
    assert by_name[SPLIT].size_bytes == sum(p.stat().st_size for p in split_parts) and len(split_parts) == 3
    assert os.path.islink(by_name["acme/Tiny-GGUF/tiny-medium.gguf"].path)  # the snapshot link, as the hub made it
    assert by_name["lmstudio-community/Other-GGUF/other-vocab.gguf"].n_vocab == 36
    # which can draft for which: the same vocabulary, smaller, smallest first (a tie in store order)
    assert big.drafts == ["tiny:small", "acme/Tiny-GGUF/tiny-small.gguf", SPLIT, "acme/Tiny-GGUF/tiny-medium.gguf"]
    assert by_name["acme/Tiny-GGUF/tiny-medium.gguf"].drafts == ["tiny:small", "acme/Tiny-GGUF/tiny-small.gguf", SPLIT]
    assert by_name["tiny:small"].drafts == [] and by_name["lmstudio-community/Other-GGUF/other-vocab.gguf"].drafts == []
    text = format_listing(found)
    assert f"  Ollama              {layout['ollama']}  2 models" in text
    assert f"  LM Studio           {layout['lmstudio']}  1 model\n" in text
    assert "tiny:big  [Ollama]  llama, 1 MB, f32, vocab 292 SPM (sentencepiece)" in text
    assert f"  drafts: tiny:small, acme/Tiny-GGUF/tiny-small.gguf, {SPLIT}, acme/Tiny-GGUF/tiny-medium.gguf" in text


def test_the_hub_cache_layout_is_the_one_huggingface_hub_reads(layout):
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache("acme/Tiny-GGUF", "tiny-medium.gguf", cache_dir=layout["huggingface"])
    assert found == resolve("acme/Tiny-GGUF/tiny-medium.gguf", "target")


def test_names_accepted_for_target_and_draft(layout, family, tmp_path):
    found = listing(tmp_path)
    blob = str(layout["ollama"] / "blobs" / f"sha256-{sha256(family['big'])}")
    for name in ("tiny:big", "library/tiny:big", "registry.ollama.ai/library/tiny:big", "TINY:BIG"):
        assert resolve(name, "target", found) == blob, name
    medium = resolve("acme/Tiny-GGUF/tiny-medium.gguf", "target", found)
    assert Path(medium).read_bytes() == family["medium"].read_bytes()
    assert resolve("acme/Tiny-GGUF:medium", "target", found) == medium  # llama.cpp's -hf org/name:QUANT form
    assert resolve("tiny-medium.gguf", "target", found) == medium  # a file name alone, when one model has it
    assert resolve(str(family["big"]), "target", found) == str(family["big"])  # a path stays a path
    assert resolve("/no/such/model.gguf", "target", found) == "/no/such/model.gguf"  # the loader says it is missing
    with pytest.raises(ModelLoadError) as ambiguous:
        resolve("acme/Tiny-GGUF", "target", found)
    assert "names 3 different models" in str(ambiguous.value) and SPLIT in str(ambiguous.value)
    with pytest.raises(ModelLoadError) as unknown:
        resolve("qwen2.5:7b", "target", found)
    message = str(unknown.value)
    assert message.startswith("target 'qwen2.5:7b' is not a file, and no model of that name is on this disk")
    for root in found.roots:
        assert f"{root.label} {root.path} (" in message
    assert "llama.cpp cache" in message and "fsd-local models --local" in message


def test_identical_copies_in_two_stores_are_one_model(tmp_path, monkeypatch, family):
    s = isolate(monkeypatch, tmp_path)
    hub_file(s["huggingface"], "acme/Tiny-GGUF", "tiny-small.gguf", family["small"])
    copy = lmstudio_file(s["lmstudio"], "acme", "Tiny-GGUF", family["small"])
    found = listing(tmp_path)
    assert [m.also_in for m in found.models] == [["LM Studio"], ["Hugging Face cache"]]
    assert resolve("acme/Tiny-GGUF/tiny-small.gguf", "draft", found).startswith(str(s["huggingface"]))
    assert "the same name is in LM Studio: give the path to choose this one" in format_listing(found)
    assert str(copy) in format_listing(found)


def test_broken_stores_are_listed_with_the_reason(layout, family, tmp_path):
    s = layout
    gone = ollama_model(s["ollama"], "gone:latest", family["medium"])
    digest = sha256(family["medium"])
    (s["ollama"] / "blobs" / f"sha256-{digest}").unlink()
    text_file = tmp_path / "README.txt"
    text_file.write_text("not a model at all")
    ollama_model(s["ollama"], "notgguf:latest", text_file)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(family["medium"].read_bytes()[:200_000])
    ollama_model(s["ollama"], "cut:latest", cut)
    junk = s["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "junk" / "latest"
    junk.parent.mkdir(parents=True)
    junk.write_text("{not json")
    link = hub_file(s["huggingface"], "acme/Broken-GGUF", "broken.gguf", family["small"])
    os.unlink(os.path.realpath(link))  # the blob is gone, the snapshot link stays
    os.symlink("loop", s["lmstudio"] / "loop")  # a folder that cannot be read: a link to itself
    dup = lmstudio_file(s["lmstudio"], "acme", "Tiny-GGUF", family["big"], filename="tiny-medium.gguf")

    found = listing(tmp_path)
    reasons = {m.name: m.problem for m in found.unusable}
    assert reasons["gone:latest"] == (
        f"the manifest names the blob sha256-{digest}, which is missing from {s['ollama'] / 'blobs'} "
        "(`ollama pull gone:latest` again)"
    )
    assert "is not a GGUF file (starts with b'not '" in reasons["notgguf:latest"]
    assert f"is truncated: 200000 bytes of the {family['medium'].stat().st_size} its header" in reasons["cut:latest"]
    assert reasons["junk:latest"].startswith(f"manifest {junk}: cannot be read")
    assert reasons["acme/Broken-GGUF/broken.gguf"] == f"{link} links to a missing file (an interrupted download?)"
    assert reasons["loop"].startswith(f"the folder {s['lmstudio'] / 'loop'} cannot be read")
    assert gone.exists()
    # two stores, one name, two different files: both listed, each saying so; the name alone is refused
    same = [m for m in found.models if m.name == "acme/Tiny-GGUF/tiny-medium.gguf"]
    assert [(m.store, m.also_in) for m in same] == [
        ("huggingface", ["LM Studio"]),
        ("lmstudio", ["Hugging Face cache"]),
    ]
    big = next(m for m in found.models if m.name == "tiny:big")
    assert same[0].path in big.drafts and "acme/Tiny-GGUF/tiny-medium.gguf" not in big.drafts  # the path says which
    with pytest.raises(ModelLoadError, match=f"names 2 different models: .*{dup}"):
        resolve("acme/Tiny-GGUF/tiny-medium.gguf", "target", found)
    with pytest.raises(ModelLoadError, match=r"target gone:latest \[Ollama\] cannot be used: the manifest names"):
        resolve("gone", "target", found)
    # and on the command line: every reason, exit 0, no traceback
    result = CliRunner().invoke(cli, ["models", "--local"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "Not usable (6):" in result.output and "`ollama pull gone:latest` again" in result.output
    data = json.loads(CliRunner().invoke(cli, ["models", "--local", "--json"]).output)
    assert {m["name"] for m in data["unusable"]} == set(reasons) and len(data["models"]) == 7
    assert {r["store"]: r["models"] for r in data["stores"]} == {
        "ollama": 2,
        "huggingface": 2,
        "lmstudio": 2,
        "llama.cpp": 1,
    }


def test_the_default_locations(tmp_path, monkeypatch, family):
    """No environment variables: ~/.ollama/models, ~/.cache/huggingface/hub (or HF_HOME/hub), LM Studio's home
    pointer and its settings' downloadsFolder, ~/.cache/llama.cpp."""
    for var in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "LLAMA_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv(stores.LMSTUDIO_ENV)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    ollama_model(home / ".ollama" / "models", "tiny:small", family["small"])
    hub_file(home / ".cache" / "huggingface" / "hub", "acme/Tiny-GGUF", "tiny-medium.gguf", family["medium"])
    lms_home = tmp_path / "lm-studio-home"
    lms_home.mkdir()
    (home / ".lmstudio-home-pointer").write_text(f"{lms_home}\n")
    lmstudio_file(lms_home / "models", "acme", "Tiny-GGUF", family["big"])
    llamacpp_file(home / ".cache" / "llama.cpp", "acme/Tiny-GGUF", "tiny-small.gguf", family["small"])
    assert [(r.store, r.path) for r in stores.roots() if r.store != "ollama" or "share" not in r.path] == [
        ("ollama", str(home / ".ollama" / "models")),
        ("huggingface", str(home / ".cache" / "huggingface" / "hub")),
        ("lmstudio", str(lms_home / "models")),
        ("llama.cpp", str(home / ".cache" / "llama.cpp")),
    ]
    names = [m.name for m in listing(tmp_path).models]
    assert names == [
        "tiny:small",
        "acme/Tiny-GGUF/tiny-medium.gguf",
        "acme/Tiny-GGUF/tiny-big.gguf",
        "acme/Tiny-GGUF/tiny-small.gguf",
    ]
    elsewhere = tmp_path / "downloads"
    (lms_home / "settings.json").write_text(json.dumps({"downloadsFolder": str(elsewhere)}))
    lmstudio_file(elsewhere, "acme", "Elsewhere-GGUF", family["medium"])
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    hub_file(tmp_path / "hf-home" / "hub", "acme/Home-GGUF", "tiny-big.gguf", family["big"])
    names = [m.name for m in listing(tmp_path).models]
    assert names[1:3] == ["acme/Home-GGUF/tiny-big.gguf", "acme/Elsewhere-GGUF/tiny-medium.gguf"]


def test_headers_are_read_once_and_the_index_survives_damage(tmp_path, monkeypatch, family):
    s = isolate(monkeypatch, tmp_path)
    for i in range(36):  # a few dozen files, copies (not links: one file's time is changed below)
        dst = s["lmstudio"] / f"pub{i // 6}" / f"repo{i % 6}" / f"model-{i}.gguf"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(family["small"] if i % 2 else family["medium"], dst)
    index_path = tmp_path / "index.json"
    first = HeaderIndex(index_path)
    cold = list_local_models(index=first)
    assert first.read_now == 36 and len(cold.models) == 36
    again = HeaderIndex(index_path)
    warm = list_local_models(index=again)
    # no header read again: the listing's speed once read (docs/measurements/local-models.md) is not timed here
    assert again.read_now == 0 and [m.to_dict() for m in warm.models] == [m.to_dict() for m in cold.models]
    touched = s["lmstudio"] / "pub0" / "repo0" / "model-0.gguf"
    os.utime(touched, ns=(1, 1))
    third = HeaderIndex(index_path)
    list_local_models(index=third)
    assert third.read_now == 1  # only the changed file
    data = json.loads(index_path.read_text())
    entry = data["files"][str(touched)]
    entry["summary"] = {"architecture": 3, "vocab": "?"}  # well-formed JSON, not what fsd-local writes
    index_path.write_text(json.dumps(data))
    edited = HeaderIndex(index_path)
    assert len(list_local_models(index=edited).models) == 36 and edited.read_now == 1
    index_path.write_text('{"version": 1, "files": {"x": 3')  # cut short, as by a crash
    broken = HeaderIndex(index_path)
    assert len(list_local_models(index=broken).models) == 36 and broken.read_now == 36
    assert json.loads(index_path.read_text())["version"] == 1  # rewritten whole


def test_the_header_check_agrees_with_the_loaded_check_on_real_models(tmp_path, monkeypatch, real_pair, gemma_path):
    """The demo pair (SmolLM2's BPE vocabulary, 49,152 tokens) in Ollama's store and Gemma 3 (SPM, 262,144) in the
    hub cache: the header check answers what llama.cpp's loaded vocabularies answer."""
    from fsd_local.llama.model import Model, ModelOptions
    from fsd_local.llama.vocab import compatibility_problem
    from fsd_local.pairs.local import draft_problem

    s = isolate(monkeypatch, tmp_path)
    draft, target = real_pair
    ollama_model(s["ollama"], "smollm2:135m", draft)
    ollama_model(s["ollama"], "smollm2:upscaled", target)
    hub_file(s["huggingface"], "ggml-org/gemma-3-270m-GGUF", "gemma-3-270m-Q4_K_M.gguf", gemma_path)
    by_name = {m.name: m for m in listing(tmp_path).models}
    smol, big, gemma = (
        by_name["smollm2:135m"],
        by_name["smollm2:upscaled"],
        by_name["ggml-org/gemma-3-270m-GGUF/gemma-3-270m-Q4_K_M.gguf"],
    )
    assert (smol.n_vocab, smol.tokenizer, gemma.n_vocab, gemma.quantisation) == (49152, "BPE", 262144, "Q4_K_M")
    assert big.drafts == ["smollm2:135m"] and gemma.drafts == [] and smol.drafts == []
    loaded = {
        k: Model(ModelOptions(p, n_ctx=64, n_threads=1)) for k, p in (("d", draft), ("t", target), ("g", gemma_path))
    }
    try:
        assert compatibility_problem(loaded["d"], loaded["t"]) is None and draft_problem(smol, big) is None
        assert (
            compatibility_problem(loaded["d"], loaded["g"])
            == draft_problem(smol, gemma)
            == "tokenizer types differ: draft uses BPE, target uses SPM (sentencepiece)"
        )
    finally:
        for m in loaded.values():
            m.close()


def test_padding_at_the_end_is_allowed_and_a_changed_token_is_not(tmp_path):
    """Like Qwen2.5 0.5B and 7B (152064 vs 151936 entries): a longer list with the same prefix is the same
    vocabulary; one token changed in the middle is not, with the loaded check's answer."""
    from fsd_local.llama import gguf_info
    from fsd_local.llama.vocab import MAX_SIZE_DIFFERENCE, header_problem
    from support.tinymodels import WORDS

    def vocab(name, words):
        path = str(write_tiny_gguf(tmp_path / name, n_layer=1, n_embd=32, words=words))
        return gguf_info.read(path, vocab=True).meta["vocab"]

    base = vocab("base.gguf", WORDS)
    padded = vocab("padded.gguf", WORDS + [f"[PAD{i}]" for i in range(MAX_SIZE_DIFFERENCE)])
    too_long = vocab("long.gguf", WORDS + [f"[PAD{i}]" for i in range(MAX_SIZE_DIFFERENCE + 1)])
    changed = vocab("changed.gguf", [w if w != "m" else "µ" for w in WORDS])
    assert (base.n_vocab, padded.n_vocab) == (292, 292 + MAX_SIZE_DIFFERENCE)
    assert header_problem(base, padded) is None and header_problem(padded, base) is None
    assert (
        header_problem(base, too_long)
        == "vocabulary sizes differ by 129 (draft 292, target 421); at most 128 is allowed"
    )
    assert header_problem(base, changed) == "the token lists differ within their first 292 tokens"
    from fsd_local.llama.model import Model, ModelOptions
    from fsd_local.llama.vocab import compatibility_problem

    loaded = [Model(ModelOptions(str(tmp_path / n), n_ctx=64, n_threads=1)) for n in ("base.gguf", "padded.gguf")]
    loaded.append(Model(ModelOptions(str(tmp_path / "changed.gguf"), n_ctx=64, n_threads=1)))
    try:  # what loading the pair says
        assert compatibility_problem(loaded[0], loaded[1]) is None
        assert compatibility_problem(loaded[0], loaded[2]) == "token 272 differs: draft b'm', target b'\\xc2\\xb5'"
    finally:
        for m in loaded:
            m.close()
