"""Ollama's wire format (docs/server.md, "Ollama's API"): /api/chat and /api/generate bodies -> the OpenAI request
they mean (its `options` through the settings' declarations and Ollama's names for them), so both APIs share one
path from there, and results -> Ollama's NDJSON objects with its counters."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from fsd_local.results import Completion, Piece
from fsd_local.server.errors import APIError
from fsd_local.server.logprobs import TokenBytes, chat_logprobs
from fsd_local.server.openai_schema import SETTING_FIELDS, ChatRequest, CompletionRequest, fsd_stats, parse
from fsd_local.settings import FIELD, Settings, chat_sampling

# the version of Ollama's API these routes follow (clients check it: VS Code's needs at least 0.6.4)
OLLAMA_VERSION = "0.12.0"
RENAMED = {"num_predict": "max_tokens"}  # Ollama's names of settings
OPTION_SETTINGS = frozenset(SETTING_FIELDS) | {"max_tokens"}  # every setting a request may carry, by its own name
# how to load or run a model: the pair is loaded already (--ctx, --gpu-layers, --threads at start)
RUNNER_OPTIONS = frozenset(
    "numa num_batch num_gpu main_gpu low_vram f16_kv logits_all vocab_only use_mmap use_mlock embedding_only "
    "num_thread num_keep penalize_newline mirostat_tau mirostat_eta".split()
)
OFF = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}  # samplers fsd-local does not have, at their off value


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class OllamaMessage(_Strict):
    role: str
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class _Body(_Strict):
    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool | None = None  # None: true, Ollama's default
    keep_alive: str | int | float | None = None  # accepted: the pair stays loaded while the server runs
    think: bool | str | None = None
    images: list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(_Body):
    messages: list[OllamaMessage] = []
    tools: list[Any] | None = None


class GenerateBody(_Body):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False


@dataclass
class Translated:
    """An Ollama request as the OpenAI request it means, and what only the Ollama route needs."""

    request: ChatRequest | CompletionRequest
    kind: Literal["chat", "text"]
    num_ctx: int | None = None  # the request's own, smaller context (None: the server's)
    ignored: list[str] = field(default_factory=list)  # options with no effect here
    empty: bool = False  # no prompt: Ollama's way to load a model; answered at once (done_reason "load")


def parse_body(kind: Literal["chat", "text"], raw: bytes) -> ChatBody | GenerateBody:
    model = ChatBody if kind == "chat" else GenerateBody
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}") from None
        if not err["loc"]:
            raise APIError(400, f"the request body must be a JSON object: {err['msg']}") from None
        where = ".".join(str(part) for part in err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"{where} is required") from None
        raise APIError(400, f"{where}: {err['msg']}") from None


def translate(body: ChatBody | GenerateBody, defaults: Settings, n_ctx: int) -> Translated:
    """The OpenAI request an Ollama body means: its options and format as request fields, over the Ollama
    routes' defaults (chat's sampling, replies up to the context's end: Ollama's num_predict -1)."""
    _refuse_unsupported(body)
    fields: dict[str, Any] = route_defaults(defaults, n_ctx)
    options = dict(body.options or {})
    choice = options.pop("tool_choice", None)  # fsd-local's extension: Ollama's API has no tool_choice
    given, where, num_ctx, ignored = _options(options, n_ctx)
    fields.update(given)
    fields["model"], fields["stream"] = body.model, body.stream is not False
    fmt = _format(body.format)
    if fmt is not None:
        fields["response_format"] = fmt
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true")
    if isinstance(body, ChatBody):
        kind: Literal["chat", "text"] = "chat"
        fields["messages"] = [_message(i, m) for i, m in enumerate(body.messages)]
        if body.tools:  # the OpenAI route's tools field: one path for both APIs
            fields["tools"] = body.tools
        if choice is not None:  # auto | none | required | a function's name
            named = isinstance(choice, str) and choice not in ("auto", "none", "required")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice}} if named else choice
        empty = not body.messages
    elif body.raw:
        kind, fields["prompt"], empty = "text", body.prompt, not body.prompt
    else:  # Ollama renders a generate prompt with the model's template, as one user turn
        kind, empty = "chat", not body.prompt
        system = [{"role": "system", "content": body.system}] if body.system else []
        fields["messages"] = [*system, {"role": "user", "content": body.prompt}]
    if body.logprobs:  # OpenAI's fields for them differ between chat and completions
        if kind == "chat":
            fields["logprobs"], fields["top_logprobs"] = True, body.top_logprobs or 0
        else:
            fields["logprobs"] = body.top_logprobs or 0
    try:
        request = parse(kind, json.dumps(fields).encode())
    except APIError as exc:  # name the field as the client sent it
        name = where.get(exc.param or "")
        if name and exc.message.startswith(exc.param or ""):
            exc.message = name + exc.message[len(exc.param or "") :]
        raise
    return Translated(request, kind, num_ctx, ignored, empty)


def route_defaults(defaults: Settings, n_ctx: int) -> dict[str, Any]:
    """The Ollama routes' defaults over the server's: chat's sampling (Ollama's own defaults are sampled too) and
    no reply limit but the context, unless the server was started with other values."""
    out = chat_sampling(defaults)
    out["max_tokens"] = n_ctx if defaults.max_tokens == FIELD["max_tokens"].default else defaults.max_tokens
    return out


def _refuse_unsupported(body: ChatBody | GenerateBody) -> None:
    if body.think not in (None, False, "", "none"):
        raise APIError(400, f"{body.model!r} does not support thinking: leave think unset or false")
    images = body.images or ([i for m in body.messages for i in (m.images or [])] if isinstance(body, ChatBody) else [])
    if images:
        raise APIError(400, f"{body.model!r} reads text only (no vision): send the request without images")
    if isinstance(body, GenerateBody):
        if body.suffix:
            raise APIError(400, f"{body.model!r} does not support insert (suffix): send the prompt alone")
        if body.template:
            raise APIError(
                400,
                "template is not supported: the prompt is rendered with the model's own chat template; send raw: "
                "true with a prompt you formatted yourself",
            )
        if body.context:
            raise APIError(400, "context is not supported: send the conversation to /api/chat as messages")


def _options(options: dict[str, Any], n_ctx: int) -> tuple[dict[str, Any], dict[str, str], int | None, list[str]]:
    """(request fields, field -> the option's name, num_ctx, ignored options)."""
    given: dict[str, Any] = {}
    where: dict[str, str] = {}
    ignored: list[str] = []
    num_ctx = None
    for key, value in options.items():
        name = RENAMED.get(key, key)
        if key == "num_ctx":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise APIError(400, f"options.num_ctx={value!r} must be a whole number of tokens >= 1")
            num_ctx = value if value < n_ctx else None  # a larger one: the server's --ctx is what there is
        elif key in OFF:
            if value != OFF[key]:
                raise APIError(400, f"options.{key}={value!r} is not supported by fsd-local: leave it unset")
        elif name in OPTION_SETTINGS:
            if name == "max_tokens" and isinstance(value, int) and not isinstance(value, bool) and value < 0:
                value = n_ctx  # -1 (no limit), -2 (fill the context): up to the context's end
            if name == "seed" and isinstance(value, int) and value < 0:
                value = None  # Ollama's -1: a random seed
            given[name], where[name] = value, f"options.{key}"
        else:
            ignored.append(key)
    return {k: v for k, v in given.items() if v is not None}, where, num_ctx, ignored


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's format as OpenAI's response_format: "json" is any object, an object is a JSON schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise APIError(400, f'format must be "json" or a JSON schema object, not {fmt!r}')


def _message(i: int, m: OllamaMessage) -> dict[str, Any]:
    """One Ollama message as OpenAI's (its tool calls with their arguments as JSON text, as OpenAI's are)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": f"c{i:05d}{j:03d}",  # 9 letters and digits: what Mistral's templates require
                "type": "function",
                "function": {
                    "name": (call.get("function") or {}).get("name"),
                    "arguments": json.dumps((call.get("function") or {}).get("arguments") or {}),
                },
            }
            for j, call in enumerate(m.tool_calls)
        ]
    if m.tool_name:
        out["name"] = m.tool_name
    return out


def created_at() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class OllamaReply:
    """The NDJSON objects of one /api/chat or /api/generate answer."""

    def __init__(
        self,
        route: Literal["chat", "generate"],
        model: str,
        started: float,
        ignored: list[str],
        token_bytes: TokenBytes | None = None,
    ):
        self.route, self.model, self.started, self.ignored = route, model, started, ignored
        self.token_bytes = token_bytes or (lambda t: b"")

    def chunk(self, text: str, tokens: Piece | Completion | None = None) -> dict[str, Any]:
        """An object with `text`; with the log-probabilities of `tokens` when the request asked for them (each
        {"token", "logprob", "bytes", "top_logprobs", "origin"}, as OpenAI's chat entries)."""
        out: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.route == "chat":
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        if tokens is not None and tokens.logprobs is not None:
            lps = chat_logprobs(
                self.token_bytes, tokens.token_ids, tokens.origins, tokens.logprobs, tokens.top_logprobs
            )
            out["logprobs"] = (lps or {}).get("content", [])
        out["done"] = False
        return out

    def final(self, c: Completion, text: str = "", whole: bool = False) -> dict[str, Any]:
        """The last object: done, why, Ollama's counters (nanoseconds) and fsd-local's statistics (`whole`: the
        answer in one object, with its text's log-probabilities)."""
        out = self.chunk(text, c if whole else None)
        stats = c.stats
        out.update(
            done=True,
            done_reason=c.finish_reason,
            total_duration=_ns(time.perf_counter() - self.started),
            load_duration=0,  # the pair was loaded when the server started
            prompt_eval_count=c.prompt_tokens,
            prompt_eval_duration=_ns(stats.get("prompt_seconds", 0.0)),
            eval_count=len(c.token_ids),
            eval_duration=_ns(stats.get("seconds_total", 0.0)),
            fsd={**fsd_stats(c), "ignored_options": self.ignored},
        )
        return out

    def loaded(self) -> dict[str, Any]:
        """The answer to a request without a prompt (Ollama's way to load a model): it is loaded."""
        out = self.chunk("")
        out.update(done=True, done_reason="load")
        return out


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
