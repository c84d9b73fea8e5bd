"""`fsd-local bench --overhead`: the loop's own time per round and per draft token, for a pair and settings.

Wall time minus the time inside llama.cpp's calls, by phase and per call (docs/design.md, "Where the time goes")."""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

from fsd_local.stats import PHASES


@dataclass
class Overhead:
    """The loop's own seconds of one configuration, summed over its runs."""

    label: str
    rounds: int = 0
    drafted: int = 0
    tokens: int = 0
    wall: float = 0.0
    draft_decode: float = 0.0
    target_decode: float = 0.0
    draft: float = 0.0  # the drafting phase, draft decodes excluded
    verify: float = 0.0  # the verifying phase, the target's decode excluded
    policy: float = 0.0
    advance: float = 0.0
    carry: float | None = None  # a draft of another vocabulary: carrying its rows (the map's own cost)
    follow: float | None = None  # and following the text (its tokenising and comparing, decodes excluded)
    calls: list[tuple[float, int]] = field(default_factory=list)  # per repeat: (generate's own seconds, rounds)

    def add(self, stats: dict) -> None:
        ph, sec = stats["phase_seconds"], stats["seconds"]
        self.rounds += stats["rounds"]
        self.drafted += stats["drafted"]
        self.tokens += stats["tokens"]
        self.wall += stats["seconds_total"]
        self.draft_decode += sec["draft"]
        self.target_decode += sec["target"]
        if ph["verify"] > 0:  # speculative rounds: the phases hold the decodes
            self.draft += ph["draft"] - sec["draft"]
            self.verify += ph["verify"] - sec["target"]
        else:  # plain steps (ar): the round's own time is everything outside the decode and the bookkeeping
            self.verify += stats["seconds_total"] - sec["target"] - sec["draft"] - ph["advance"] - ph["policy"]
        self.policy += ph["policy"]
        self.advance += ph["advance"]

    @property
    def own(self) -> float:
        """Wall seconds outside llama.cpp's decodes."""
        return self.wall - self.draft_decode - self.target_decode

    def call(self, repeat: int, own: float, rounds: int) -> None:
        """One generate call's wall time outside llama.cpp's calls, counted to repeat `repeat`."""
        while len(self.calls) <= repeat:
            self.calls.append((0.0, 0))
        s, r = self.calls[repeat]
        self.calls[repeat] = (s + own, r + rounds)

    def row(self) -> dict:
        per_round = 1e6 / max(1, self.rounds)
        best = min((s * 1e6 / r for s, r in self.calls if r), default=None)
        return {
            "config": self.label,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "tokens": self.tokens,
            "own_us_per_round": self.own * per_round,
            "call_us_per_round_best": best,
            **{f"{p}_us_per_round": getattr(self, p) * per_round for p in PHASES},
            "map_us_per_round": None if self.carry is None else self.carry * per_round,
            "follow_us_per_round": None if self.follow is None else self.follow * per_round,
            "draft_us_per_draft_token": self.draft * 1e6 / self.drafted if self.drafted else None,
            "own_share_of_wall": self.own / self.wall if self.wall else None,
            "decode_ms_per_round": (self.draft_decode + self.target_decode) * 1e3 / max(1, self.rounds),
        }


def measure(engine, prompts: list[list[int]], configs: list[tuple[str, dict]], max_tokens: int, repeats: int = 1):
    """Run each (label, settings) on every prompt (token ids) `repeats` times, from an empty cache (an untimed
    short run of each first: kernels and caches warm); returns one Overhead row per configuration."""
    models = [m for m in (engine.target, engine.draft) if m is not None]
    across = engine.across
    rows = []
    for label, settings in configs:
        engine.reset()
        engine.generate(prompts[0], **{**settings, "max_tokens": 4})  # untimed: JIT cache, first decodes
        o = Overhead(label)
        if across is not None:
            o.carry, o.follow = -across.seconds, -across.follower.seconds
        for repeat in range(repeats):
            for p in prompts:
                engine.reset()
                inside = sum(m.decode_seconds for m in models)
                t = perf_counter()
                stats = engine.generate(p, **{**settings, "max_tokens": max_tokens}).stats
                wall = perf_counter() - t
                o.add(stats)
                o.call(repeat, wall - (sum(m.decode_seconds for m in models) - inside), stats["rounds"])
        if across is not None:
            o.carry, o.follow = o.carry + across.seconds, o.follow + across.follower.seconds
        rows.append(o.row())
    return rows


def format_rows(rows: list[dict]) -> str:
    cols = [
        ("config", 40, lambda r: r["config"]),
        ("rounds", 6, lambda r: str(r["rounds"])),
        ("own us/round", 12, lambda r: f"{r['own_us_per_round']:.0f}"),
        ("call us/round", 13, lambda r: _f(r["call_us_per_round_best"], ".0f")),
        ("draft", 7, lambda r: f"{r['draft_us_per_round']:.0f}"),
        ("verify", 7, lambda r: f"{r['verify_us_per_round']:.0f}"),
        ("policy", 7, lambda r: f"{r['policy_us_per_round']:.0f}"),
        ("advance", 7, lambda r: f"{r['advance_us_per_round']:.0f}"),
        ("map", 5, lambda r: _f(r["map_us_per_round"], ".0f")),
        ("follow", 6, lambda r: _f(r["follow_us_per_round"], ".0f")),
        ("us/draft tok", 12, lambda r: _f(r["draft_us_per_draft_token"], ".1f")),
        ("own share", 9, lambda r: f"{r['own_share_of_wall']:.1%}"),
        ("decode ms/round", 15, lambda r: f"{r['decode_ms_per_round']:.1f}"),
    ]
    lines = ["  ".join(h.rjust(w) for h, w, _ in cols)]
    lines += ["  ".join(cell(r).rjust(w) for _, w, cell in cols) for r in rows]
    return "\n".join(lines)


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)
