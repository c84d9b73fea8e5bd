"""models.toml validation, cache lookup and `pull` against a hub on 127.0.0.1 (no network needed)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from fsd_local.errors import DownloadError, ModelLoadError, RegistryError
from fsd_local.pairs.registry import (
    format_pairs,
    get_pair,
    load_registry,
    local_pair_paths,
    parse_registry,
    pull,
    unreachable,
)
from support.loopback_hub import COMMIT, LoopbackHub, closed_port, toml_for

ROOT = Path(__file__).resolve().parent.parent
SHA_A = "a" * 64


# ------------------------------------------------------------------ the packaged file
def test_packaged_models_toml_loads_and_root_file_is_the_same():
    registry = load_registry()
    assert "qwen2.5-0.5b-7b" in registry  # the pair the demo note tells people to pull
    assert len(registry) >= 8
    for pair in registry.values():
        assert pair.tau["js"] > 0 and pair.licence and pair.description
        for _, f in pair.files():
            assert f.file.endswith(".gguf") and "/" in f.repo and f.size_mb > 0
    packaged = ROOT / "fsd_local" / "data" / "models.toml"
    assert (ROOT / "models.toml").read_bytes() == packaged.read_bytes()


def test_known_hashes_are_pinned_to_a_revision():
    pair = get_pair("qwen2.5-0.5b-7b")
    assert pair.draft.sha256 == "6eb923e7d26e9cea28811e1a8e852009b21242fb157b26149d3b188f3a8c8653"
    assert pair.draft.sha256_revision == "b26a58a"
    assert pair.target.sha256_revision == "f4b6063"


def test_unknown_pair_suggests_the_closest_name():
    with pytest.raises(RegistryError, match=r"unknown pair 'qwen2.5-0.5b-8b' \(did you mean 'qwen2.5-0.5b-7b'\?\)"):
        get_pair("qwen2.5-0.5b-8b")


def test_registry_file_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "mine.toml"
    path.write_text(toml_for())
    monkeypatch.setenv("FSD_LOCAL_MODELS", str(path))
    assert list(load_registry()) == ["tiny"]
    monkeypatch.setenv("FSD_LOCAL_MODELS", str(tmp_path / "missing.toml"))
    with pytest.raises(RegistryError, match="FSD_LOCAL_MODELS=.*missing.toml: cannot read it"):
        load_registry()


# ------------------------------------------------------------------ validation
BROKEN = [
    ('file = "target.gguf"\n', "", r"pair 'tiny' target: missing key 'file'"),
    ("size_mb = 0.1", 'size_mb = "big"', r"pair 'tiny' draft: size_mb must be a number, got 'big'"),
    ("size_mb = 0.1", "size_mb = true", r"pair 'tiny' draft: size_mb must be a number"),
    ("size_mb = 0.1", "size_mb = 0", r"pair 'tiny' draft: size_mb must be > 0"),
    (f'sha256 = "{SHA_A}"', 'sha256 = "abc123"', r"pair 'tiny' draft: sha256 must be 64 lowercase hex digits"),
    (f'sha256 = "{SHA_A}"', f'sha256 = "{SHA_A.upper()}"', r"sha256 must be 64 lowercase hex digits"),
    ('sha256_revision = "0123456"\n', "", r"pair 'tiny' draft: sha256 and sha256_revision go together"),
    ('licence = "test"', 'lisence = "test"', r"pair 'tiny': unknown key 'lisence'"),
    ('repo = "me/tiny"', 'repo = "tiny"', r"pair 'tiny' draft: repo must look like 'owner/name'"),
    ('file = "draft.gguf"', 'file = "../draft.gguf"', r"pair 'tiny' draft: file must be a plain \*.gguf file name"),
    ('file = "draft.gguf"', 'file = "draft.bin"', r"pair 'tiny' draft: file must be a plain \*.gguf"),
    ("js = 0.2", "jsd = 0.2", r"\[tau\]: 'jsd' is not a divergence"),
    ("js = 0.2", "js = -1", r"\[tau\]: tau for js must be a number >= 0"),
    ("[pairs.tiny]", "[pairs.tiny\n", r"is not valid TOML"),
    ('description = "tiny pair"', "description = 3", r"pair 'tiny': description must be a string, got 3"),
]


@pytest.mark.parametrize("old, new, message", BROKEN)
def test_broken_registry_names_the_pair_and_the_field(old, new, message):
    good = toml_for(draft_sha=SHA_A)
    assert old in good
    broken = good.replace(old, new, 1)
    with pytest.raises(RegistryError, match=message):
        parse_registry(broken, "mine.toml")


def test_good_registry_merges_default_and_pair_tau():
    text = toml_for(draft_sha=SHA_A).replace('licence = "test"', 'licence = "test"\ntau = { kl = 0.5 }')
    pair = parse_registry(text)["tiny"]
    assert pair.tau == {"js": 0.2, "kl": 0.5}
    assert pair.draft.sha256 == SHA_A and pair.target.sha256 is None


def test_registry_without_pairs_is_refused():
    with pytest.raises(RegistryError, match="no \\[pairs"):
        parse_registry("[tau]\njs = 0.1\n")


# ------------------------------------------------------------------ the local cache
def populate_cache(cache: Path, repo: str, files: dict[str, bytes]) -> None:
    """The layout huggingface-hub writes: blobs by checksum, snapshots/<commit>/ links, refs/main."""
    base = cache / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(COMMIT)
    (base / "blobs").mkdir()
    snap = base / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(blob, snap / name)


def test_local_pair_paths_target_first(tmp_path):
    registry = parse_registry(toml_for())
    with pytest.raises(ModelLoadError, match=r"pair 'tiny' is not downloaded yet .*run `fsd-local pull tiny`"):
        local_pair_paths("tiny", cache_dir=tmp_path, registry=registry)
    populate_cache(tmp_path, "me/tiny", {"draft.gguf": b"GGUF draft", "target.gguf": b"GGUF target"})
    target, draft = local_pair_paths("tiny", cache_dir=tmp_path, registry=registry)
    assert Path(target).read_bytes() == b"GGUF target" and Path(draft).read_bytes() == b"GGUF draft"


def test_listing_shows_which_files_are_present(tmp_path):
    registry = parse_registry(toml_for())
    assert "tiny  [not downloaded]" in format_pairs(registry, cache_dir=tmp_path)
    populate_cache(tmp_path, "me/tiny", {"draft.gguf": b"GGUF draft"})
    listing = format_pairs(registry, cache_dir=tmp_path)
    assert "tiny  [1 of 2 files downloaded]" in listing
    assert "draft   me/tiny / draft.gguf  0 MB  present" in listing
    assert "target  me/tiny / target.gguf  0 MB  missing" in listing
    assert "tau     js 0.2" in listing


# ------------------------------------------------------------------ pull
@pytest.fixture
def online(monkeypatch):
    """The tests talk to 127.0.0.1 even where the environment sets HF_HUB_OFFLINE for everything else."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(tiny_pair):
    with LoopbackHub() as h:
        h.add("me/tiny", "draft.gguf", tiny_pair[0])
        h.add("me/tiny", "target.gguf", tiny_pair[1])
        yield h


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_pull_downloads_verifies_and_then_works_without_the_hub(online, hub, tiny_pair, tmp_path):
    registry = parse_registry(toml_for(draft_sha=sha(tiny_pair[0])))
    said = []
    target, draft = pull(
        "tiny", cache_dir=tmp_path, endpoint=hub.url, offline=False, registry=registry, say=said.append
    )
    assert sha(target) == sha(tiny_pair[1]) and sha(draft) == sha(tiny_pair[0])
    assert "draft: sha256 matches models.toml (revision 0123456)" in said
    assert "target: sha256 matches the hub's checksum" in said
    assert local_pair_paths("tiny", cache_dir=tmp_path, registry=registry) == (target, draft)
    # a second pull reuses the cache without asking the hub (it would work with the network gone)
    n = len(hub.requests)
    said.clear()
    assert pull(
        "tiny", cache_dir=tmp_path, endpoint="http://127.0.0.1:9", offline=False, registry=registry, say=said.append
    ) == (target, draft)
    assert len(hub.requests) == n and "target: me/tiny/target.gguf already in the cache" in said


