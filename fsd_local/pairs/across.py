"""Drafts across tokenizers among the models on this disk: for a target, the smaller models of another vocabulary,
each with what the vocabulary map carries (llama/vocab_map.py) or why it cannot (llama/vocab.py map_refusal).
Each model's vocabulary is read once per file and each map built once per pair of files (both kept on disk)."""

from __future__ import annotations

from dataclasses import dataclass

from fsd_local.errors import FSDError
from fsd_local.llama.vocab import choose_path, header_problem
from fsd_local.pairs.local import Listing, LocalModel

SIZE_RATIO_MAX = 0.5  # a draft of another family at most half the target's file
CANDIDATES = 3  # per target, the smallest few such models are mapped


@dataclass
class AcrossDraft:
    """A model of another vocabulary and what the map carries from it to the target (`share` of a probe text's
    draft tokens, `pieces` of its distinct pieces), the path it takes (map, text), or why it cannot (`problem`)."""

    name: str
    path: str
    size_bytes: int
    share: float | None = None
    pieces: float | None = None
    problem: str | None = None
    route: str | None = None  # "map" or "text" (llama/vocab.py choose_path)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "size_bytes": self.size_bytes,
            "probe_share": None if self.share is None else round(self.share, 4),
            "share_of_draft": None if self.pieces is None else round(self.pieces, 4),
            "problem": self.problem,
            "route": self.route,
        }

    def text(self) -> str:
        if self.problem:
            return f"{self.name} (not usable: {self.problem})"
        return (
            f"{self.name} ({self.route}: {self.pieces:.0%} of its pieces shared, {self.share:.0%} of a probe text "
            "carried)"
        )


def candidates(target: LocalModel, models: list[LocalModel]) -> list[LocalModel]:
    """The smallest CANDIDATES models of another vocabulary, at most SIZE_RATIO_MAX of the target's size."""
    if target.vocab is None or not target.size_bytes:
        return []
    fits = [
        m
        for m in models
        if m.vocab is not None
        and m.path
        and m.size_bytes
        and m.size_bytes <= SIZE_RATIO_MAX * target.size_bytes
        and header_problem(m.vocab, target.vocab) is not None
    ]
    return sorted(fits, key=lambda m: (m.size_bytes or 0, m.name))[:CANDIDATES]


def across_drafts(target: LocalModel, models: list[LocalModel]) -> list[AcrossDraft]:
    """What the map carries from each candidate to the target, the best share first."""
    from fsd_local.llama.vocab_map import map_between
    from fsd_local.llama.vocab_table import table_of

    out = []
    for m in candidates(target, models):
        assert m.path is not None and target.path is not None and m.size_bytes is not None
        a = AcrossDraft(m.path if m.also_in else m.name, m.path, m.size_bytes)
        try:
            vm = map_between(m.path, target.path)
            a.share, a.pieces = vm.probe_share, vm.share_of_draft
            route, a.problem = choose_path(vm, table_of(m.path), table_of(target.path))
            a.route = None if a.problem else route
        except (FSDError, OSError) as exc:  # a file llama.cpp cannot read: said, never raised from a listing
            a.problem = str(exc) or type(exc).__name__
        out.append(a)
    return sorted(out, key=lambda a: (a.problem is not None, -(a.share or 0.0), a.size_bytes))


def add_across(listing: Listing) -> Listing:
    """Fill each listed model's `across` (what `fsd-local models --local` shows)."""
    for m in listing.models:
        m.across = across_drafts(m, listing.models)
    return listing
