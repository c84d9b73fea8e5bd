"""The GGUF models already on this disk (stores.py), described from their headers (cached: header_index.py),
and which of them can draft for which. `list_local_models()` is the library entry point."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from fsd_local.llama.vocab import HeaderVocab, header_problem
from fsd_local.pairs import stores
from fsd_local.pairs.header_index import HeaderIndex

PROJECTORS = {"clip", "mmproj"}  # vision / audio projectors: not language models, never listed


@dataclass
class LocalModel:
    """A model found on disk; `problem` says why it cannot be used (then the header fields are None)."""

    store: str
    name: str
    path: str | None
    problem: str | None = None
    architecture: str | None = None
    label: str | None = None  # general.name
    size_bytes: int | None = None
    quantisation: str | None = None
    n_layer: int | None = None
    n_embd: int | None = None
    tokenizer: str | None = None
    vocab: HeaderVocab | None = field(default=None, repr=False)
    drafts: list[str] = field(default_factory=list)  # names of listed models that can draft for this one
    across: list = field(default_factory=list)  # models of other vocabularies (across.AcrossDraft), when asked
    ranked: list = field(default_factory=list)  # every draft of any family, the best first (ranking.Ranked)
    also_in: list[str] = field(default_factory=list)  # other stores holding a model of the same name

    @property
    def n_vocab(self) -> int | None:
        return self.vocab.n_vocab if self.vocab else None

    @property
    def where(self) -> str:
        return stores.LABELS[self.store]

    def to_dict(self) -> dict:
        out = {
            k: getattr(self, k)
            for k in ("name", "store", "path", "problem", "architecture", "label", "size_bytes", "quantisation")
        }
        out.update(n_layer=self.n_layer, n_vocab=self.n_vocab, tokenizer=self.tokenizer, drafts=self.drafts)
        out["also_in"] = self.also_in
        out["drafts_across"] = [a.to_dict() for a in self.across]
        out["ranked_drafts"] = [r.to_dict() for r in self.ranked]
        return out


@dataclass
class Listing:
    roots: list[stores.Root]
    models: list[LocalModel]  # usable
    unusable: list[LocalModel]

    def searched(self) -> str:
        """The stores searched, in words (for a name that matches nothing)."""
        return "; ".join(f"{r.label} {r.path} ({r.state})" for r in self.roots)

    def to_dict(self) -> dict:
        return {
            "stores": [
                {
                    "store": r.store,
                    "label": r.label,
                    "path": r.path,
                    "state": r.state,
                    "models": sum(m.path is not None and _under(m.path, r.path) for m in self.models),
                }
                for r in self.roots
            ],
            "models": [m.to_dict() for m in self.models],
            "unusable": [m.to_dict() for m in self.unusable],
        }


def _under(path: str, root: str) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(root).rstrip(os.sep) + os.sep)


def describe(entry: stores.Entry, index: HeaderIndex) -> LocalModel:
    """A store entry with what its GGUF header says (or why it cannot be read)."""
    model = LocalModel(entry.store, entry.name, entry.path, entry.problem)
    if model.problem or not entry.path:
        return model
    h = index.header(entry.path)
    if "error" in h:
        model.problem = str(h["error"])
        return model
    vocab = HeaderVocab.from_dict(h["vocab"]) if h.get("vocab") else None
    model.architecture, model.label, model.quantisation = h["architecture"], h.get("label"), h["quantisation"]
    model.size_bytes, model.n_layer, model.n_embd, model.vocab = h["file_bytes"], h["n_layer"], h["n_embd"], vocab
    model.tokenizer = h.get("tokenizer")
    if vocab is None and model.architecture not in PROJECTORS:
        model.problem = "the file has no token list (tokenizer.ggml.tokens): llama.cpp cannot run it as a model"
    return model


def draft_problem(draft: LocalModel, target: LocalModel) -> str | None:
    """None if `draft` can draft for `target`: the same vocabulary (vocab.header_problem), a smaller file, not
    the same model in another quantisation."""
    if draft.vocab is None or target.vocab is None or draft.size_bytes is None or target.size_bytes is None:
        return "no vocabulary to compare"
    if draft.path and target.path and os.path.realpath(draft.path) == os.path.realpath(target.path):
        return "the same file"
    if draft.size_bytes >= target.size_bytes:
        return "not smaller than the target"
    if (draft.architecture, draft.n_layer, draft.n_embd) == (target.architecture, target.n_layer, target.n_embd):
        return "the same model in another quantisation"
    return header_problem(draft.vocab, target.vocab)


def drafts_for(target: LocalModel, models: list[LocalModel]) -> list[LocalModel]:
    """The models that can draft for `target`, smallest first (then in store order)."""
    order = {s: i for i, s in enumerate(stores.LABELS)}
    ok = [m for m in models if draft_problem(m, target) is None]
    return sorted(ok, key=lambda m: (m.size_bytes or 0, order[m.store], m.name))


def list_local_models(extra_folders: tuple[str, ...] = (), index: HeaderIndex | None = None) -> Listing:
    """Every GGUF in the local stores (and in `extra_folders`, e.g. a target's own folder), described, with
    what can draft for what and the names that two stores share."""
    index = index or HeaderIndex()
    roots = stores.roots()
    entries = [e for r in roots for e in stores.scan(r)]
    for folder in extra_folders:
        root = stores.Root("folder", folder)
        roots.append(root)
        entries += stores.scan_folder(folder) if os.path.isdir(folder) else []
    stored = {os.path.realpath(e.path) for e in entries if e.path and e.store != "folder"}
    entries = [e for e in entries if e.store != "folder" or not e.path or os.path.realpath(e.path) not in stored]
    described = [describe(e, index) for e in entries]
    index.save()
    described = [m for m in described if m.architecture not in PROJECTORS]
    by_name: dict[str, list[LocalModel]] = {}
    for m in described:
        by_name.setdefault(m.name.casefold(), []).append(m)
    for same in by_name.values():
        for m in same:
            m.also_in = [o.where for o in same if o is not m and o.store != m.store]
    models = [m for m in described if m.problem is None]
    for m in models:  # a name two stores share is shown as the path, which says which one
        m.drafts = [(d.path if d.also_in and d.path else d.name) for d in drafts_for(m, models)]
    return Listing(roots, models, [m for m in described if m.problem is not None])


# ------------------------------------------------------------------ the listing in words
def size_text(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def format_listing(listing: Listing) -> str:
    """What `fsd-local models --local` prints."""
    lines = ["Models found on this disk (searched):"]
    width = max(len(r.label) for r in listing.roots)
    for r in listing.roots:
        n = sum(m.path is not None and _under(m.path, r.path) for m in listing.models)
        state = f"{n} model{'s' * (n != 1)}" if r.state == "found" else r.state
        lines.append(f"  {r.label:<{width}}  {r.path}  {state}")
    lines.append("")
    for m in listing.models:
        vocab = f"vocab {m.n_vocab}" + (f" {m.tokenizer}" if m.tokenizer else "")
        lines.append(f"{m.name}  [{m.where}]  {m.architecture}, {size_text(m.size_bytes)}, {m.quantisation}, {vocab}")
        lines.append(f"  {m.path}")
        if m.drafts:
            lines.append(f"  drafts: {', '.join(m.drafts)}")
        if m.across:
            lines.append(f"  across tokenizers: {', '.join(a.text() for a in m.across)}")
        if m.ranked:
            lines.append(f"  ranked: {', '.join(r.text() for r in m.ranked)}")
        if m.also_in:
            lines.append(f"  the same name is in {', '.join(m.also_in)}: give the path to choose this one")
    if not listing.models:
        lines.append("No usable GGUF model found.")
    if listing.unusable:
        lines += ["", f"Not usable ({len(listing.unusable)}):"]
        lines += [f"  {m.name}  [{m.where}]  {m.problem}" for m in listing.unusable]
    lines += [
        "",
        "A name or a path goes to --target and --draft: fsd-local chat --target NAME. Given a target alone, "
        "chat, generate, serve and bench draft with the first of its `ranked:` line (the speed-up the cost model "
        "expects; another family's only above 1x); --draft none decodes with the target alone.",
    ]
    return "\n".join(lines)
