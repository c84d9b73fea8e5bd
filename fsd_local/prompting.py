"""The prompt contract of every EngineLike (an Engine, the server's Supervisor): a chat is rendered with the
target's template and never given a second BOS, a sampled reply's cached tokens are spliced back in, and ids
are checked against the pair's shared vocabulary and the contexts its models loaded."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fsd_local.conversation import splice_cached
from fsd_local.results import check_prompt_ids

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike
    from fsd_local.llama.chat_template import ChatTemplate


def template_ids(tokenize: Callable[[str, bool], list[int]], template: ChatTemplate, text: str) -> list[int]:
    """`text`, rendered by `template`, as token ids: the tokenizer adds BOS unless the template wrote it."""
    bos = template.bos_token
    return tokenize(text, not (bos and text.startswith(bos)))


def chat_ids(pair: EngineLike, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """A conversation as token ids ready for the reply, with the tokens the target holds where they spell it."""
    template = pair.chat_template()
    text = template.render(messages, add_generation_prompt=True)
    return splice(pair, template_ids(lambda t, special: pair.tokenize(t, add_special=special), template, text))


def splice(pair: EngineLike, ids: list[int]) -> list[int]:
    """`ids` continuing from the target's cached tokens where those are another split of the same text (a sampled
    reply's own: conversation.splice_cached)."""
    return splice_cached(ids, pair.cached_tokens(), pair.token_bytes)


def loaded_context(pair: EngineLike) -> int:
    """The context every model of the pair holds, as loaded (llama.cpp may round the requested one up)."""
    return min(m.n_ctx for m in (pair.target, pair.draft) if m is not None)


def checked_ids(pair: EngineLike, prompt: str | Sequence[int], n_ctx: int | None = None) -> list[int]:
    """The prompt as token ids inside the shared vocabulary, not empty, within `n_ctx` (default: the loaded
    context)."""
    tokens = pair.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    return check_prompt_ids(tokens, pair.n_vocab, loaded_context(pair) if n_ctx is None else n_ctx)
