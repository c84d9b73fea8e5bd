"""Generation settings, declared once: each `Settings` field carries its type, default, range, help and where it is
exposed (CLI flag: cli/options.py, HTTP field: server/openai_schema.py, chat slash command: cli/chat.py).
A `Settings` is validated once, when it is made."""

from __future__ import annotations

import math
from dataclasses import Field, asdict, dataclass, fields, replace
from typing import Any, TypeVar

from fsd_local.errors import ConfigError
from fsd_local.kernels.names import (
    DIVERGENCES,
    DRAFT_POLICIES,
    DRAFTERS,
    MODES,
    RELAXED_K_DEFAULT,
    SPECULATIVE_MODES,
    TAU_MODES,
    TOPK_DEFAULT,
    TYPICAL_ALPHA_DEFAULT,
    TYPICAL_EPS_DEFAULT,
)
from fsd_local.setting_spec import Spec, check_value, field_type, json_text, parse_logit_bias, setting, spec

T = TypeVar("T")  # a model, as Settings.rewound passes them through

__all__ = ["FIELDS", "Settings", "Spec", "field_type", "spec"]  # Spec and its helpers live in setting_spec.py

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
BUDGET_HELP = (
    "quality budget B instead of tau: nats of the target's log-probability given up per emitted token, averaged "
    "over the reply (greedy: log p(target's top) - log p(emitted); sampled: docs/design.md 'The quality budget'). "
    "The engine moves the mode's threshold online and refuses any rescue that would take the reply above B, at every "
    "length. 0 = exactly sd; 'off' (none) = use tau"
)
DIVERGENCE_HELP = (
    "js (Jensen-Shannon, <= ln2), kl KL(target||draft), rkl KL(draft||target), tv total variation, "
    "topk-js/topk-kl/topk-tv over the target's top-k tokens + one rest bin, paper-js (the reference "
    "code's JS formula, to reproduce the paper's taus)"
)


