"""The drafts on disk for a target, of any family, ranked by the speed-up the cost model expects of each: its
acceptance prior (one tokenizer, or another family's times the share the map carries) against its size ratio
(docs/design.md, "Choosing a draft")."""

from __future__ import annotations

from dataclasses import dataclass

from fsd_local.drafting.cost_model import ACCEPT_PRIOR_FIRST, expected_rates
from fsd_local.drafting.verify_cost import VERIFY_SLOPE_PRIOR
from fsd_local.pairs.across import AcrossDraft, across_drafts
from fsd_local.pairs.local import Listing, LocalModel, drafts_for, size_text

K_MAX = 8
ACCEPT_SAME = ACCEPT_PRIOR_FIRST  # a draft of the target's tokenizer: `auto`'s cold-start prior
# a draft of another family: SmolLM2-135M drafting for Gemma 3 270M emitted 1.58 tokens a target call at k 4 through
# the map (docs/measurements/across-pair.md), a per-position acceptance of about 0.37 at a 97% probe share
ACCEPT_OTHER = 0.38
TEXT_SHARE = 0.9  # the text path carries what the draft writes, whatever the map shares; its boundaries cost some


@dataclass
class Ranked:
    """A draft for a target: its `path` (same, map, text), the `share` of a probe text it carries, its file's
    `ratio` to the target's, and the `speedup` the cost model expects at its prior acceptance."""

    model: LocalModel
    path: str
    share: float
    ratio: float
    speedup: float

    @property
    def name(self) -> str:
        return self.model.path if self.model.also_in and self.model.path else self.model.name

    def how(self) -> str:
        """The path and the expectation in words: "another tokenizer (map, 97% carried); ~1.20x expected"."""
        across = "" if self.path == "same" else f"another tokenizer ({self.path}, {self.share:.0%} carried); "
        return f"{across}~{self.speedup:.2f}x expected"

    def text(self) -> str:
        return f"{self.name} [{size_text(self.model.size_bytes)}; {self.how()}]"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "share": round(self.share, 4),
            "size_ratio": round(self.ratio, 4),
            "expected_speedup": round(self.speedup, 3),
        }


def expected_speedup(accept: float, ratio: float, k_max: int = K_MAX) -> float:
    """The best rate over k of a draft accepting `accept` a position at `ratio` of a target step a token, over
    plain decoding's, on the prior verification curve (VERIFY_SLOPE_PRIOR a token past the first)."""
    curve = [0.0] + [1.0 + VERIFY_SLOPE_PRIOR * (n - 1) for n in range(1, k_max + 2)]
    rates = expected_rates([accept] * k_max, ratio, curve)
    return max(rates) / rates[0]


def _ratio(draft: LocalModel, target: LocalModel) -> float:
    return (draft.size_bytes or 0) / max(target.size_bytes or 1, 1)


def rank(target: LocalModel, models: list[LocalModel], across: list[AcrossDraft] | None = None) -> list[Ranked]:
    """Every model that can draft for `target`, the highest expected speed-up first (then the smaller file);
    `across`: across_drafts(target, models) where already known."""
    out = []
    for m in drafts_for(target, models):
        r = _ratio(m, target)
        out.append(Ranked(m, "same", 1.0, r, expected_speedup(ACCEPT_SAME, r)))
    by_path = {m.path: m for m in models}
    for a in across_drafts(target, models) if across is None else across:
        found = by_path.get(a.path)
        if a.problem is None and a.route is not None and found is not None:
            share = a.share if a.route == "map" and a.share is not None else TEXT_SHARE
            r = _ratio(found, target)
            out.append(Ranked(found, a.route, share, r, expected_speedup(ACCEPT_OTHER * share, r)))
    return sorted(out, key=lambda x: (-x.speedup, x.ratio))


def best(ranked: list[Ranked]) -> Ranked | None:
    """The draft to load for a target given alone: the first ranked of its own tokenizer, or of another family
    where the cost model expects it to pay (its acceptance is lower and less certain)."""
    return next((r for r in ranked if r.path == "same" or r.speedup > 1.0), None)


def add_ranking(listing: Listing) -> Listing:
    """Fill each listed model's `across` and `ranked` (what `fsd-local models --local` shows)."""
    for m in listing.models:
        m.across = across_drafts(m, listing.models)
        m.ranked = rank(m, listing.models, m.across)
    return listing