def test_pull_accepts_a_reuploaded_file_that_matches_the_hub(online, hub, tmp_path):
    registry = parse_registry(toml_for(draft_sha=SHA_A))  # models.toml's hash is for an older upload
    said = []
    pull("tiny", cache_dir=tmp_path, endpoint=hub.url, offline=False, registry=registry, say=said.append)
    assert any(
        "matches the hub's checksum; it differs from models.toml's (revision 0123456): the file was "
        "re-uploaded since" in s
        for s in said
    )


def test_pull_removes_a_download_that_fails_its_checksum(online, hub, tmp_path):
    hub.etags["me/tiny/target.gguf"] = SHA_A  # the bytes served are not what the hub announces
    registry = parse_registry(toml_for())
    with pytest.raises(
        DownloadError,
        match=r"me/tiny/target.gguf: sha256 [0-9a-f]{64} does not match the "
        r"hub's checksum a{64}; the corrupt copy was removed",
    ):
        pull("tiny", cache_dir=tmp_path, endpoint=hub.url, offline=False, registry=registry, say=lambda m: None)
    assert not list(tmp_path.rglob(SHA_A)) and not list(tmp_path.rglob("target.gguf"))


def test_pull_names_a_file_missing_upstream(online, hub, tmp_path):
    registry = parse_registry(toml_for().replace('file = "target.gguf"', 'file = "gone.gguf"'))
    with pytest.raises(DownloadError, match="gone.gguf is no longer in me/tiny"):
        pull("tiny", cache_dir=tmp_path, endpoint=hub.url, offline=False, registry=registry, say=lambda m: None)
    registry = parse_registry(toml_for(repo="me/renamed"))
    with pytest.raises(DownloadError, match="repository me/renamed was not found on the hub"):
        pull("tiny", cache_dir=tmp_path, endpoint=hub.url, offline=False, registry=registry, say=lambda m: None)


