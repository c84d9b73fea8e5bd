"""Curated draft/target pairs (the packaged models.toml, or the file FSD_LOCAL_MODELS names): validated loading,
where their files sit in the Hugging Face cache, and `pull` (huggingface-hub's download, then a SHA-256 check)."""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shutil
import socket
import sys
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from fsd_local.errors import DownloadError, ModelLoadError, RegistryError
from fsd_local.kernels.names import DIVERGENCES

ENV_FILE = "FSD_LOCAL_MODELS"
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ModelFile:
    repo: str
    file: str
    size_mb: float
    sha256: str | None = None
    sha256_revision: str | None = None

    @property
    def label(self) -> str:
        return f"{self.repo}/{self.file}"

    def cached_path(self, cache_dir=None) -> str | None:
        """The file in the local Hugging Face cache (default branch), or None."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo, self.file, cache_dir=cache_dir)
        # besides a path it may return a marker meaning "known to be absent"
        return found if isinstance(found, str) and os.path.isfile(found) else None


@dataclass(frozen=True)
class Pair:
    name: str
    description: str
    licence: str
    draft: ModelFile
    target: ModelFile
    tau: dict = field(default_factory=dict)
    notes: str = ""

    def files(self) -> list[tuple[str, ModelFile]]:
        return [("target", self.target), ("draft", self.draft)]


# ------------------------------------------------------------------ loading and validation
PAIR_KEYS = {"description": str, "licence": str, "notes": str, "tau": dict, "draft": dict, "target": dict}
PAIR_REQUIRED = ("description", "licence", "draft", "target")
FILE_KEYS = {"repo": str, "file": str, "size_mb": (int, float), "sha256": str, "sha256_revision": str}
FILE_REQUIRED = ("repo", "file", "size_mb")
TYPE_NAMES = {str: "a string", dict: "a table", (int, float): "a number"}


def _check_table(table, allowed: dict, required, where: str) -> None:
    for key in table:
        if key not in allowed:
            raise RegistryError(f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")
    for key in required:
        if key not in table:
            raise RegistryError(f"{where}: missing key {key!r}")
    for key, value in table.items():
        want = allowed[key]
        if isinstance(value, bool) or not isinstance(value, want):
            raise RegistryError(f"{where}: {key} must be {TYPE_NAMES[want]}, got {value!r}")


def _tau(table, where: str) -> dict:
    for div, value in table.items():
        if div not in DIVERGENCES:
            raise RegistryError(f"{where}: {div!r} is not a divergence (choose from {', '.join(DIVERGENCES)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise RegistryError(f"{where}: tau for {div} must be a number >= 0, got {value!r}")
    return {div: float(v) for div, v in table.items()}


def _file(table, where: str) -> ModelFile:
    _check_table(table, FILE_KEYS, FILE_REQUIRED, where)
    if not REPO_RE.match(table["repo"]):
        raise RegistryError(f"{where}: repo must look like 'owner/name', got {table['repo']!r}")
    name = table["file"]
    if not name.endswith(".gguf") or "/" in name or "\\" in name or name.startswith("."):
        raise RegistryError(f"{where}: file must be a plain *.gguf file name, got {name!r}")
    if not table["size_mb"] > 0:
        raise RegistryError(f"{where}: size_mb must be > 0, got {table['size_mb']!r}")
    sha = table.get("sha256")
    if sha is not None and not SHA256_RE.match(sha):
        raise RegistryError(f"{where}: sha256 must be 64 lowercase hex digits, got {sha!r}")
    if (sha is None) != (table.get("sha256_revision") is None):
        raise RegistryError(f"{where}: sha256 and sha256_revision go together (the hash holds for that revision)")
    return ModelFile(**table)


def parse_registry(text: str, source: str = "models.toml") -> dict[str, Pair]:
    """Pairs by name; any problem raises RegistryError naming the file, the pair and the field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{source} is not valid TOML: {exc}") from None
    unknown = set(data) - {"tau", "pairs"}
    if unknown:
        raise RegistryError(f"{source}: unknown top-level key(s) {', '.join(sorted(unknown))} (allowed: tau, pairs)")
    pairs = data.get("pairs")
    if not isinstance(pairs, dict) or not pairs:
        raise RegistryError(f'{source}: no [pairs."NAME"] tables')
    if not isinstance(data.get("tau", {}), dict):
        raise RegistryError(f"{source}: tau must be a table of divergence = value")
    default_tau = _tau(data.get("tau", {}), f"{source} [tau]")
    out = {}
    for name, table in pairs.items():
        where = f"{source} pair {name!r}"
        if not isinstance(table, dict):
            raise RegistryError(f"{where}: must be a table")
        _check_table(table, PAIR_KEYS, PAIR_REQUIRED, where)
        out[name] = Pair(
            name=name,
            description=table["description"],
            licence=table["licence"],
            notes=table.get("notes", ""),
            draft=_file(table["draft"], f"{where} draft"),
            target=_file(table["target"], f"{where} target"),
            tau={**default_tau, **_tau(table.get("tau", {}), f"{where} tau")},
        )
    return out


