"""Where Ollama, the Hugging Face cache, LM Studio and llama.cpp's cache keep GGUF files and what they call them
(docs/models.md), from folder listings and small JSON files only (local.py reads the headers). A split model is
one entry, its first part; what a broken store holds becomes an Entry with a `problem`, never an exception."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

LABELS = {
    "ollama": "Ollama",
    "huggingface": "Hugging Face cache",
    "lmstudio": "LM Studio",
    "llama.cpp": "llama.cpp cache",
    "folder": "the target's folder",
}
LMSTUDIO_ENV = "FSD_LOCAL_LMSTUDIO_MODELS"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_SERVICE_MODELS = "/usr/share/ollama/.ollama/models"  # the Linux installer's `ollama` user
_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass
class Entry:
    """One model a store holds: the name --target/--draft accept, and its GGUF (the first part of a split)."""

    store: str
    name: str
    path: str | None
    problem: str | None = None


@dataclass
class Root:
    """One folder searched: `state` is 'found', 'not found' or why it cannot be read."""

    store: str
    path: str
    state: str = "found"

    @property
    def label(self) -> str:
        return LABELS[self.store]


# ------------------------------------------------------------------ where the stores are
def _home() -> Path:
    return Path.home()


def _xdg_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or _home() / ".cache")


def ollama_roots() -> list[str]:
    if os.environ.get("OLLAMA_MODELS"):
        return [os.environ["OLLAMA_MODELS"]]
    extra = [OLLAMA_SERVICE_MODELS] if sys.platform.startswith("linux") and os.path.isdir(OLLAMA_SERVICE_MODELS) else []
    return [str(_home() / ".ollama" / "models"), *extra]


def hf_root() -> str:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.environ[var]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return str(_xdg_cache() / "huggingface" / "hub")


def lmstudio_roots() -> list[str]:
    if os.environ.get(LMSTUDIO_ENV):
        return [os.environ[LMSTUDIO_ENV]]
    home = _home() / ".lmstudio"
    try:
        pointed = (_home() / ".lmstudio-home-pointer").read_text(encoding="utf-8").strip().splitlines()
        if pointed and os.path.isdir(pointed[0].strip()):
            home = Path(pointed[0].strip())
    except (OSError, UnicodeDecodeError):
        pass
    models = home / "models"
    try:
        folder = json.loads((home / "settings.json").read_text(encoding="utf-8")).get("downloadsFolder")
        if isinstance(folder, str) and os.path.isdir(folder):
            models = Path(folder)
    except (OSError, ValueError, AttributeError):
        pass
    legacy = _home() / ".cache" / "lm-studio" / "models"
    return [str(models)] + ([str(legacy)] if legacy.is_dir() and legacy != models else [])


def llamacpp_root() -> str:
    if os.environ.get("LLAMA_CACHE"):
        return os.environ["LLAMA_CACHE"]
    if sys.platform == "darwin":
        return str(_home() / "Library" / "Caches" / "llama.cpp")
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return os.path.join(os.environ["LOCALAPPDATA"], "llama.cpp")
    return str(_xdg_cache() / "llama.cpp")


def roots() -> list[Root]:
    """Every folder searched, in the order names are looked up (the environment is read now)."""
    out = [Root("ollama", p) for p in ollama_roots()]
    out.append(Root("huggingface", hf_root()))
    out += [Root("lmstudio", p) for p in lmstudio_roots()]
    out.append(Root("llama.cpp", llamacpp_root()))
    return out


# ------------------------------------------------------------------ reading folders
def _listdir(path: str | Path) -> tuple[list[str], str | None]:
    """(sorted names, None), or ([], why the folder cannot be listed)."""
    try:
        return sorted(os.listdir(path)), None
    except FileNotFoundError:
        return [], "not found"
    except NotADirectoryError:
        return [], "not a folder"
    except OSError as exc:
        return [], f"cannot be read ({exc.strerror or exc})"


def _unreadable(store: str, name: str, path, why: str) -> Entry:
    return Entry(store, name, None, f"the folder {path} {why}")


def _ggufs(store: str, prefix: str, folder: Path, recursive: bool = True) -> list[Entry]:
    """The *.gguf files under `folder` as entries named prefix + their relative path, split parts once."""
    found, out = [], []
    for dirpath, dirnames, files in os.walk(folder, onerror=lambda e: out.append(_walk_error(store, prefix, e))):
        dirnames.sort()
        found += [os.path.relpath(os.path.join(dirpath, f), folder) for f in files if f.lower().endswith(".gguf")]
        if not recursive:
            break
    return out + _group_splits(store, prefix, folder, sorted(found))


def _walk_error(store: str, prefix: str, exc: OSError) -> Entry:
    where = exc.filename or prefix
    return _unreadable(store, prefix.rstrip("/") or str(where), where, f"cannot be read ({exc.strerror or exc})")


def _group_splits(store: str, prefix: str, folder: Path, rels: list[str]) -> list[Entry]:
    out: list[Entry] = []
    parts: dict[tuple[str, str], list[str]] = {}
    for rel in rels:
        m = _SPLIT.match(rel)
        if m:
            parts.setdefault((m.group(1), m.group(3)), []).append(rel)
            continue
        out.append(_file_entry(store, prefix + rel.replace(os.sep, "/"), folder / rel))
    for (stem, count), names in parts.items():
        first = f"{stem}-00001-of-{count}.gguf"
        name = prefix + first.replace(os.sep, "/")
        if first in names:
            out.append(_file_entry(store, name, folder / first))
        else:
            out.append(Entry(store, name, None, f"split model without its first part {folder / first}"))
    return sorted(out, key=lambda e: e.name)


def _file_entry(store: str, name: str, path: Path) -> Entry:
    if not path.exists():  # a link whose target is gone: the hub cache's snapshots link into blobs/
        return Entry(store, name, str(path), f"{path} links to a missing file (an interrupted download?)")
    return Entry(store, name, str(path))


# ------------------------------------------------------------------ Ollama
def ollama_name(registry: str, namespace: str, model: str, tag: str) -> str:
    if registry != OLLAMA_REGISTRY:
        return f"{registry}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"


def _subdirs(store: str, name: str, path: Path, out: list[Entry]) -> list[str]:
    """The names in `path`; a folder that cannot be read becomes an entry of `out` saying so."""
    names, why = _listdir(path)
    if why and why not in ("not found", "not a folder"):
        out.append(_unreadable(store, name, path, why))
    return names


def scan_ollama(root: str) -> list[Entry]:
    """manifests/<registry>/<namespace>/<name>/<tag>: a JSON manifest whose model layer's digest sha256:<hex> names the
    GGUF, blobs/sha256-<hex>; named as `ollama list` shows them (ollama_name)."""
    manifests, blobs = Path(root) / "manifests", Path(root) / "blobs"
    out: list[Entry] = []
    for reg in _subdirs("ollama", "manifests", manifests, out):
        for ns in _subdirs("ollama", reg, manifests / reg, out):
            for model in _subdirs("ollama", f"{reg}/{ns}", manifests / reg / ns, out):
                folder = manifests / reg / ns / model
                for tag in _subdirs("ollama", ollama_name(reg, ns, model, "*"), folder, out):
                    if (folder / tag).is_file():
                        out.append(_ollama_entry(ollama_name(reg, ns, model, tag), folder / tag, blobs))
    return out


def _ollama_entry(name: str, manifest: Path, blobs: Path) -> Entry:
    def bad(why: str) -> Entry:
        return Entry("ollama", name, None, f"manifest {manifest}: {why}")

    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return bad(f"cannot be read ({getattr(exc, 'strerror', None) or exc})")
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        return bad("no list of layers (not an Ollama manifest)")
    model = [x for x in layers if isinstance(x, dict) and x.get("mediaType") == OLLAMA_MODEL_LAYER]
    if not model:
        kinds = sorted({str(x.get("mediaType")) for x in layers if isinstance(x, dict)})
        return bad(f"no GGUF model layer (layers: {', '.join(kinds) or 'none'})")
    digest = str(model[0].get("digest", ""))
    m = _DIGEST.match(digest)
    if not m:
        return bad(f"the model layer's digest {digest!r} is not sha256:<64 hex digits>")
    blob = blobs / f"sha256-{m.group(1)}"
    if not blob.exists() and (blobs / f"sha256:{m.group(1)}").exists():  # early Ollama releases
        blob = blobs / f"sha256:{m.group(1)}"
    if not blob.exists():
        return Entry(
            "ollama",
            name,
            None,
            f"the manifest names the blob {blob.name}, which is missing from {blobs} (`ollama pull {name}` again)",
        )
    size = model[0].get("size")
    have = blob.stat().st_size
    if isinstance(size, int) and have < size:
        return Entry("ollama", name, str(blob), f"the blob holds {have} of the {size} bytes its manifest lists")
    return Entry("ollama", name, str(blob))


# ------------------------------------------------------------------ the hub cache layout (Hugging Face, llama.cpp)
def scan_hub(root: str, store: str = "huggingface") -> list[Entry]:
    """The hub cache: models--ORG--NAME/snapshots/<revision>/... (links into blobs/), the revision refs/main names read
    first; named org/name/file.gguf."""
    names, why = _listdir(root)
    if why:
        return [] if why == "not found" else [_unreadable(store, "", root, why)]
    out = []
    for d in names:
        if d.startswith("models--") and os.path.isdir(os.path.join(root, d)):
            out += _hub_repo(Path(root) / d, store)
    return out


def _hub_repo(repo: Path, store: str) -> list[Entry]:
    repo_id = repo.name[len("models--") :].replace("--", "/")
    try:
        main = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        main = ""
    revisions, why = _listdir(repo / "snapshots")
    if why and why != "not found":
        return [_unreadable(store, repo_id, repo / "snapshots", why)]
    out, seen = [], set()
    for rev in sorted(revisions, key=lambda r: r != main):  # the current revision first, then older ones
        for e in _ggufs(store, f"{repo_id}/", repo / "snapshots" / rev):
            if e.name not in seen:
                seen.add(e.name)
                out.append(e)
    return out


# ------------------------------------------------------------------ LM Studio, llama.cpp
def scan_lmstudio(root: str) -> list[Entry]:
    """<publisher>/<repo>/*.gguf, named publisher/repo/file.gguf."""
    out: list[Entry] = []
    for pub in _subdirs("lmstudio", "", Path(root), out):
        for repo in _subdirs("lmstudio", pub, Path(root) / pub, out):
            if (Path(root) / pub / repo).is_dir():
                out += _ggufs("lmstudio", f"{pub}/{repo}/", Path(root) / pub / repo)
    return out


def scan_llamacpp(root: str) -> list[Entry]:
    """Older llama.cpp's flat org_repo_file.gguf, named org/repo/file.gguf where a manifest=org=repo=tag.json says so,
    then the hub layout newer builds use."""
    names, why = _listdir(root)
    if why:
        return [] if why == "not found" else [_unreadable("llama.cpp", "", root, why)]
    prefixes = {}  # "org_repo_" -> "org/repo/", from manifest=org=repo=tag.json
    for n in names:
        parts = n[: -len(".json")].split("=") if n.startswith("manifest=") and n.endswith(".json") else []
        if len(parts) == 4:
            prefixes[f"{parts[1]}_{parts[2]}_"] = f"{parts[1]}/{parts[2]}/"
    out = []
    for e in _ggufs("llama.cpp", "", Path(root), recursive=False):
        for flat, repo in sorted(prefixes.items(), key=lambda kv: -len(kv[0])):
            if e.name.startswith(flat):
                e.name = repo + e.name[len(flat) :]
                break
        out.append(e)
    return out + scan_hub(root, "llama.cpp")


def scan_folder(folder: str) -> list[Entry]:
    """The GGUF files next to a target given by path, named by their paths."""
    return [Entry("folder", e.path or e.name, e.path, e.problem) for e in _ggufs("folder", "", Path(folder), False)]


SCANNERS = {"ollama": scan_ollama, "huggingface": scan_hub, "lmstudio": scan_lmstudio, "llama.cpp": scan_llamacpp}


def scan(root: Root) -> list[Entry]:
    """The entries of one store folder; sets root.state."""
    if not os.path.isdir(root.path):
        root.state = "not found" if not os.path.exists(root.path) else "not a folder"
        return []
    if not os.access(root.path, os.R_OK | os.X_OK):
        root.state = "cannot be read (permission denied)"
        return []
    try:
        return SCANNERS[root.store](root.path)
    except OSError as exc:  # e.g. a blob in a folder this user may not read
        root.state = f"cannot be read ({exc.strerror or exc}: {exc.filename})"
        return []
