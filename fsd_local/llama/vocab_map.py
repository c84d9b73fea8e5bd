"""The vocabulary map from a draft model's tokens to a target's: each draft token is carried to the target token
with the same bytes (llama.cpp's pieces, vocab_table.py), control tokens by their text, and the draft's ends of
generation to the target's end token; built vectorised from two tables and kept on disk per pair of files."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fsd_local.llama.vocab_table import (
    BYTE,
    NORMAL,
    USER,
    VocabTable,
    file_key,
    load_arrays,
    save_arrays,
    store_path,
    table_of,
)

MATCHED_BY_BYTES = (NORMAL, USER, BYTE)
# among target tokens of the same bytes, the one a draft token without a same-kind twin is carried to: a normal
# token before a user-defined one before a byte-fallback token (what the target's tokenizer itself would write)
RANK = np.array([0, 1, 2, 3, 4], np.int8)


# odd multipliers of the piece hash, one per 8-byte word of a piece (pieces longer than 8 * len(_MIX) - 8 bytes
# reuse them cyclically: the hash only finds candidates, every match is then checked byte for byte)
_MIX = np.random.default_rng(20260512).integers(1, 2**62, 64, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def packed(t: VocabTable, ids: np.ndarray) -> np.ndarray:
    """The tokens' bytes as rows of little-endian 8-byte words, zero padded, the length in the first word:
    two tokens render the same bytes exactly when their rows are equal. Array operations only."""
    lengths = (t.offsets[ids + 1] - t.offsets[ids]).astype(np.int64)
    width = 8 + -(-int(lengths.max(initial=0)) // 8) * 8
    mat = np.zeros((ids.shape[0], width), np.uint8)
    mat[:, :8] = lengths.astype("<u8").view(np.uint8).reshape(-1, 8)
    rows = np.repeat(np.arange(ids.shape[0]), lengths)
    firsts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    at = np.arange(rows.shape[0], dtype=np.int64) - firsts  # position inside each piece
    mat[rows, 8 + at] = t.pieces[np.repeat(t.offsets[ids], lengths) + at]
    return mat.view("<u8")


def piece_hash(words: np.ndarray, kinds: np.ndarray | None = None) -> np.ndarray:
    """A 64-bit hash of each row of `packed` (and of its token's kind, where given)."""
    mix = np.resize(_MIX, words.shape[1])
    with np.errstate(over="ignore"):
        h = (words * mix).sum(axis=1, dtype=np.uint64)
        if kinds is not None:
            h += kinds.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    return h


def count_distinct(keys: np.ndarray) -> int:
    k = np.sort(keys)
    return int(k.shape[0] and 1 + np.count_nonzero(k[1:] != k[:-1]))


def _canonical(keys: np.ndarray, ids: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys, sorted, each with its first token by (rank, id)."""
    order = np.lexsort((ids, rank, keys))
    k = keys[order]
    first = np.ones(k.shape[0], bool)
    first[1:] = k[1:] != k[:-1]
    return k[first], ids[order][first]


def _lookup(sorted_keys: np.ndarray, their_ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each key, the id of the equal entry of sorted_keys, -1 where there is none."""
    if sorted_keys.shape[0] == 0:
        return np.full(keys.shape[0], -1, np.int32)
    pos = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.shape[0] - 1)
    hit = sorted_keys[pos] == keys
    return np.where(hit, their_ids[pos], -1).astype(np.int32)


@dataclass(frozen=True)
class VocabMap:
    """`target_of[d]`: the target token draft token d is carried to (-1: none). `draft_of[t]`: the draft token a
    shared target token t is read from (-1: t is the target's alone); `extra` (t, d) rows: further draft tokens
    whose mass also goes to t (duplicate pieces, several ends of generation)."""

    target_of: np.ndarray  # int32, n_draft
    draft_of: np.ndarray  # int32, n_target
    extra: np.ndarray  # int32, (m, 2)
    shared_pieces: int  # distinct byte strings both vocabularies render
    draft_pieces: int
    target_pieces: int
    probe_share: float  # of the draft's tokens of vocab_table.PROBE_TEXT, the share the map carries
    identity: bool  # the same vocabulary: every token is carried to itself

    @property
    def n_draft(self) -> int:
        return int(self.target_of.shape[0])

    @property
    def n_target(self) -> int:
        return int(self.draft_of.shape[0])

    @property
    def share_of_draft(self) -> float:
        return self.shared_pieces / max(self.draft_pieces, 1)

    @property
    def share_of_target(self) -> float:
        return self.shared_pieces / max(self.target_pieces, 1)

    def describe(self) -> str:
        """The shares in words (shared pieces, of each vocabulary, of the draft's tokens of a probe text)."""
        return (
            f"{self.shared_pieces:,} shared pieces ({self.share_of_draft:.0%} of the draft's, "
            f"{self.share_of_target:.0%} of the target's); the draft's tokens of a probe text {self.probe_share:.0%} "
            "carried"
        )

    @cached_property
    def shared(self) -> tuple[np.ndarray, np.ndarray]:
        """(target ids, their draft_of) over the shared target tokens, by target id: kernels/carry.py's scatter."""
        t = np.flatnonzero(self.draft_of >= 0).astype(np.int32)
        return t, self.draft_of[t]

    @cached_property
    def primary(self) -> np.ndarray:
        """primary_of(target_of, draft_of): what kernels/carry.py's carried_argmax reads."""
        return primary_of(self.target_of, self.draft_of)

    def to_dict(self) -> dict:
        return {
            "shared_pieces": self.shared_pieces,
            "draft_pieces": self.draft_pieces,
            "target_pieces": self.target_pieces,
            "share_of_draft": round(self.share_of_draft, 4),
            "share_of_target": round(self.share_of_target, 4),
            "probe_share": round(self.probe_share, 4),
            "identity": self.identity,
        }


def _by_bytes(d: VocabTable, t: VocabTable) -> tuple[np.ndarray, tuple[int, int, int]]:
    """target_of for the tokens matched by bytes: a same-kind twin first (a byte-fallback token to the target's
    byte-fallback token), else the target's canonical token of those bytes (RANK). Candidates come from a hash;
    each is then compared byte for byte. Also the distinct pieces (shared, the draft's, the target's)."""
    target_of = np.full(d.n_vocab, -1, np.int32)
    d_ids = np.flatnonzero(np.isin(d.kind, MATCHED_BY_BYTES))
    t_ids = np.flatnonzero(np.isin(t.kind, MATCHED_BY_BYTES))
    if d_ids.shape[0] == 0 or t_ids.shape[0] == 0:
        return target_of, (0, d_ids.shape[0], t_ids.shape[0])
    d_words, t_words = packed(d, d_ids), packed(t, t_ids)
    width = max(d_words.shape[1], t_words.shape[1])
    d_words = np.pad(d_words, ((0, 0), (0, width - d_words.shape[1])))
    t_words = np.pad(t_words, ((0, 0), (0, width - t_words.shape[1])))
    row_of = np.full(t.n_vocab, -1, np.int64)
    row_of[t_ids] = np.arange(t_ids.shape[0])
    for with_kind in (True, False):
        todo = np.flatnonzero(target_of[d_ids] < 0)  # rows of d_ids
        t_kinds = t.kind[t_ids] if with_kind else None
        keys, ids = _canonical(piece_hash(t_words, t_kinds), t_ids, RANK[t.kind[t_ids]])
        found = _lookup(keys, ids, piece_hash(d_words[todo], d.kind[d_ids[todo]] if with_kind else None))
        hit = found >= 0
        same = np.all(d_words[todo[hit]] == t_words[row_of[found[hit]]], axis=1)
        if with_kind:
            same &= d.kind[d_ids[todo[hit]]] == t.kind[found[hit]]
        found[np.flatnonzero(hit)[~same]] = -1  # a hash collision: not the same bytes
        target_of[d_ids[todo]] = found
    d_hash = piece_hash(d_words)
    shared = count_distinct(d_hash[target_of[d_ids] >= 0])
    return target_of, (shared, count_distinct(d_hash), count_distinct(piece_hash(t_words)))


def _by_text(d: VocabTable, t: VocabTable, target_of: np.ndarray) -> None:
    """Control tokens by their text (two chat formats' shared markers); the draft's remaining ends of generation
    to the token that ends the target's reply (vocab_table.end_of_turn)."""
    theirs = {text: int(i) for i, text in zip(t.special_ids.tolist(), t.special_text) if text}
    for i, text in zip(d.special_ids.tolist(), d.special_text):
        if text in theirs:
            target_of[i] = theirs[text]
    end = t.end
    if end >= 0:
        for e in d.eog.tolist():
            if target_of[e] < 0:
                target_of[e] = end


def split_map(target_of: np.ndarray, n_target: int, rank: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """draft_of (for each target token, the first draft token carried to it by (rank, id)) and the extra (t, d)
    rows of the others, sorted by t."""
    mapped = np.flatnonzero(target_of >= 0)
    tgt = target_of[mapped]
    order = np.lexsort((mapped, np.zeros(mapped.shape[0], np.int8) if rank is None else rank[mapped], tgt))
    tgt, src = tgt[order], mapped[order]
    first = np.ones(tgt.shape[0], bool)
    first[1:] = tgt[1:] != tgt[:-1]
    draft_of = np.full(n_target, -1, np.int32)
    draft_of[tgt[first]] = src[first]
    extra = np.stack([tgt[~first], src[~first]], axis=1).astype(np.int32).reshape(-1, 2)
    return draft_of, extra


def primary_of(target_of: np.ndarray, draft_of: np.ndarray) -> np.ndarray:
    """For each draft token, its target token where it is draft_of's choice for it, else -1 (carried_argmax)."""
    ok = target_of >= 0
    mine = np.zeros(target_of.shape[0], bool)
    mine[ok] = draft_of[target_of[ok]] == np.flatnonzero(ok)
    return np.where(mine, target_of, -1).astype(np.int32)


def build_map(d: VocabTable, t: VocabTable) -> VocabMap:
    """The map from draft tokens to target tokens (vectorised but for the control tokens, a few hundred)."""
    target_of, (shared, draft_pieces, target_pieces) = _by_bytes(d, t)
    _by_text(d, t, target_of)
    draft_of, extra = split_map(target_of, t.n_vocab, RANK[d.kind])
    probe = d.probe[(d.probe >= 0) & (d.probe < d.n_vocab)]
    probe_share = float(np.mean(target_of[probe] >= 0)) if probe.shape[0] else 0.0
    ids = np.arange(d.n_vocab, dtype=np.int32)
    identity = d.n_vocab == t.n_vocab and bool(np.all((target_of == ids) | (target_of < 0)))
    return VocabMap(
        target_of=target_of,
        draft_of=draft_of,
        extra=extra,
        shared_pieces=shared,
        draft_pieces=draft_pieces,
        target_pieces=target_pieces,
        probe_share=probe_share,
        identity=identity,
    )


SCALARS = ("shared_pieces", "draft_pieces", "target_pieces", "probe_share", "identity")


def map_between(draft_path: str, target_path: str, draft=None, target=None) -> VocabMap:
    """The map for a pair of GGUF files, from the cache when both files are unchanged; `draft` / `target`: the
    files already loaded as Models (else read vocabulary-only when their tables are not cached)."""
    where = store_path("map", [file_key(draft_path), file_key(target_path)])
    found = load_arrays(where)
    if found is not None:
        arrays, meta = found
        try:
            return VocabMap(arrays["target_of"], arrays["draft_of"], arrays["extra"], **{k: meta[k] for k in SCALARS})
        except (KeyError, TypeError):
            pass  # written by another version: built again
    vm = build_map(table_of(draft_path, draft), table_of(target_path, target))
    arrays = {"target_of": vm.target_of, "draft_of": vm.draft_of, "extra": vm.extra}
    save_arrays(where, arrays, {k: getattr(vm, k) for k in SCALARS})
    return vm