def registry_source() -> tuple[str, str]:
    """(text, name) of the models.toml in use."""
    path = os.environ.get(ENV_FILE)
    if path:
        try:
            return Path(path).read_text(encoding="utf-8"), path
        except OSError as exc:
            raise RegistryError(f"{ENV_FILE}={path}: cannot read it ({exc.strerror})") from None
    packaged = resources.files("fsd_local").joinpath("data").joinpath("models.toml")
    return packaged.read_text(encoding="utf-8"), "models.toml"


def load_registry() -> dict[str, Pair]:
    text, source = registry_source()
    return parse_registry(text, source)


def get_pair(name: str, registry: dict[str, Pair] | None = None) -> Pair:
    registry = load_registry() if registry is None else registry
    if name not in registry:
        close = difflib.get_close_matches(name, list(registry), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RegistryError(f"unknown pair {name!r}{hint}; known pairs: {', '.join(registry)} (`fsd-local models`)")
    return registry[name]


def local_pair_paths(name: str, cache_dir=None, registry: dict[str, Pair] | None = None) -> tuple[str, str]:
    """(target_path, draft_path) of a pulled pair; ModelLoadError naming what is missing otherwise."""
    pair = get_pair(name, registry)
    paths = {role: f.cached_path(cache_dir) for role, f in pair.files()}
    missing = [f.label for role, f in pair.files() if paths[role] is None]
    if missing:
        raise ModelLoadError(
            f"pair {name!r} is not downloaded yet (missing {', '.join(missing)}); run `fsd-local pull {name}`"
        )
    target, draft = paths["target"], paths["draft"]
    assert target is not None and draft is not None  # nothing missing
    return target, draft


# ------------------------------------------------------------------ pull
def hub_cache_dir(cache_dir=None) -> str:
    from huggingface_hub import constants

    return str(cache_dir or constants.HF_HUB_CACHE)


def unreachable(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub endpoint cannot be reached (None if a TCP connection opens). huggingface-hub itself
    retries with back-off for ~20 s before giving up; this answers at once."""
    url = urlsplit(endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host or ""):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname, p.port or 80
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


def sha256_file(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(f: ModelFile, path: str, pair_name: str) -> str:
    """Check a downloaded file's SHA-256; returns what it was checked against. The hub names each cached
    blob by its ETag, which for LFS files is the file's SHA-256: the hub's checksum for that commit."""
    digest = sha256_file(path)
    blob = os.path.realpath(path)
    hub = os.path.basename(blob) if SHA256_RE.match(os.path.basename(blob)) else None
    if f.sha256 and digest == f.sha256:
        return f"sha256 matches models.toml (revision {f.sha256_revision})"
    if hub and digest == hub:
        if f.sha256:
            return (
                f"sha256 matches the hub's checksum; it differs from models.toml's (revision "
                f"{f.sha256_revision}): the file was re-uploaded since"
            )
        return "sha256 matches the hub's checksum"
    if hub:  # the bytes are not what the hub said they are: a corrupt download, remove it
        os.unlink(blob)
        if os.path.islink(path):
            os.unlink(path)
        raise DownloadError(
            f"{f.label}: sha256 {digest} does not match the hub's checksum {hub}; the corrupt "
            f"copy was removed, run `fsd-local pull {pair_name}` again"
        )
    if f.sha256:
        raise DownloadError(
            f"{f.label}: sha256 {digest} does not match models.toml's {f.sha256} (revision "
            f"{f.sha256_revision}); the file may have been re-uploaded upstream, or is corrupt: "
            f"delete {path} and pull again"
        )
    return "not verified: no checksum known for this file"


def _download(f: ModelFile, cache_dir, endpoint, local_only: bool) -> str:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return hf_hub_download(f.repo, f.file, cache_dir=cache_dir, endpoint=endpoint, local_files_only=local_only)
    except LocalEntryNotFoundError:  # the hub stopped answering after the probe, and nothing is cached
        raise DownloadError(
            f"{f.label} could not be fetched from {endpoint} and is not in the cache; check the network and pull again"
        ) from None
    except GatedRepoError:
        raise DownloadError(
            f"{f.repo} is gated: accept its licence on the hub, then log in (`hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise DownloadError(f"repository {f.repo} was not found on the hub (renamed or private?)") from None
    except EntryNotFoundError:
        raise DownloadError(f"{f.file} is no longer in {f.repo} (renamed upstream?)") from None
    except (HfHubHTTPError, OSError) as exc:  # HTTP errors, a dropped connection, a full disk...
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DownloadError(f"downloading {f.label} failed: {first_line}") from None


def pull(
    name: str,
    *,
    cache_dir=None,
    endpoint: str | None = None,
    offline: bool | None = None,
    registry: dict[str, Pair] | None = None,
    say=print,
) -> tuple[str, str]:
    """Download a pair's files into the Hugging Face cache (files already there are reused, not re-fetched)
    and verify each one's SHA-256. Returns (target_path, draft_path)."""
    from huggingface_hub import constants

    pair = get_pair(name, registry)
    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    endpoint = endpoint or constants.ENDPOINT
    cache = hub_cache_dir(cache_dir)
    present = {role: f.cached_path(cache_dir) for role, f in pair.files()}
    missing = [f for role, f in pair.files() if present[role] is None]
    if missing:
        labels = ", ".join(f.label for f in missing)
        if offline:
            raise DownloadError(
                f"HF_HUB_OFFLINE is set and {labels} is not in the cache {cache}; unset HF_HUB_OFFLINE to download"
            )
        reason = unreachable(endpoint)
        if reason:
            raise DownloadError(
                f"cannot reach {endpoint} ({reason}), so {labels} cannot be downloaded; "
                "check the network, or set HF_ENDPOINT to a mirror"
            )
        need_mb = sum(f.size_mb for f in missing)
        os.makedirs(cache, exist_ok=True)
        free_mb = shutil.disk_usage(cache).free / 1e6
        if free_mb < need_mb * 1.05:
            raise DownloadError(
                f"{name} needs {need_mb / 1000:.1f} GB but {cache} has {free_mb / 1000:.1f} GB free; "
                "free some space or set HF_HUB_CACHE to another disk"
            )
    paths = {}
    for role, f in pair.files():
        if present[role]:
            say(f"{role}: {f.label} already in the cache")
        else:
            say(f"{role}: downloading {f.label} (~{_size(f.size_mb)})")
        paths[role] = _download(f, cache_dir, endpoint, local_only=offline or present[role] is not None)
        say(f"{role}: checking sha256 ...")
        say(f"{role}: {verify(f, paths[role], name)}")
    return paths["target"], paths["draft"]


# ------------------------------------------------------------------ listing
def _size(mb: float) -> str:
    return f"{mb / 1000:.1f} GB" if mb >= 1000 else f"{mb:.0f} MB"


def format_pairs(registry: dict[str, Pair], cache_dir=None) -> str:
    """What `fsd-local models` prints: each pair, its files and whether they are in the local cache."""
    lines = [f"Pairs in models.toml; files are looked up in the Hugging Face cache {hub_cache_dir(cache_dir)}", ""]
    for pair in registry.values():
        present = {role: f.cached_path(cache_dir) is not None for role, f in pair.files()}
        n = sum(present.values())
        state = "downloaded" if n == 2 else ("not downloaded" if n == 0 else "1 of 2 files downloaded")
        lines.append(f"{pair.name}  [{state}]  {pair.description}")
        for role, f in pair.files():
            lines.append(
                f"  {role:<7} {f.repo} / {f.file}  {_size(f.size_mb)}  {'present' if present[role] else 'missing'}"
            )
        lines.append(f"  licence {pair.licence}")
        if pair.tau:
            lines.append("  tau     " + ", ".join(f"{div} {value:g}" for div, value in pair.tau.items()))
        if pair.notes:
            lines.append(f"  note    {pair.notes}")
        lines.append("")
    lines.append("Pull one with `fsd-local pull NAME`, then `fsd-local chat --pair NAME --tau 0.1`.")
    return "\n".join(lines)
