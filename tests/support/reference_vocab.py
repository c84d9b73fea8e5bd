"""The vocabulary map's reference (llama/vocab_map.py), written as its definition with dictionaries over every
token's bytes as llama.cpp renders them (Model.piece)."""

from __future__ import annotations

from fsd_local.llama.vocab_table import BYTE, NORMAL, USER, VocabTable

RANK = {NORMAL: 0, USER: 1, BYTE: 2}


def reference_target_of(d: VocabTable, t: VocabTable) -> dict[int, int]:
    """Draft token -> target token for the tokens matched by their bytes: the target token of the same kind and
    bytes (the lowest id), else of the same bytes with the best (rank, id)."""
    same_kind: dict[tuple[int, bytes], int] = {}
    same_bytes: dict[bytes, tuple[int, int]] = {}
    for i in range(t.n_vocab):
        k = int(t.kind[i])
        if k in RANK:
            b = t.piece(i)
            same_kind.setdefault((k, b), i)
            if b not in same_bytes or (RANK[k], i) < same_bytes[b]:
                same_bytes[b] = (RANK[k], i)
    out = {}
    for i in range(d.n_vocab):
        k = int(d.kind[i])
        if k in RANK:
            b = d.piece(i)
            if (k, b) in same_kind:
                out[i] = same_kind[(k, b)]
            elif b in same_bytes:
                out[i] = same_bytes[b][1]
    return out
