"""What the GGUF headers of local models say, kept in a JSON index (FSD_LOCAL_CACHE/local-models.json) keyed by path,
size and modification time, so a listing reads only the files that changed; an index that cannot be read or
written is rebuilt or skipped, never an error."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from fsd_local.paths import cache_dir

INDEX_VERSION = 1
INDEX_NAME = "local-models.json"


def _summary(path: str) -> dict:
    """The header facts discovery needs, or {"error": why} (a broken file is a result, not an exception)."""
    from fsd_local.errors import ModelLoadError
    from fsd_local.llama import gguf_info

    try:
        info = gguf_info.read(path, role="the", vocab=True)
    except ModelLoadError as exc:
        return {"error": str(exc)}
    except (OSError, ValueError) as exc:
        return {"error": f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"}
    vocab = info.meta.get("vocab")
    return {
        "architecture": info.architecture,
        "label": info.name,
        "quantisation": info.quantisation,
        "file_bytes": info.file_bytes,
        "n_layer": info.n_layer,
        "n_embd": info.n_embd,
        "n_ctx_train": info.n_ctx_train,
        "tokenizer": info.tokenizer,
        "chat_template": info.has_chat_template,
        "vocab": vocab.to_dict() if vocab is not None else None,
    }


def _same(entry: dict, inode: dict) -> bool:
    return all(entry.get(k) == v for k, v in inode.items()) and _valid(entry.get("summary"))


SUMMARY_KEYS = {"architecture": str, "quantisation": str, "file_bytes": int, "n_layer": int, "n_embd": int}
VOCAB_KEYS = {"n_vocab": int, "first": int, "digests": list}


def _valid(summary) -> bool:
    """A summary as _summary writes it (an index edited or written by another version is read again)."""
    if not isinstance(summary, dict):
        return False
    if "error" in summary:
        return isinstance(summary["error"], str)
    if not all(isinstance(summary.get(k), t) for k, t in SUMMARY_KEYS.items()):
        return False
    vocab = summary.get("vocab")
    if vocab is None:
        return True
    return isinstance(vocab, dict) and all(isinstance(vocab.get(k), t) for k, t in VOCAB_KEYS.items())


class HeaderIndex:
    """header(path) -> the summary of its GGUF header, from the index when the file is unchanged."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else cache_dir() / INDEX_NAME
        self.files: dict[str, dict] = {}
        self.read_now = 0  # headers read (not found in the index) by this object
        self._dirty = False
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("version") == INDEX_VERSION and isinstance(data.get("files"), dict):
                self.files = data["files"]
        except (OSError, ValueError, UnicodeDecodeError):
            pass  # no index yet, or a broken one: it is rebuilt

    def header(self, path: str) -> dict:
        key = os.path.abspath(path)
        try:
            st = os.stat(key)
        except OSError as exc:
            return {"error": f"cannot read {path}: {exc.strerror or exc}"}
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        known = self.files.get(key)
        if isinstance(known, dict) and all(known.get(k) == v for k, v in stamp.items()):
            if _valid(known.get("summary")):
                return known["summary"]
        # the same file under another name (a hub snapshot link, a hard link into another app's folder)
        inode = {**stamp, "dev": st.st_dev, "ino": st.st_ino}
        twin = next((v for v in self.files.values() if isinstance(v, dict) and _same(v, inode)), None)
        if twin is not None and "error" not in twin["summary"]:
            summary = twin["summary"]
        else:
            summary = _summary(key)
            self.read_now += 1
        self.files[key] = {**inode, "summary": summary}
        self._dirty = True
        return summary

    def save(self) -> None:
        """Write the index if anything was read (files that are gone are dropped); a failure only costs speed."""
        if not self._dirty:
            return
        files = {k: v for k, v in self.files.items() if os.path.exists(k)}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".local-models-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": INDEX_VERSION, "files": files}, fh)
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            pass
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
