"""Model stores laid out the way the apps write them, from GGUF files the tests made: an Ollama models folder
(manifests + content-addressed blobs), a Hugging Face hub cache (blobs, refs/main, snapshots linking into blobs),
an LM Studio models folder and llama.cpp's older flat cache. `isolate(monkeypatch, root)` points every store's
environment variable under `root`, away from the user's own."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

COMMIT = "6a1b2c3d4e5f60718293a4b5c6d7e8f901234567"
OLLAMA_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OLLAMA_CONFIG = "application/vnd.docker.container.image.v1+json"


def place(src, dst: Path) -> Path:
    """A hard link to `src` where the file system allows one (the demo models are ~100 MB), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _blob(blobs: Path, data: bytes | None = None, src=None) -> dict:
    if src is not None:
        digest = sha256(src)
        target = blobs / f"sha256-{digest}"
        if not target.exists():
            place(src, target)
        return {"digest": f"sha256:{digest}", "size": os.path.getsize(target)}
    assert data is not None
    digest = hashlib.sha256(data).hexdigest()
    (blobs / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def ollama_model(root: Path, name: str, gguf, *, registry="registry.ollama.ai", namespace="library", projector=None):
    """What `ollama pull name:tag` leaves: a manifest naming the model, template, params and licence blobs (and a
    projector layer when given). Returns the manifest's path."""
    model, _, tag = name.partition(":")
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    layers = [{"mediaType": "application/vnd.ollama.image.model", **_blob(blobs, src=gguf)}]
    if projector is not None:
        layers.append({"mediaType": "application/vnd.ollama.image.projector", **_blob(blobs, src=projector)})
    layers += [
        {"mediaType": "application/vnd.ollama.image.template", **_blob(blobs, b"{{ .Prompt }}")},
        {"mediaType": "application/vnd.ollama.image.params", **_blob(blobs, b'{"stop": ["</s>"]}')},
        {"mediaType": "application/vnd.ollama.image.license", **_blob(blobs, b"Apache-2.0")},
    ]
    config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "F32"}).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OLLAMA_MANIFEST,
        "config": {"mediaType": OLLAMA_CONFIG, **_blob(blobs, config)},
        "layers": layers,
    }
    path = root / "manifests" / registry / namespace / model / (tag or "latest")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def hub_file(cache: Path, repo: str, filename: str, src, revision: str = COMMIT) -> Path:
    """A file as huggingface-hub caches it: the bytes in blobs/<sha256>, refs/main naming the revision, and
    snapshots/<revision>/<filename> a relative link to the blob. Returns the snapshot path."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    digest = sha256(src)
    blob = folder / "blobs" / digest
    if not blob.exists():
        place(src, blob)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    link = folder / "snapshots" / revision / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


def lmstudio_file(models: Path, publisher: str, repo: str, src, filename: str | None = None) -> Path:
    return place(src, models / publisher / repo / (filename or Path(src).name))


def llamacpp_file(cache: Path, repo: str, filename: str, src) -> Path:
    """llama.cpp's flat cache (before it moved to the hub layout): org_repo_file.gguf and its manifest."""
    org, name = repo.split("/")
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"manifest={org}={name}=latest.json").write_text(json.dumps({"ggufFile": {"rfilename": filename}}))
    return place(src, cache / f"{org}_{name}_{filename}")


def isolate(monkeypatch, root: Path) -> dict[str, Path]:
    """Every store under `root` (none of them created): the environment variables the apps read, plus HOME so
    that nothing falls back to the user's own folders. Returns the store folders by name."""
    paths = {
        "ollama": root / "ollama" / "models",
        "huggingface": root / "huggingface" / "hub",
        "lmstudio": root / "lmstudio" / "models",
        "llama.cpp": root / "llama.cpp",
    }
    env = {
        "OLLAMA_MODELS": paths["ollama"],
        "HF_HUB_CACHE": paths["huggingface"],
        "FSD_LOCAL_LMSTUDIO_MODELS": paths["lmstudio"],
        "LLAMA_CACHE": paths["llama.cpp"],
        "HOME": root / "home",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    return paths
