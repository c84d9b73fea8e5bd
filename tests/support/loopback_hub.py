"""A Hugging Face hub on 127.0.0.1 for offline tests: it answers `/{repo}/resolve/{revision}/{file}` (HEAD and
GET) the way huggingface-hub expects, so `hf_hub_download` runs its real code path against local files. Also: a
models.toml for a pair served from it, and a port where no hub answers."""

from __future__ import annotations

import hashlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class LoopbackHub:
    """`files` maps 'owner/name/file.gguf' to bytes; `etags` may override the checksum the hub announces."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                hub.requests.append(f"{self.command} {self.path}")
                parts = self.path.lstrip("/").split("/")
                key = "/".join(parts[:2] + parts[4:]) if len(parts) >= 5 and parts[2] == "resolve" else None
                data = hub.files.get(key) if key else None
                if data is None:
                    repo_known = key and any(k.startswith("/".join(parts[:2]) + "/") for k in hub.files)
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if repo_known else "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0] or 0)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hub.etags.get(key) or hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(data[start:])

            def log_message(self, *args):  # keep test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def add(self, repo: str, file: str, path_or_bytes) -> str:
        data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
        self.files[f"{repo}/{file}"] = data
        return hashlib.sha256(data).hexdigest()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on: a hub that cannot be reached."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_for(draft_sha=None, target_sha=None, size_mb=0.1, repo="me/tiny"):
    """A models.toml with one pair, 'tiny', whose files are draft.gguf and target.gguf in `repo`."""

    def entry(role, sha):
        lines = [f"[pairs.tiny.{role}]", f'repo = "{repo}"', f'file = "{role}.gguf"', f"size_mb = {size_mb}"]
        if sha:
            lines += [f'sha256 = "{sha}"', 'sha256_revision = "0123456"']
        return "\n".join(lines)

    return "\n".join(
        [
            "[tau]",
            "js = 0.2",
            "",
            "[pairs.tiny]",
            'description = "tiny pair"',
            'licence = "test"',
            entry("draft", draft_sha),
            entry("target", target_sha),
        ]
    )
