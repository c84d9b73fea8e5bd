"""Messages -> prompt text with the target model's own chat template (GGUF `tokenizer.chat_template`).

Templates are Jinja (as in Hugging Face tokenizers); they run in a sandbox. A model without a template gets
ChatML, the most common format, and the caller is told (`ChatTemplate.is_fallback`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsd_local.errors import ConfigError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str
    is_fallback: bool = False

    @classmethod
    def from_model(cls, model) -> ChatTemplate:
        src = model.meta("tokenizer.chat_template")
        bos = model.token_text(model.bos).decode("utf-8", "replace") if model.bos >= 0 else ""
        eos = model.token_text(model.eos).decode("utf-8", "replace") if model.eos >= 0 else ""
        return cls(src or CHATML, bos, eos, is_fallback=not src)

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ConfigError(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")

        def raise_exception(msg):
            raise ConfigError(f"the model's chat template rejected the conversation: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            tmpl = env.from_string(self.source)
            return tmpl.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the model's chat template failed: {exc}") from None
