"""How one setting is declared (`Spec`, `setting`), parsed and checked: the machinery under settings.py, whose
`Settings` declares the fields themselves."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field
from typing import Any

from fsd_local.errors import ConfigError


@dataclass(frozen=True)
class Spec:
    """How one setting is checked and exposed. Bounds are inclusive unless marked open."""

    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] | None = None
    cli: str | None = None  # the flag; None = not on the command line
    http: bool = True  # a field of the OpenAI API's request body
    chat: str | None = None  # the slash command that sets it in `fsd-local chat`
    metavar: str | None = None
    kind: type | None = None  # the type of a setting whose default is None (None = off)
    # (other setting, its off value, this setting's off value): setting this one on turns the other off (with_)
    sets_aside: tuple[str, Any, Any] | None = None
    chat_default: float | None = None  # `fsd-local chat`'s default, where it differs (docs/chat.md, "Defaults")
    cli_file: bool = False  # the flag names a file; its text is the value
    parse: Callable[[Any], Any] | None = None  # brings the accepted input forms to the one stored (or ConfigError)

    def range_text(self) -> str:
        lo = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        hi = "" if self.hi is None else f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return " and ".join(x for x in (lo, hi) if x)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A Settings field: its default and its Spec (help, range, exposure)."""
    meta = {"spec": Spec(help=help, **spec)}
    if isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


def spec(f: Field) -> Spec:
    return f.metadata["spec"]


def field_type(f: Field) -> type:
    """The Python type a field holds (None also allowed where Spec.kind is set): float, int, bool, str or tuple."""
    if f.default is not MISSING:
        default = f.default
    else:
        factory = f.default_factory
        assert callable(factory), f"setting {f.name} has neither a default nor a default factory"
        default = factory()
    kind = spec(f).kind
    return kind if kind is not None else type(default)


def check_value(f: Field, value: Any) -> None:
    """Type and range of one field's value (None passes for a field whose None means off)."""
    name, s, kind = f.name, spec(f), field_type(f)

    def bad(why: str) -> None:
        raise ConfigError(f"{name}={value!r} {why}")

    if value is None and spec(f).kind is not None:
        return
    if kind is bool:
        if not isinstance(value, bool):
            bad("must be true or false")
        return
    if kind is tuple:
        if s.parse is None and not all(isinstance(v, str) for v in value):
            bad("must be strings")
        return
    if kind is str and not s.choices:
        if not isinstance(value, str):
            bad("must be text")
        return
    if kind is str:
        if value not in (s.choices or ()):
            bad(f"is not a {name}; choose one of {', '.join(s.choices or ())}")
        return
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        bad(f"must be an integer {s.range_text()}".rstrip())
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        bad("must be a finite number")
    too_low = s.lo is not None and (value <= s.lo if s.lo_open else value < s.lo)
    too_high = s.hi is not None and (value >= s.hi if s.hi_open else value > s.hi)
    if too_low or too_high:
        hint = {
            "tau": " (0 = lossless speculative decoding; larger accepts more draft tokens)",
            "temperature": " (0 = greedy)",
        }.get(name, "")
        bad(f"must be {s.range_text()}{hint}")


_BIAS = re.compile(r"\s*(\d+)\s*([+-]\s*(?:inf|\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+))\s*", re.IGNORECASE)


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token: bias} (OpenAI's form; keys may be strings), 'ID+BIAS' / 'ID-BIAS' strings (llama.cpp's flag) or
    (id, bias) pairs, as sorted (id, bias) pairs. A bias is a finite number or -inf (bans the token)."""

    def bad(item: Any, why: str) -> ConfigError:
        return ConfigError(f"logit_bias {item!r} {why}")

    items: list[Any]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str):
        items = [value]
    else:
        items = list(value)
    out: dict[int, float] = {}
    for item in items:
        if isinstance(item, str):
            m = _BIAS.fullmatch(item)
            if not m:
                raise bad(item, "is not TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043+1.5, 15043-inf)")
            item = (m.group(1), m.group(2).replace(" ", ""))
        try:
            tok, b = item
            tok = int(tok) if not isinstance(tok, bool) and str(tok).strip().isdigit() else None
            bias = float(b) if not isinstance(b, bool) else math.nan
        except (TypeError, ValueError):
            raise bad(item, "is not a (token id, bias) pair") from None
        if tok is None:
            raise bad(item, "needs a token id, a whole number >= 0")
        if math.isnan(bias) or bias == math.inf:
            raise bad(item, "needs a bias that is a finite number or -inf")
        out[tok] = bias
    return tuple(sorted(out.items()))


def json_text(value: Any) -> str:
    """A JSON schema (a dict or its text) as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"json_schema is not valid JSON ({exc}); give a JSON schema object") from None
    if not isinstance(value, dict):
        raise ConfigError(f"json_schema must be a JSON object (a schema), not {type(value).__name__}")
    return json.dumps(value)
