"""Who may drive the server (docs/server.md, "Security"): the API key, and the Guard refusing a Host that is not the
server's own (DNS rebinding), an Origin not allowed and a body not sent as JSON, before anything runs (403, 415)."""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import json
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request

from fsd_local.server.errors import APIError, error_body

ORIGINS_ENV = "FSD_LOCAL_ORIGINS"  # comma-separated, like Ollama's OLLAMA_ORIGINS
HOSTS_ENV = "FSD_LOCAL_HOSTS"
WILDCARD_BINDS = ("", "0.0.0.0", "::", "[::]")
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
PREFLIGHT_MAX_AGE = "600"


def require_key(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: 401 unless the request carries 'Authorization: Bearer <api_key>' (None: no key)."""

    async def authorised(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    return authorised


def env_list(name: str) -> list[str]:
    """A comma-separated environment variable as its entries."""
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _hostname(host_header: str) -> str:
    """The name or address of a Host header, without port, brackets or a final dot, lowercased."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class AccessPolicy:
    """The Host names and Origins this server answers."""

    def __init__(
        self, bind_host: str = "127.0.0.1", allow_hosts: Sequence[str] = (), allow_origins: Sequence[str] = ()
    ):
        self.bind = _hostname(bind_host) if bind_host not in WILDCARD_BINDS else ""
        self.everywhere = bind_host in WILDCARD_BINDS
        self.hosts = [h.lower().rstrip(".") for h in allow_hosts]
        self.origins = [o.rstrip("/").lower() for o in allow_origins]
        names = {"localhost"}
        if self.bind:
            names.add(self.bind)
        if self.everywhere:  # reached through the network by this machine's name
            machine = socket.gethostname().lower()
            names |= {machine, machine + ".local"}
        self.names = names

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None:  # HTTP/1.0 without Host: not a browser
            return True
        name = _hostname(host_header)
        ip = _ip(name)
        if ip is not None and (ip.is_loopback or self.everywhere):  # a rebinding attack needs a domain name
            return True
        if name in self.names or name.endswith(".localhost"):  # browsers resolve *.localhost to loopback
            return True
        return any(pattern == "*" or fnmatch.fnmatchcase(name, pattern) for pattern in self.hosts)

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        origin = origin.rstrip("/").lower()
        if host_header and origin in (f"http://{host_header.lower()}", f"https://{host_header.lower()}"):
            return True  # the page's own origin (the chat page, or a page behind a proxy on this host)
        return any(pattern == "*" or fnmatch.fnmatchcase(origin, pattern) for pattern in self.origins)

    def describe_hosts(self) -> str:
        return ", ".join(sorted(self.names | {"127.0.0.1", "::1"}) + self.hosts)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class Guard:
    """ASGI middleware enforcing an AccessPolicy, and answering CORS for the origins it allows."""

    def __init__(self, app: Any, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        host, origin = _header(scope, b"host"), _header(scope, b"origin")
        if not self.policy.host_allowed(host):
            why = (
                f"the Host header {host!r} is not one of this server's names ({self.policy.describe_hosts()}): a web "
                "page may be trying to reach it by DNS rebinding. If you reach it by that name on purpose, start "
                f"the server with --allow-host {_hostname(host or '')} (or set {HOSTS_ENV})"
            )
            return await _refuse(send, path, 403, why, "host_not_allowed")
        cross = origin is not None and not (host and origin.rstrip("/").lower().endswith("//" + host.lower()))
        if origin is not None and not self.policy.origin_allowed(origin, host):
            why = (
                f"requests from the web page at {origin} are not allowed: only this server's own page and the "
                f"origins given with --allow-origin (or {ORIGINS_ENV}) may use it. To let that page in, start the "
                f"server with --allow-origin {origin}"
            )
            return await _refuse(send, path, 403, why, "origin_not_allowed")
        if method == "OPTIONS" and origin is not None and _header(scope, b"access-control-request-method"):
            return await _preflight(send, origin, _header(scope, b"access-control-request-headers"))
        if method in BODY_METHODS and not _is_json(_header(scope, b"content-type")):
            why = (
                f"the request body must be sent as JSON, with Content-Type: application/json (got "
                f"{_header(scope, b'content-type') or 'none'}); with curl add -H 'Content-Type: application/json'"
            )
            return await _refuse(send, path, 415, why, "unsupported_media_type")
        if not cross or origin is None:
            return await self.app(scope, receive, send)

        async def with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_cors)


async def _preflight(send: Callable, origin: str, asked: str | None) -> None:
    headers = [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", (asked or "authorization, content-type").encode("latin-1")),
        (b"access-control-max-age", PREFLIGHT_MAX_AGE.encode()),
        (b"vary", b"Origin"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(send: Callable, path: str, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(path, APIError(status, message, type="invalid_request_error", code=code))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
