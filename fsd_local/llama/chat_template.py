"""Messages -> prompt text with the model's own chat template (GGUF `tokenizer.chat_template`), rendered in a Jinja
sandbox with what transformers gives templates (`raise_exception`, `strftime_now`, a plain-JSON `tojson`, loop
controls); a model without a template gets ChatML, and `ChatTemplate.is_fallback` says so."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fsd_local.errors import ConfigError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@dataclass
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str
    is_fallback: bool = False
    _compiled: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_model(cls, model) -> ChatTemplate:
        src = model.meta("tokenizer.chat_template")
        bos = model.token_text(model.bos).decode("utf-8", "replace") if model.bos >= 0 else ""
        eos = model.token_text(model.eos).decode("utf-8", "replace") if model.eos >= 0 else ""
        return cls(src or CHATML, bos, eos, is_fallback=not src)

    @classmethod
    def of(cls, model) -> ChatTemplate:
        """The model's template, read once per loaded model."""
        tmpl = getattr(model, "_chat_template", None)
        if tmpl is None:
            tmpl = model._chat_template = cls.from_model(model)
        return tmpl

    def _template(self):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self._compiled is None:

            def raise_exception(msg):
                raise ConfigError(f"the model's chat template rejected the conversation: {msg}")

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            try:
                self._compiled = env.from_string(self.source)
            except jinja2.TemplateError as exc:
                raise ConfigError(f"the model's chat template failed: {exc}") from None
        return self._compiled

    def render(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        import jinja2

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ConfigError(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")
        try:
            return self._template().render(
                messages=list(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the model's chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # e.g. a template indexing what is missing
            raise ConfigError(f"the model's chat template failed on this conversation: {exc}") from None
