"""OpenAI's wire format (docs/server.md, "The OpenAI API"): request bodies -> Settings and the prompt, validated
strictly (a wrong type is a 400, unknown fields are ignored, a field fsd-local cannot honour is refused unless it
holds its neutral value), and results -> OpenAI's response and chunk objects."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from fsd_local.errors import ConfigError, ContextOverflowError
from fsd_local.server.errors import APIError
from fsd_local.server.logprobs import TokenBytes, chat_logprobs, text_logprobs
from fsd_local.settings import FIELDS, Settings, field_type, spec

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike
    from fsd_local.results import Completion, Piece

# request fields that map one to one onto Settings, from the settings that declare an HTTP field (max_tokens is
# handled per endpoint: chat also has max_completion_tokens)
SETTING_FIELDS = tuple(f.name for f in FIELDS if spec(f).http and f.name != "max_tokens")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class Message(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (fsd_local/server/openai_tools.py)
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None


def _wire_type(kind: type) -> Any:
    return str | list[str] if kind is tuple else kind


# the standard sampling fields and fsd-local's own knobs, each optional (None = the server's default)
_SettingFields: Any = create_model(  # type: ignore[call-overload]  # fields built at run time
    "_SettingFields",
    __base__=_Strict,
    **{name: (_wire_type(field_type(f)) | None, None) for f in FIELDS if (name := f.name) in SETTING_FIELDS},
)


class _Request(_SettingFields):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    # accepted only at their neutral value (see _refuse_unsupported)
    n: int | None = None
    best_of: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, Any] | None = None  # {token id: bias}, as OpenAI's (Settings reads this form too)
    json_schema: dict[str, Any] | str | None = None  # llama.cpp's server field; response_format is OpenAI's
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]


def parse(kind: Literal["chat", "text"], body: bytes) -> ChatRequest | CompletionRequest:
    """Validate a request body; malformed JSON and wrong types become a 400 naming the field."""
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}", code="invalid_json") from None
        if not loc:
            raise APIError(400, f"the request body must be a JSON object: {err['msg']}", code="invalid_json") from None
        where = ".".join(str(part) for part in loc)
        raise APIError(400, f"{where}: {err['msg']}", param=str(loc[0]), code="invalid_type") from None
    _refuse_unsupported(req)
    return req


def _refuse_unsupported(req: _Request) -> None:
    def refuse(name: str, why: str) -> None:
        raise APIError(400, f"{name} is not supported by fsd-local: {why}", param=name, code="unsupported_parameter")

    for name in ("n", "best_of"):
        if getattr(req, name) not in (None, 1):
            refuse(name, "one completion per request (send several requests)")
    for name in (
        ("functions", "echo", "suffix") if isinstance(req, ChatRequest) else ("tools", "functions", "echo", "suffix")
    ):
        if getattr(req, name):  # None, 0, False, empty: the neutral value, accepted
            refuse(name, "use tools (chat completions)" if name == "functions" else "leave it unset")
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(
            400,
            f"response_format.type {kind!r} is not one of text, json_object, json_schema",
            param="response_format",
            code="invalid_value",
        )


def _response_schema(req: _Request) -> Any:
    """The JSON schema response_format asks for (None: plain text): json_object is any object."""
    fmt = req.response_format or {}
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
                code="invalid_value",
            )
        return schema
    return None


def settings_for(engine: EngineLike, req: ChatRequest | CompletionRequest) -> Settings:
    """The server's default settings with the request's overrides, validated; an error names the field at fault."""
    given: dict[str, Any] = {name: getattr(req, name) for name in SETTING_FIELDS if getattr(req, name) is not None}
    max_tokens = getattr(req, "max_completion_tokens", None)
    given["max_tokens"] = max_tokens if max_tokens is not None else req.max_tokens
    if given["max_tokens"] is None:
        del given["max_tokens"]
    given.update(_logprob_settings(req))
    schema = _response_schema(req)
    if schema is not None:
        given["json_schema"] = schema
    try:
        merged: Settings = engine.defaults.with_(**given)
    except ConfigError as exc:
        raise APIError(400, str(exc), param=_culprit(engine.defaults, given), code="invalid_value") from None
    try:
        merged.check_draft(engine.draft is not None)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="mode", code="invalid_value") from None
    try:
        merged.check_vocab(engine.n_vocab)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="logit_bias", code="invalid_value") from None
    return merged


def _logprob_settings(req: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """OpenAI's logprobs fields as Settings: chat has logprobs (bool) + top_logprobs (int), completions one
    logprobs (int: how many alternatives)."""
    lp, top = req.logprobs, req.top_logprobs
    if isinstance(req, ChatRequest):
        if lp is not None and not isinstance(lp, bool):
            raise APIError(
                400,
                "logprobs: true or false in chat completions (top_logprobs sets how many alternatives)",
                param="logprobs",
                code="invalid_type",
            )
        if top and not lp:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return {"logprobs": True, "top_logprobs": top or 0} if lp else {}
    if isinstance(lp, bool):
        raise APIError(
            400, "logprobs: the number of alternatives per token (0 to 20)", param="logprobs", code="invalid_type"
        )
    if top is not None:
        raise APIError(
            400,
            "top_logprobs belongs to chat completions; here logprobs is the number of alternatives",
            param="top_logprobs",
            code="unsupported_parameter",
        )
    if lp is not None and not 0 <= lp <= 20:
        raise APIError(400, f"logprobs={lp}: between 0 and 20 alternatives", param="logprobs", code="invalid_value")
    return {} if lp is None else {"logprobs": True, "top_logprobs": lp}


def _culprit(defaults: Settings, given: dict[str, Any]) -> str | None:
    """The first field that is invalid on its own (None: only the combination is, e.g. draft_min > draft_max)."""
    for name, value in given.items():
        try:
            defaults.with_(**{name: value})
        except ConfigError:
            return name
    return None


def prompt_tokens(engine: EngineLike, req: ChatRequest | CompletionRequest) -> list[int]:
    """The prompt as token ids (chat: rendered with the target's template), checked against the context."""
    if isinstance(req, ChatRequest):
        param = "messages"
        try:
            tokens = engine.chat_prompt([plain_message(i, m) for i, m in enumerate(req.messages)])
        except ConfigError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
    else:
        param = "prompt"
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400, "one prompt per request (send several requests)", param=param, code="unsupported_parameter"
                )
            prompt = prompt[0]
        tokens = prompt
    return check_prompt(engine, tokens, param)