def test_pull_without_network_fails_at_once(tmp_path):
    registry = parse_registry(toml_for())
    endpoint = f"http://127.0.0.1:{closed_port()}"
    assert unreachable(endpoint) is not None
    t0 = time.perf_counter()
    with pytest.raises(
        DownloadError,
        match=rf"cannot reach {endpoint} \(.+\), so me/tiny/target.gguf, "
        r"me/tiny/draft.gguf cannot be downloaded; check the network",
    ):
        pull("tiny", cache_dir=tmp_path, endpoint=endpoint, offline=False, registry=registry, say=lambda m: None)
    assert time.perf_counter() - t0 < 5


def test_pull_in_offline_mode(tmp_path):
    registry = parse_registry(toml_for())
    with pytest.raises(
        DownloadError, match="HF_HUB_OFFLINE is set and me/tiny/target.gguf, me/tiny/draft.gguf is not in the cache"
    ):
        pull("tiny", cache_dir=tmp_path, offline=True, registry=registry, say=lambda m: None)
    populate_cache(tmp_path, "me/tiny", {"draft.gguf": b"GGUF draft", "target.gguf": b"GGUF target"})
    said = []
    target, _ = pull("tiny", cache_dir=tmp_path, offline=True, registry=registry, say=said.append)
    assert Path(target).read_bytes() == b"GGUF target" and "target: sha256 matches the hub's checksum" in said


def test_pull_checks_free_disk_space_first(online, hub, tmp_path):
    registry = parse_registry(toml_for(size_mb=1e12))
    with pytest.raises(DownloadError, match=r"tiny needs 2000000000.0 GB but .* GB free"):
        pull("tiny", cache_dir=tmp_path, endpoint=hub.url, offline=False, registry=registry, say=lambda m: None)
    assert hub.requests == []
