"""Per-call generation settings, validated once so the loop never sees a bad value."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from fsd_local.kernels.accept import MODES
from fsd_local.kernels.divergence import DIVERGENCES, TOPK_DEFAULT
from fsd_local.errors import ConfigError

SPECULATIVE_MODES = ("fsd", "fsd-paper", "sd")


@dataclass(frozen=True)
class Settings:
    """Everything that may change between two calls on the same loaded pair.

    tau          divergence threshold for fuzzy acceptance; 0 = standard speculative decoding (lossless)
    mode         fsd | fsd-paper | sd | ar | draft-only (see README)
    divergence   js | kl | rkl | tv | topk-js | topk-kl | topk-tv | paper-js
    draft_max    k, tokens drafted per round (the upper bound when adaptive)
    draft_min    lower bound of k when adaptive
    draft_p_min  stop drafting when the draft's top probability falls below this (0 = off)
    adaptive     grow k by 2 after a fully accepted round, shrink by 1 after a rejection
    temperature  0 = greedy; top_k (0 = off), top_p (1 = off), min_p (0 = off) as usual
    ignore_eos   do not stop at the model's end-of-generation tokens (for benchmarks of a fixed length)
    """
    tau: float = 0.0
    mode: str = "fsd"
    divergence: str = "js"
    topk: int = TOPK_DEFAULT
    draft_max: int = 4
    draft_min: int = 1
    draft_p_min: float = 0.0
    adaptive: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # keep generating past end-of-generation tokens (benchmarks)

    def __post_init__(self):
        def bad(name, why):
            raise ConfigError(f"{name}={getattr(self, name)!r} {why}")

        def finite(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
                bad(name, "must be a finite number")

        for name in ("tau", "temperature", "top_p", "min_p", "draft_p_min"):
            finite(name)
        if self.tau < 0:
            bad("tau", "must be >= 0 (0 = lossless speculative decoding; larger accepts more draft tokens)")
        if self.mode not in MODES:
            bad("mode", f"is not a mode; choose one of {', '.join(MODES)}")
        if self.divergence not in DIVERGENCES:
            bad("divergence", f"is not a divergence; choose one of {', '.join(DIVERGENCES)}")
        if self.temperature < 0:
            bad("temperature", "must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            bad("min_p", "must be in [0, 1)")
        if not 0 <= self.draft_p_min < 1:
            bad("draft_p_min", "must be in [0, 1)")
        for name, lo in (("top_k", 0), ("draft_max", 1), ("draft_min", 1), ("max_tokens", 0), ("topk", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                bad(name, f"must be an integer >= {lo}")
        if self.draft_max > 64:
            bad("draft_max", "must be <= 64")
        if self.draft_min > self.draft_max:
            bad("draft_min", f"must be <= draft_max ({self.draft_max})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be a non-negative integer")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    def with_(self, **changes) -> "Settings":
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None or k == "seed"})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d
