"""Model names on the command line: `--target qwen2.5:7b` (Ollama), `--target org/name/file.gguf` or `org/name`
or `org/name:Q4_K_M` (the Hugging Face cache, LM Studio, llama.cpp's cache) as well as paths; and the draft
chosen for a target given alone (the best ranked local model of any family: ranking.py)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from fsd_local.errors import ModelLoadError
from fsd_local.pairs import stores
from fsd_local.pairs.header_index import HeaderIndex
from fsd_local.pairs.local import Listing, LocalModel, describe, list_local_models, size_text
from fsd_local.pairs.ranking import Ranked, best, rank

NONE = "none"  # --draft none: no draft model
_FAMILY = re.compile(r"^(.*?)[-_ :]?v?\d+(\.\d+)?[bm]\b", re.I)  # "Qwen2.5-7B-Instruct" -> "Qwen2.5"


def looks_like_path(value: str) -> bool:
    return os.path.isabs(value) or value.startswith((".", "~")) or "\\" in value


def given_name(value: str | None) -> str | None:
    """`value` when it names a model of the local stores rather than a file: what a server calls the model."""
    if not value or looks_like_path(value) or os.path.exists(os.path.expanduser(value)):
        return None
    return value


def _ollama_key(name: str) -> str:
    """registry/namespace/model:tag, the defaults filled in (qwen2.5 -> registry.ollama.ai/library/qwen2.5:latest)."""
    base, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "")
    parts = base.split("/")
    if len(parts) == 1:
        parts = [stores.OLLAMA_REGISTRY, stores.OLLAMA_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [stores.OLLAMA_REGISTRY, *parts]
    return "/".join(parts).casefold() + ":" + (tag or stores.OLLAMA_TAG).casefold()


def _matches(value: str, m: LocalModel) -> bool:
    v, name = value.casefold(), m.name.casefold()
    if v == name:
        return True
    if m.store == "ollama":
        return _ollama_key(value) == _ollama_key(m.name)
    repo, _, quant = v.partition(":")
    if repo.count("/") == 1 and name.startswith(repo + "/"):  # org/name, or org/name:QUANT as llama.cpp's -hf takes
        return not quant or quant in name[len(repo) + 1 :]
    return "/" not in v and name.rsplit("/", 1)[-1] == v  # a file name alone


def find(value: str, listing: Listing) -> list[LocalModel]:
    """The listed models (usable or not) that `value` names, in store order."""
    return [m for m in listing.models + listing.unusable if _matches(value, m)]


def resolve(value: str, role: str, listing: Listing | None = None) -> str:
    """The GGUF path a --target/--draft value means: an existing path as it is, else a model name looked up in
    the local stores. A value that looks like a path is returned unchanged (the loader says it is missing)."""
    path = os.path.expanduser(value)
    if os.path.exists(path) or looks_like_path(value):
        return path
    listing = listing or list_local_models()
    found = find(value, listing)
    usable = [m for m in found if m.problem is None]
    if not found:
        hint = " (check the path)" if value.endswith(".gguf") else ""
        raise ModelLoadError(
            f"{role} {value!r} is not a file{hint}, and no model of that name is on this disk; searched: "
            f"{listing.searched()}. `fsd-local models --local` lists the names found, `fsd-local models` the "
            "pairs `fsd-local pull` fetches"
        )
    if not usable:
        raise ModelLoadError(f"{role} {found[0].name} [{found[0].where}] cannot be used: {found[0].problem}")
    distinct = {(m.size_bytes, m.architecture, m.quantisation) for m in usable}
    if len(distinct) > 1:  # copies of one file (same size and header) are one model; different files are not
        choices = "; ".join(f"{m.name} [{m.where}] {size_text(m.size_bytes)}: {m.path}" for m in usable)
        raise ModelLoadError(
            f"{role} {value!r} names {len(usable)} different models: {choices}. Give a full name or a path"
        )
    assert usable[0].path is not None
    return usable[0].path


@dataclass
class DraftChoice:
    """The outcome of looking for a draft: `draft` (None if nothing fits), how many fitted, and the target;
    `ranked`: every draft found, the best first (ranking.py)."""

    target: LocalModel
    draft: LocalModel | None
    candidates: int
    listing: Listing
    ranked: list[Ranked] = field(default_factory=list)

    def chosen_note(self, target_arg: str) -> str:
        d = self.draft
        assert d is not None
        r = next((r for r in self.ranked if r.model is d), None)
        how = f"; {r.how()}" if r is not None else ""
        n = self.candidates
        others = f"the best of {n} local drafts" if n > 1 else "the one local draft"
        return (
            f"draft: {d.name} [{d.where}, {size_text(d.size_bytes)}, {d.quantisation}{how}] chosen for {target_arg}: "
            f"{others}. Another: --draft NAME or PATH (`fsd-local models --local` ranks them); plain decoding: "
            "--draft none"
        )

    def missing_note(self, target_arg: str) -> str:
        across = [r for r in self.ranked if r.path != "same"]
        found = f"; of other families {', '.join(r.text() for r in across)}, not expected to pay" if across else ""
        return (
            f"no model on this disk can draft for {target_arg} (same vocabulary, smaller; searched: "
            f"{', '.join(dict.fromkeys(r.label for r in self.listing.roots))}{found}). {pull_hint(self.target)}"
        )


def pull_hint(target: LocalModel) -> str:
    """What to fetch so that a draft is found next time: a curated pair of the target's family, if one is."""
    from fsd_local.errors import RegistryError
    from fsd_local.pairs.registry import load_registry

    def family(text: str) -> str | None:  # "Meta Llama 3.1 8B Instruct", "Meta-Llama-3.1-8B-..." -> "metallama3.1"
        m = _FAMILY.match(text)
        return re.sub(r"[^a-z0-9.]", "", m.group(1).casefold()) or None if m else None

    mine = family(target.label or os.path.basename(target.name))
    try:
        pairs = load_registry()
    except RegistryError:
        pairs = {}
    for pair in pairs.values():
        if mine and family(pair.target.file) == mine:
            return (
                f"A draft of its family: {pair.draft.repo}/{pair.draft.file} (`fsd-local pull {pair.name}` fetches it "
                f"with its target); a smaller size of the same family from Ollama or LM Studio is found too"
            )
    return (
        "Pull a smaller model of the same family (same tokenizer: e.g. `ollama pull` a smaller size, or "
        "`fsd-local models` for curated pairs) and it is picked automatically"
    )


def choose_draft(target_path: str, index: HeaderIndex | None = None) -> DraftChoice:
    """The best ranked local model that can draft for the model at `target_path`, of any family (the stores and
    the target's own folder are searched)."""
    index = index or HeaderIndex()
    folder = os.path.dirname(os.path.abspath(target_path))
    listing = list_local_models(extra_folders=(folder,), index=index)
    real = os.path.realpath(target_path)
    known = [m for m in listing.models if m.path and os.path.realpath(m.path) == real]
    target = known[0] if known else describe(stores.Entry("folder", target_path, target_path), index)
    if target.problem:  # the loader will say what is wrong with it
        return DraftChoice(target, None, 0, listing)
    ranked = rank(target, listing.models)
    chosen = best(ranked)
    return DraftChoice(target, chosen.model if chosen else None, len(ranked), listing, ranked)
