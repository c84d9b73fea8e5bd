"""Constrained output (a JSON schema or a GBNF grammar) through llguidance's token masks.

Why llguidance: it works on token masks computed from llama.cpp's own vocabulary (one bit per token, ~60 us per
mask on SmolLM2's 49,152 tokens), compiles JSON schemas and llama.cpp's GBNF (through its GBNF -> Lark
converter) to one grammar engine, and rolls back consumed tokens, which speculative decoding needs: the matcher
advances through a round's drafts and rolls back the rejected ones. (outlines-core has no GBNF; llama.cpp's
grammar sampler through llama-cpp-python cannot roll back, so every draft position would need a copy.)

A `Constraint` follows the accepted text of one generation: `mask(depth)` is the mask after the first `depth`
tokens pushed this round (masks are computed once per state and shared by the draft's and the target's rows),
`push` advances through a draft, `settle` keeps the accepted drafts and the emitted token. `forced` reads the
tokens the grammar alone decides from the current state (docs/design.md, "Forced tokens").
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import numpy as np

from fsd_local.errors import ConfigError
from fsd_local.schema_bounds import bound_schema

# compact JSON: small models left free to choose whitespace can spend a whole reply on it
JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of fsd-local
        raise ConfigError("grammar and json_schema need the llguidance package: pip install llguidance") from None
    return llguidance


@lru_cache(maxsize=32)  # Settings checks it when made, each generation compiles it again: once is enough
def compile_grammar(grammar: str | None, json_schema: str | None) -> str:
    """llguidance's grammar for a GBNF text or a JSON schema (text), checked: a clear error names the problem."""
    llg = _llguidance()
    if json_schema is not None:
        what = "json_schema"
        try:  # numbers and strings the schema leaves open are bounded (schema_bounds.py)
            bounded = json.dumps(bound_schema(json.loads(json_schema)))
            g = llg.LLMatcher.grammar_from_json_schema(bounded, defaults=JSON_OPTIONS)
        except ValueError as exc:  # json.JSONDecodeError is one
            raise ConfigError(f"json_schema is not usable: {exc}") from None
    else:
        from llguidance.gbnf_to_lark import any_to_lark

        what = "grammar"
        try:
            g = llg.LLMatcher.grammar_from_lark(any_to_lark(grammar or ""))
        except Exception as exc:  # the converter raises bare Exceptions for unknown rules and syntax errors
            raise ConfigError(f"grammar is not a valid GBNF grammar: {exc}") from None
    err = llg.LLMatcher.validate_grammar(g)
    if err and not err.startswith("WARNING"):
        raise ConfigError(f"{what} is not usable: {err}")
    return g


def tokenizer_for(model) -> Any:
    """llguidance's tokenizer of a loaded model's vocabulary, built once per model (~0.3 s)."""
    tok = getattr(model, "_llg_tokenizer", None)
    if tok is None:
        import warnings

        from llguidance.llamacpp import lltokenizer_from_vocab

        with warnings.catch_warnings():  # it reads token attributes through a deprecated llama-cpp-python name
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                tok = model._llg_tokenizer = lltokenizer_from_vocab(model.vocab)
            except ValueError as exc:  # e.g. a vocabulary without byte tokens: nothing can spell arbitrary text
                raise ConfigError(
                    f"this model's vocabulary cannot be used for a grammar or json_schema (llguidance: {exc}); "
                    "generate without the constraint"
                ) from None
    return tok


class Constraint:
    """A grammar matcher following one generation's text, with the masks of this round's states."""

    def __init__(self, model, grammar: str, n_vocab: int):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(tokenizer_for(model), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"the grammar cannot be used with this model: {self.matcher.get_error()}")
        self.n_words = (self.matcher_vocab(model) + 31) // 32
        self.masks = np.zeros((0, self.n_words), np.int32)
        self.depth = 0  # tokens pushed (consumed) this round (drafts not yet settled)
        self.idle = 0  # tokens pushed after the grammar's end (not consumed)
        self.known = 0  # masks computed this round: masks[j] is the mask after j pushed tokens

    @staticmethod
    def matcher_vocab(model) -> int:
        return int(tokenizer_for(model).vocab_size)

    def mask(self, depth: int) -> np.ndarray:
        """The mask of the state after `depth` tokens pushed this round (computed now if depth is the current one)."""
        depth = min(depth, self.depth) if self.finished else depth  # past the end: the end-only mask
        if depth >= self.known:
            assert depth == self.depth == self.known, "masks are computed in order, at the matcher's state"
            if self.masks.shape[0] <= depth:
                self.masks = np.resize(self.masks, (2 * depth + 2, self.n_words))
            row = self.masks[depth]
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self.known = depth + 1
        return self.masks[depth]

    def allows(self, depth: int, token: int) -> bool:
        return bool((int(self.mask(depth)[token >> 5]) >> (token & 31)) & 1)

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces from the current state: llguidance's fast-forward tokens (the
        forced bytes tokenised, less the trailing tokens a longer allowed token could absorb). Not pushed."""
        if limit <= 0 or self.finished:
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def push(self, token: int) -> None:
        """Advance through a draft token (allowed by the mask of the current state). Past the grammar's end only
        the end of the reply is allowed, and it is not consumed (llguidance cannot roll back over it)."""
        if self.finished:
            self.idle += 1
            return
        self.mask(self.depth)  # the target's row at this depth needs it too
        if not self.matcher.consume_token(int(token)):
            raise ConfigError(f"token {token} does not fit the grammar: {self.matcher.get_error()}")
        self.depth += 1

    def settle(self, accepted: int, token: int | None) -> None:
        """Keep the first `accepted` drafts, roll back the rest, consume the emitted token (None: nothing more)."""
        if self.depth > accepted:
            self.matcher.rollback(self.depth - accepted)
        if token is not None and not self.matcher.is_stopped():
            if not self.matcher.consume_token(int(token)):
                raise ConfigError(f"token {token} does not fit the grammar: {self.matcher.get_error()}")
        self.depth = self.known = self.idle = 0

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the reply ends here)."""
        return bool(self.matcher.is_stopped())