def check_prompt(engine: EngineLike, tokens: Any, param: str) -> list[int]:
    """The engine's own checks of a prompt (vocabulary, empty, context length) as 400s naming `param`."""
    try:
        return engine.prompt_tokens(tokens)
    except ContextOverflowError as exc:
        raise APIError(400, f"{exc} (the server's --ctx)", param=param, code="context_length_exceeded") from None
    except ConfigError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def plain_message(i: int, m: Message) -> dict[str, str]:
    """{'role', 'content': str}: text parts are joined; anything else (images, audio) is refused."""
    content = m.content
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"messages.{i}.content: only text parts are supported, got {part.get('type')!r}",
                    param="messages",
                    code="unsupported_parameter",
                )
            texts.append(part["text"])
        content = "".join(texts)
    return {"role": ROLE_ALIASES.get(m.role, m.role), "content": content}


class Reply:
    """Builds the response objects of one request: a full response, or the chunks of a stream."""

    def __init__(self, kind: Literal["chat", "text"], model: str, token_bytes: TokenBytes | None = None):
        self.kind, self.model = kind, model
        self.token_bytes = token_bytes or (lambda t: b"")  # token id -> bytes, for logprobs' token strings
        self._offset = 0  # characters streamed so far (text_offset of legacy completions' logprobs)
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def full(self, c: Completion) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.token_ids, c.origins, c.logprobs, c.top_logprobs),
                "finish_reason": c.finish_reason,
            }
            out = self._envelope("chat.completion", [choice])
        else:
            lps = self._logprobs(c.token_ids, c.origins, c.logprobs, c.top_logprobs)
            out = self._envelope(
                "text_completion", [{"index": 0, "text": c.text, "logprobs": lps, "finish_reason": c.finish_reason}]
            )
        out["usage"] = usage(c)
        out["fsd"] = fsd_stats(c)
        return out

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope(
            "text_completion", [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
        )

    def piece_chunk(self, p: Piece) -> dict[str, Any]:
        """The chunk of one streamed piece: its text and, if asked for, its tokens' logprobs."""
        out = self.chunk(p.text)
        out["choices"][0]["logprobs"] = self._logprobs(p.token_ids, p.origins, p.logprobs, p.top_logprobs)
        return out

    def _logprobs(self, ids, origins, lps, tops) -> dict[str, Any] | None:
        if self.kind == "chat":
            return chat_logprobs(self.token_bytes, ids, origins, lps, tops)
        out = text_logprobs(self.token_bytes, ids, origins, lps, tops, self._offset)
        if out is not None and ids:
            self._offset = out["text_offset"][-1] + len(self.token_bytes(ids[-1]).decode("utf-8", "replace"))
        return out

    def last_chunk(self, c: Completion) -> dict[str, Any]:
        """The chunk carrying finish_reason; like llama.cpp's server, it also carries usage and the statistics."""
        out = self.chunk(finish_reason=c.finish_reason)
        out["usage"] = usage(c)
        out["fsd"] = fsd_stats(c)
        return out

    def usage_chunk(self, c: Completion) -> dict[str, Any]:
        """stream_options.include_usage: OpenAI's extra chunk with no choices and the usage."""
        out = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        out["usage"] = usage(c)
        return out


def usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(c.token_ids),
        "total_tokens": c.prompt_tokens + len(c.token_ids),
    }


def fsd_stats(c: Completion) -> dict[str, Any]:
    """The generation's statistics (docs/generation.md, "Statistics"), the settings it ran with, and why it stopped at
    'length' (finish_detail: max_tokens | context_full)."""
    return {**c.stats, "settings": c.settings, "finish_detail": c.finish_detail}
