"""Generation settings, declared once.

Each field of `Settings` carries its type, default, range, help text and where it is exposed: a command-line
flag (cli/options.py generates the click options), a field of the HTTP API (server/openai_schema.py generates
the request model), a chat slash command (cli/chat.py generates the commands and their help). A new setting is
one entry here. A `Settings` object is validated once, when it is made, and the engine takes it as it is.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from typing import Any

from fsd_local.errors import ConfigError
from fsd_local.kernels.names import (
    DIVERGENCES,
    DRAFT_POLICIES,
    DRAFTERS,
    MODES,
    RELAXED_K_DEFAULT,
    SPECULATIVE_MODES,
    TOPK_DEFAULT,
    TYPICAL_ALPHA_DEFAULT,
    TYPICAL_EPS_DEFAULT,
)

TAU_HELP = (
    "divergence threshold for fuzzy acceptance (the one knob of every lossy mode). 0 = standard speculative "
    "decoding (output exactly the target's); larger = more draft tokens accepted, faster, further from the "
    "target. With js, tau above ~0.35 can accept tokens the target would essentially never emit"
)
MODE_HELP = (
    "fsd: SD test first, fuzzy rescue when divergence <= tau (default). fsd-paper: the paper's rule "
    "(divergence only). sd: lossless speculative decoding. ar: target alone. draft-only: draft alone. "
    "Other rescues after a failed SD test (tau = 0: exactly sd): typical (Medusa: p(d) > 1 - tau (1 - "
    "min(eps, a exp(-H)))), cascade (p(d) >= (1 - tau) max p), relaxed (d in the target's top k and p(d) >= "
    "max p - tau), fsd-entropy (divergence <= tau (1 - exp(-H)), H the target's entropy)"
)
DIVERGENCE_HELP = (
    "js (Jensen-Shannon, <= ln2), kl KL(target||draft), rkl KL(draft||target), tv total variation, "
    "topk-js/topk-kl/topk-tv over the target's top-k tokens + one rest bin, paper-js (the reference "
    "code's JS formula, to reproduce the paper's taus)"
)


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


@dataclass(frozen=True)
class Settings:
    """Everything that may change between two calls on the same loaded pair (see each field's help)."""

    tau: float = setting(0.0, TAU_HELP, lo=0, cli="--tau", chat="tau")
    mode: str = setting("fsd", MODE_HELP, choices=MODES, cli="--mode", chat="mode")
    divergence: str = setting("js", DIVERGENCE_HELP, choices=DIVERGENCES, cli="--divergence", chat="divergence")
    divergence_topk: int = setting(
        TOPK_DEFAULT,
        "k of the topk-* divergences: the target's top-k tokens plus one bin for the rest (not sampling's --top-k)",
        lo=1,
        cli="--divergence-topk",
    )
    typical_eps: float = setting(
        TYPICAL_EPS_DEFAULT,
        "eps of the typical mode: Medusa's posterior_threshold, the cap of m = min(eps, a exp(-H))",
        lo=0,
        hi=1,
        hi_open=True,
        cli="--typical-eps",
    )
    typical_alpha: float = setting(
        TYPICAL_ALPHA_DEFAULT,
        "a of the typical mode: Medusa's posterior_alpha, in m = min(eps, a exp(-H))",
        lo=0,
        cli="--typical-alpha",
    )
    relaxed_k: int = setting(
        RELAXED_K_DEFAULT,
        "the relaxed mode rescues only draft tokens among the target's top k",
        lo=1,
        cli="--relaxed-k",
    )
    drafter: str = setting(
        "model",
        "who proposes the draft tokens: model (the draft GGUF), ngram (prompt lookup "
        "over the prompt and the output so far: free, needs no draft model; shines when the output "
        "repeats the input), ngram+model (lookup first, the draft model when nothing matches)",
        choices=DRAFTERS,
        cli="--drafter",
        chat="drafter",
    )
    draft_policy: str = setting(
        "auto",
        "how many tokens a round drafts: fixed (--draft-max), adaptive (+2 after a "
        "fully accepted round, -1 after a rejection), auto (the k in 0..--draft-max that "
        "maximises the measured tokens per second; 0 = a plain target step)",
        choices=DRAFT_POLICIES,
        cli="--draft-policy",
        chat="policy",
    )
    draft_max: int = setting(
        16,
        "tokens drafted per round (k; the upper bound of the adaptive and auto policies)",
        lo=1,
        hi=64,
        cli="--draft-max",
    )
    draft_min: int = setting(1, "smallest k of the adaptive policy", lo=1, hi=64, cli="--draft-min")
    ngram_min: int = setting(1, "shortest n-gram the ngram drafter matches", lo=1, hi=16, cli="--ngram-min")
    ngram_max: int = setting(
        3, "longest n-gram the ngram drafter matches (longer matches are tried first)", lo=1, hi=16, cli="--ngram-max"
    )
    draft_p_min: float = setting(
        0.0,
        "stop drafting when the draft's top probability falls below this (0 = off)",
        lo=0,
        hi=1,
        hi_open=True,
        cli="--draft-p-min",
    )
    adaptive: bool = setting(False, "the same as --draft-policy adaptive (kept for older scripts)", cli="--adaptive")
    temperature: float = setting(0.0, "sampling temperature, 0 = greedy", lo=0, cli="--temp", chat="temp")
    top_k: int = setting(0, "sample from the k most likely tokens (0 = off)", lo=0, cli="--top-k")
    top_p: float = setting(
        1.0,
        "nucleus sampling: the smallest set holding this much probability (1 = off)",
        lo=0,
        lo_open=True,
        hi=1,
        cli="--top-p",
    )
    min_p: float = setting(
        0.0,
        "drop tokens below this fraction of the top token's probability (0 = off)",
        lo=0,
        hi=1,
        hi_open=True,
        cli="--min-p",
    )
    seed: int | None = setting(None, "makes sampled runs reproducible", lo=0, cli="--seed")
    max_tokens: int = setting(256, "most tokens to generate", lo=0, cli="--max-tokens")
    stop: tuple[str, ...] = setting((), "stop string (repeatable)", cli="--stop")
    ignore_eos: bool = setting(
        False, "keep going past end-of-generation tokens (benchmarks of a fixed length)", cli="--ignore-eos", http=False
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        for f in fields(self):
            _check(f, getattr(self, f.name))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        if self.draft_min > self.draft_max:
            raise ConfigError(f"draft_min={self.draft_min} must be <= draft_max ({self.draft_max})")
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"ngram_min={self.ngram_min} must be <= ngram_max ({self.ngram_max})")
        if self.adaptive and self.draft_policy != "adaptive":  # the old flag is an alias of the policy
            object.__setattr__(self, "draft_policy", "adaptive")
        object.__setattr__(self, "adaptive", self.draft_policy == "adaptive")

    # ---------------------------------------------------------------- derived
    @property
    def needs_draft(self) -> bool:
        """Whether this mode uses the draft model (the one place that says so)."""
        return (self.mode in SPECULATIVE_MODES and self.drafter != "ngram") or self.mode == "draft-only"

    def check_draft(self, has_draft: bool) -> None:
        if self.needs_draft and not has_draft:
            raise ConfigError(f"mode {self.mode!r} needs a draft model; load one (--draft) or use mode 'ar'")

    # ---------------------------------------------------------------- changes
    def with_(self, **changes: Any) -> Settings:
        """A copy with some fields changed (None leaves a field as it is, except seed); validated."""
        changes = _aliases(changes)
        unknown = set(changes) - NAMES
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(NAMES))}")
        if changes.get("draft_policy") is not None and changes.get("adaptive") is None:
            changes["adaptive"] = changes["draft_policy"] == "adaptive"  # the policy named wins over the old flag
        return replace(self, **{k: v for k, v in changes.items() if v is not None or k == "seed"})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


ALIASES = {"topk": "divergence_topk"}  # old names still accepted


def _aliases(changes: dict[str, Any]) -> dict[str, Any]:
    return {ALIASES.get(k, k): v for k, v in changes.items()}


def spec(f: Field) -> Spec:
    return f.metadata["spec"]


def field_type(f: Field) -> type:
    """The Python type a field holds (None allowed for seed): float, int, bool, str or tuple."""
    if f.default is not MISSING:
        default = f.default
    else:
        factory = f.default_factory
        assert callable(factory), f"setting {f.name} has neither a default nor a default factory"
        default = factory()
    if f.name == "seed":
        return int
    return type(default)


def _check(f: Field, value: Any) -> None:
    name, s, kind = f.name, spec(f), field_type(f)

    def bad(why: str) -> None:
        raise ConfigError(f"{name}={value!r} {why}")

    if value is None and f.name == "seed":
        return
    if kind is bool:
        if not isinstance(value, bool):
            bad("must be true or false")
        return
    if kind is tuple:
        if not all(isinstance(v, str) for v in value):
            bad("must be strings")
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


FIELDS: tuple[Field, ...] = fields(Settings)
NAMES = frozenset(f.name for f in FIELDS)