@dataclass(frozen=True)
class Settings:
    """Everything that may change between two calls on the same loaded pair (see each field's help)."""

    tau: float = setting(0.0, TAU_HELP, lo=0, cli="--tau", chat="tau", sets_aside=("quality_budget", None, 0.0))
    quality_budget: float | None = setting(
        None,
        BUDGET_HELP,
        lo=0,
        cli="--quality-budget",
        chat="budget",
        kind=float,
        metavar="B",
        sets_aside=("tau", 0.0, None),
    )
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
    temperature: float = setting(
        0.0, "sampling temperature, 0 = greedy", lo=0, cli="--temp", chat="temp", chat_default=0.8
    )
    top_k: int = setting(0, "sample from the k most likely tokens (0 = off)", lo=0, cli="--top-k", chat_default=40)
    top_p: float = setting(
        1.0,
        "nucleus sampling: the smallest set holding this much probability (1 = off)",
        lo=0,
        lo_open=True,
        hi=1,
        cli="--top-p",
        chat_default=0.95,
    )
    min_p: float = setting(
        0.0,
        "drop tokens below this fraction of the top token's probability (0 = off)",
        lo=0,
        hi=1,
        hi_open=True,
        cli="--min-p",
        chat_default=0.05,
    )
    seed: int | None = setting(None, "makes sampled runs reproducible", lo=0, cli="--seed", kind=int)
    max_tokens: int = setting(256, "most tokens to generate", lo=0, cli="--max-tokens")
    stop: tuple[str, ...] = setting((), "stop string (repeatable)", cli="--stop")
    logprobs: bool = setting(
        False,
        "report the target's log-probability of each emitted token (log-softmax of the logits the acceptance rule "
        "saw, before temperature and truncation, as OpenAI's logprobs)",
        cli="--logprobs",
        http=False,  # the server maps OpenAI's own logprobs / top_logprobs fields (they differ per endpoint)
    )
    top_logprobs: int = setting(
        0,
        "also report this many most likely tokens at each position (implies --logprobs)",
        lo=0,
        hi=20,
        cli="--top-logprobs",
        http=False,
    )
    context_shift: bool = setting(
        False,
        "chat: when the conversation outgrows the context and the oldest turns are dropped, cut them out of both "
        "KV caches instead of evaluating the kept turns again (faster; as llama.cpp's context shift, the kept "
        "entries were computed with the dropped turns present, so the reply can differ from a fresh evaluation)",
        cli="--context-shift",
        http=False,  # the server does not drop turns: a request that does not fit gets 400
    )
    ignore_eos: bool = setting(
        False, "keep going past end-of-generation tokens (benchmarks of a fixed length)", cli="--ignore-eos", http=False
    )
    # the sampling chain (fsd_local/chain.py): the same processing on the draft's and the target's rows
    repeat_penalty: float = setting(
        1.0,
        "divide the logit of each token seen in the last --repeat-last-n tokens by this when positive, multiply "
        "when negative (llama.cpp's repeat penalty; 1 = off)",
        lo=0,
        lo_open=True,
        cli="--repeat-penalty",
        chat="repeat",
        chat_default=1.1,
    )
    repeat_last_n: int = setting(
        64,
        "how many of the text's last tokens (prompt and reply) the penalties look at (0 = off, -1 = all)",
        lo=-1,
        cli="--repeat-last-n",
    )
    presence_penalty: float = setting(
        0.0,
        "lower the logit of every token seen in the window by this (OpenAI's presence_penalty)",
        lo=-2,
        hi=2,
        cli="--presence-penalty",
        chat="presence",
    )
    frequency_penalty: float = setting(
        0.0,
        "lower the logit of each token seen in the window by this times its count (OpenAI's frequency_penalty)",
        lo=-2,
        hi=2,
        cli="--frequency-penalty",
        chat="frequency",
    )
    logit_bias: tuple[tuple[int, float], ...] = setting(
        (),
        "add BIAS to the logit of token TOKEN_ID, e.g. 15043+1 or 15043-inf (bans it); repeatable. API: a "
        "{token_id: bias} object, as OpenAI's logit_bias",
        cli="--logit-bias",
        metavar="TOKEN_ID(+|-)BIAS",
        parse=lambda v: parse_logit_bias(v),
    )
    grammar: str | None = setting(
        None,
        "a GBNF grammar (llama.cpp's format) the reply must follow; on the command line, the file holding it",
        kind=str,
        cli="--grammar-file",
        cli_file=True,
        metavar="FILE",
    )
    json_schema: str | None = setting(
        None,
        "a JSON schema the reply must be an instance of (a JSON object or its text); on the command line, the "
        "file holding it",
        kind=str,
        cli="--json-schema",
        cli_file=True,
        metavar="FILE",
        parse=lambda v: json_text(v),
    )
    jump_forward: bool = setting(
        True,
        "under a grammar, a JSON schema or a tool call, propose the tokens the grammar forces (keys, braces, the "
        "rest of a literal once begun) as free drafts the target verifies in one batch, like any draft: the output "
        "follows the same distribution with it off (greedy: the same tokens), in fewer target calls",
        cli="--jump-forward",
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        for f in fields(self):
            parse = spec(f).parse
            if parse is not None and getattr(self, f.name) is not None:
                object.__setattr__(self, f.name, parse(getattr(self, f.name)))
            check_value(f, getattr(self, f.name))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        if self.draft_min > self.draft_max:
            raise ConfigError(f"draft_min={self.draft_min} must be <= draft_max ({self.draft_max})")
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"ngram_min={self.ngram_min} must be <= ngram_max ({self.ngram_max})")
        if self.adaptive and self.draft_policy != "adaptive":  # the old flag is an alias of the policy
            object.__setattr__(self, "draft_policy", "adaptive")
        object.__setattr__(self, "adaptive", self.draft_policy == "adaptive")
        if self.quality_budget is not None:
            if self.tau > 0:
                raise ConfigError(
                    f"tau={self.tau:g} and quality_budget={self.quality_budget:g} are both set: the budget moves "
                    "the threshold itself; set one of them (tau 0, or quality_budget off)"
                )
            if self.mode not in TAU_MODES:
                raise ConfigError(
                    f"quality_budget needs a lossy mode ({', '.join(TAU_MODES)}); mode {self.mode!r} has no "
                    "threshold to move (sd is quality_budget 0)"
                )
        object.__setattr__(self, "logprobs", self.logprobs or self.top_logprobs > 0)
        if self.logprobs and self.mode == "draft-only":
            raise ConfigError(
                "logprobs are the target's log-probabilities, and mode draft-only does not run the target; "
                "use another mode or leave logprobs off"
            )
        self._check_constraint()

    def _check_constraint(self) -> None:
        """A grammar or a schema (not both), compiled now so that a bad one is refused before any generation."""
        if self.grammar is None and self.json_schema is None:
            return
        if self.grammar is not None and self.json_schema is not None:
            raise ConfigError("give a grammar or a json_schema, not both")
        if self.ignore_eos:
            raise ConfigError("ignore_eos cannot be combined with a grammar or a json_schema (the reply ends with it)")
        from fsd_local.constrain import compile_grammar  # llguidance, only when a constraint is given

        compile_grammar(self.grammar, self.json_schema)

    # ---------------------------------------------------------------- derived
    @property
    def needs_draft(self) -> bool:
        """Whether this mode uses the draft model (the one place that says so)."""
        return (self.mode in SPECULATIVE_MODES and self.drafter != "ngram") or self.mode == "draft-only"

    def rewound(self, target: T, draft: T | None) -> list[T]:
        """The models this mode rewinds within a reply (after a rejection): a speculative mode's target, and its
        draft where it drafts with one."""
        if self.mode not in SPECULATIVE_MODES:
            return []
        return [target, draft] if draft is not None and self.needs_draft else [target]

    def check_draft(self, has_draft: bool) -> None:
        if self.needs_draft and not has_draft:
            raise ConfigError(f"mode {self.mode!r} needs a draft model; load one (--draft) or use mode 'ar'")

    # ---------------------------------------------------------------- changes
    def with_(self, **changes: Any) -> Settings:
        """A copy with some fields changed (None leaves a field as it is, except for the settings whose None means
        off: seed, quality_budget); validated."""
        changes = _aliases(changes)
        unknown = set(changes) - NAMES
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(NAMES))}")
        if changes.get("draft_policy") is not None and changes.get("adaptive") is None:
            changes["adaptive"] = changes["draft_policy"] == "adaptive"  # the policy named wins over the old flag
        changes = {k: v for k, v in changes.items() if v is not None or k in OPTIONAL}
        # two settings that exclude each other (tau, quality_budget): turning one on sets the other aside, unless
        # the same change sets both (then __post_init__ says they are both set)
        for name, value in list(changes.items()):
            aside = spec(FIELD[name]).sets_aside
            if aside is not None and value != aside[2] and aside[0] not in changes:
                changes[aside[0]] = aside[1]
        return replace(self, **changes)

    def check_vocab(self, n_vocab: int) -> None:
        """Token ids the settings name must be in the model's vocabulary."""
        for t, _ in self.logit_bias:
            if t >= n_vocab:
                raise ConfigError(f"logit_bias names token {t}, outside the vocabulary (ids 0..{n_vocab - 1})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        # OpenAI's {token id: bias} form, strict JSON (a ban is the text "-inf"); Settings(**d) reads it back
        d["logit_bias"] = {str(t): (b if math.isfinite(b) else "-inf") for t, b in self.logit_bias}
        return d


ALIASES = {"topk": "divergence_topk"}  # old names still accepted


def _aliases(changes: dict[str, Any]) -> dict[str, Any]:
    return {ALIASES.get(k, k): v for k, v in changes.items()}


# `fsd-local serve`: requests that may wait behind the running one before more get 503 (docs/server.md, "Load,
# faults and crashes"): a desktop app with many tabs or agents queues dozens; Ollama's default holds 512
SERVER_MAX_QUEUE = 512
# `fsd-local serve --parallel`'s default: slots (requests generated at once, batched in each round), where the
# shared context (--n-ctx) gives each at least SERVER_SLOT_CONTEXT tokens; llama-server's default is also 4
SERVER_PARALLEL = 4
SERVER_SLOT_CONTEXT = 1024

FIELDS: tuple[Field, ...] = fields(Settings)
NAMES = frozenset(f.name for f in FIELDS)
FIELD = {f.name: f for f in FIELDS}
OPTIONAL = frozenset(f.name for f in FIELDS if spec(f).kind is not None)  # None = off
# `fsd-local chat` samples like other runtimes' chat defaults (llama.cpp's temperature, top-k, top-p, min-p);
# generate, bench, the server and the Python API stay greedy
CHAT_DEFAULTS: dict[str, Any] = {f.name: d for f in FIELDS if (d := spec(f).chat_default) is not None}


def chat_sampling(defaults: Settings) -> dict[str, Any]:
    """CHAT_DEFAULTS over a server's defaults: chat's value of each of those settings where `defaults` holds the
    built-in one, else the value the server was given (`fsd-local serve --temp 0.3` wins). What the chat page and
    Ollama's API start from (docs/server.md, "Defaults")."""
    out = {}
    for name, chat_value in CHAT_DEFAULTS.items():
        value = getattr(defaults, name)
        out[name] = chat_value if value == FIELD[name].default else value
    return out
