"""What a GGUF file holds, read from its header without loading weights: architecture, shape, vocabulary,
quantisation, and bytes per layer (what GPU placement needs). Uses ggml's own GGUF reader (ggml.py)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from fsd_local.errors import ModelLoadError
from fsd_local.llama import ggml as g
from fsd_local.llama import state_shape
from fsd_local.llama.vocab import FIRST_CHECKED_TOKEN, MAX_SIZE_DIFFERENCE, TOKENIZERS, HeaderVocab

_SCALARS: dict[int, type[ctypes._SimpleCData]] = {
    g.GGUF_UINT8: ctypes.c_uint8,
    g.GGUF_INT8: ctypes.c_int8,
    g.GGUF_UINT16: ctypes.c_uint16,
    g.GGUF_INT16: ctypes.c_int16,
    g.GGUF_UINT32: ctypes.c_uint32,
    g.GGUF_INT32: ctypes.c_int32,
    g.GGUF_FLOAT32: ctypes.c_float,
    g.GGUF_BOOL: ctypes.c_bool,
    g.GGUF_UINT64: ctypes.c_uint64,
    g.GGUF_INT64: ctypes.c_int64,
    g.GGUF_FLOAT64: ctypes.c_double,
}
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


@dataclass
class GGUFInfo:
    path: str
    file_bytes: int
    architecture: str
    name: str | None
    n_layer: int
    n_ctx_train: int | None
    n_embd: int
    n_head: int
    n_head_kv: int  # the largest per-layer value when the file gives one per layer
    head_dim_k: int
    head_dim_v: int
    vocab_size: int
    tokenizer: str | None
    file_type: str | None  # general.file_type as llama.cpp names it (e.g. Q4_K_M); None when absent
    tensor_types: dict[str, int]  # ggml type name -> number of tensors
    layer_bytes: list[int]  # weights of each repeating block
    output_bytes: int  # the output head llama.cpp offloads with "layer n_layer + 1" (tied = token_embd)
    other_bytes: int  # everything else (token embeddings: llama.cpp keeps them on the CPU)
    has_chat_template: bool
    meta: dict = field(default_factory=dict, repr=False)
    kv_heads: list[int] = field(default_factory=list)  # per layer: the KV heads its cache holds (0: none)
    recurrent: list[bool] = field(default_factory=list)  # per layer: it keeps a recurrent state (state_shape.py)
    state_bytes: int = 0  # one recurrent layer's state for one sequence, F32

    @property
    def quantisation(self) -> str:
        """The file type if stated, else the dominant tensor type of the repeating blocks."""
        if self.file_type:
            return self.file_type
        return max(self.tensor_types, key=self.tensor_types.__getitem__) if self.tensor_types else "unknown"

    def kv_bytes(self, n_ctx: int, type_k: int, type_v: int) -> list[int]:
        """Each layer's KV cache for n_ctx positions (ggml type ids, e.g. model.KV_TYPES['q8_0']); 0 for a layer
        that keeps only a recurrent state."""
        lib = g.lib()
        k, v = self.head_dim_k, self.head_dim_v
        return [n_ctx * (lib.ggml_row_size(type_k, k * h) + lib.ggml_row_size(type_v, v * h)) for h in self.kv_heads]


def _value(lib, ctx, key_id: int):
    """A metadata value as Python: scalars, strings, numeric arrays as lists; string arrays as their length."""
    kind = lib.gguf_get_kv_type(ctx, key_id)
    if kind == g.GGUF_STRING:
        return g.text(lib.gguf_get_val_str(ctx, key_id))
    if kind in _SCALARS:
        return ctypes.cast(lib.gguf_get_val_data(ctx, key_id), ctypes.POINTER(_SCALARS[kind]))[0]
    if kind == g.GGUF_ARRAY:
        n, sub = lib.gguf_get_arr_n(ctx, key_id), lib.gguf_get_arr_type(ctx, key_id)
        if sub in _SCALARS and n <= 4096:  # per-layer hyperparameters; skip token scores and the like
            return list(ctypes.cast(lib.gguf_get_arr_data(ctx, key_id), ctypes.POINTER(_SCALARS[sub]))[:n])
        return n
    return None


_FTYPE_NAMES = None


def file_type_name(ftype: int) -> str:
    """llama.cpp's name for general.file_type, from the LLAMA_FTYPE_* constants of the bindings."""
    global _FTYPE_NAMES
    if _FTYPE_NAMES is None:
        import llama_cpp as lc

        _FTYPE_NAMES = {
            getattr(lc, n): n.replace("LLAMA_FTYPE_", "").replace("MOSTLY_", "").replace("ALL_", "")
            for n in dir(lc)
            if n.startswith("LLAMA_FTYPE_") and n != "LLAMA_FTYPE_GUESSED"
        }
    return _FTYPE_NAMES.get(ftype, f"type {ftype}")


def split_files(path: str, count: int) -> list[str]:
    """Every file of a split model (llama.cpp's gguf-split names: NAME-00001-of-00003.gguf)."""
    m = _SPLIT.match(str(path))
    if count <= 1 or not m:
        return [str(path)]
    return [f"{m.group(1)}-{i:05d}-of-{m.group(3)}.gguf" for i in range(1, count + 1)]


class _Tensors:
    """Tensor bytes by where llama.cpp puts them: repeating blocks, the output head, the rest."""

    def __init__(self):
        self.types, self.blocks, self.output, self.other = Counter(), Counter(), {}, 0

    def add(self, lib, ctx) -> None:
        for i in range(lib.gguf_get_n_tensors(ctx)):
            name = g.text(lib.gguf_get_tensor_name(ctx, i))
            size = lib.gguf_get_tensor_size(ctx, i)
            self.types[g.text(lib.ggml_type_name(lib.gguf_get_tensor_type(ctx, i)))] += 1
            m = _BLOCK.match(name)
            if m:
                self.blocks[int(m.group(1))] += size
            elif name.startswith(("output.", "output_norm.")):
                self.output[name] = size
            else:
                self.other += size
                if name == "token_embd.weight":
                    self.output.setdefault("tied", size)

    @property
    def output_bytes(self) -> int:
        # a tied output head (no output.weight) is a copy of token_embd that llama.cpp puts with the output layer
        return sum(v for k, v in self.output.items() if k != "tied" or "output.weight" not in self.output)


def _open(lib, path: str, role: str):
    ctx = lib.gguf_init_from_file(os.fsencode(path), g._GGUFInitParams(True, None))
    if not ctx:
        raise ModelLoadError(f"{role} model {path}: ggml could not parse the GGUF header (truncated or corrupt)")
    n = lib.gguf_get_n_tensors(ctx)
    end = max((lib.gguf_get_tensor_offset(ctx, i) + lib.gguf_get_tensor_size(ctx, i) for i in range(n)), default=0)
    need, have = lib.gguf_get_data_offset(ctx) + end, os.path.getsize(path)
    if have < need:  # ggml reads only the header: the missing weights would fail the load much later
        lib.gguf_free(ctx)
        raise ModelLoadError(
            f"{role} model {path} is truncated: {have} bytes of the {need} its header describes "
            "(an interrupted download? fetch it again)"
        )
    return ctx


def _vocab(lib, ctx, meta: dict) -> HeaderVocab | None:
    """The vocabulary as vocab.header_problem compares it (None if the file has no token list)."""
    kid = lib.gguf_find_key(ctx, b"tokenizer.ggml.tokens")
    if kid < 0 or lib.gguf_get_kv_type(ctx, kid) != g.GGUF_ARRAY or lib.gguf_get_arr_type(ctx, kid) != g.GGUF_STRING:
        return None
    n = lib.gguf_get_arr_n(ctx, kid)
    start = min(FIRST_CHECKED_TOKEN, n)
    first = max(start, n - MAX_SIZE_DIFFERENCE)
    get = lib.gguf_get_arr_str
    tokens = [(get(ctx, kid, i) or b"") + b"\0" for i in range(start, n)]
    h = hashlib.blake2b(b"".join(tokens[: first - start]), digest_size=8)
    digests = []
    for token in tokens[first - start :]:
        digests.append(h.hexdigest())  # of the tokens before this one
        h.update(token)
    digests.append(h.hexdigest())
    ids = {}
    for key in ("bos_token_id", "eos_token_id", "add_bos_token"):
        kid = lib.gguf_find_key(ctx, f"tokenizer.ggml.{key}".encode())
        ids[key] = _value(lib, ctx, kid) if kid >= 0 else None
    add_bos = ids["add_bos_token"]
    return HeaderVocab(
        tokenizer=meta.get("tokenizer.ggml.model"),
        n_vocab=n,
        bos=ids["bos_token_id"],
        eos=ids["eos_token_id"],
        add_bos=None if add_bos is None else bool(add_bos),
        first=first,
        digests=tuple(digests),
    )


GENERAL_KEYS = (
    "general.architecture",
    "general.name",
    "general.file_type",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.chat_template",
    "split.count",
)
ARCH_KEYS = (  # read as "<architecture>.<key>", stored under the key alone
    "block_count",
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "vocab_size",
    *state_shape.KEYS,
)


def _meta(lib, ctx) -> dict:
    meta = {}
    for key in GENERAL_KEYS:
        kid = lib.gguf_find_key(ctx, key.encode())
        if kid >= 0:
            meta[key] = _value(lib, ctx, kid)
    arch = meta.get("general.architecture") or "unknown"
    for suffix in ARCH_KEYS:
        kid = lib.gguf_find_key(ctx, f"{arch}.{suffix}".encode())
        if kid >= 0:
            meta[suffix] = _value(lib, ctx, kid)
    return meta


def read(path: str, role: str = "model", vocab: bool = False) -> GGUFInfo:
    """The header of `path` (and of its split parts). vocab=True also reads the token list into
    meta["vocab"] (a vocab.HeaderVocab: ~0.1 s for 150,000 tokens)."""
    from fsd_local.llama.bindings import route_log
    from fsd_local.llama.model import check_gguf_file

    check_gguf_file(path, role)
    route_log()  # ggml's complaints about a broken header go to the log buffer, not the terminal
    lib = g.lib()
    ctx = _open(lib, path, role)
    tensors = _Tensors()
    try:
        meta = _meta(lib, ctx)
        tensors.add(lib, ctx)
        if vocab:
            meta["vocab"] = _vocab(lib, ctx, meta)
    finally:
        lib.gguf_free(ctx)
    arch = meta.get("general.architecture") or "unknown"
    files = split_files(path, meta.get("split.count") or 1)
    for other in files[1:]:
        check_gguf_file(other, f"{role} (split part)")
        part = _open(lib, other, role)
        try:
            tensors.add(lib, part)
        finally:
            lib.gguf_free(part)

    def most(v, default=0):  # a per-layer list -> its largest entry (the conservative choice for memory)
        return max(v) if isinstance(v, list) and v else (v if isinstance(v, int) else default)

    n_layer = most(meta.get("block_count"), len(tensors.blocks))
    n_embd, n_head = most(meta.get("embedding_length")), most(meta.get("attention.head_count"), 1)
    head_dim = n_embd // n_head if n_head else 0
    tokens = meta.get("tokenizer.ggml.tokens")
    ftype = meta.get("general.file_type")
    tokenizer = meta.get("tokenizer.ggml.model")
    recurrent, kv_heads = state_shape.layers(arch, meta, n_layer, meta.get("attention.head_count_kv", n_head))
    return GGUFInfo(
        path=str(path),
        file_bytes=sum(map(os.path.getsize, files)),
        architecture=arch,
        name=meta.get("general.name"),
        n_layer=n_layer,
        n_ctx_train=most(meta.get("context_length"), None),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=most(meta.get("attention.head_count_kv"), n_head),
        head_dim_k=most(meta.get("attention.key_length"), head_dim),
        head_dim_v=most(meta.get("attention.value_length"), head_dim),
        vocab_size=tokens if isinstance(tokens, int) else most(meta.get("vocab_size")),
        tokenizer=TOKENIZERS.get(tokenizer, tokenizer) if tokenizer is not None else None,
        file_type=file_type_name(ftype) if isinstance(ftype, int) else None,
        tensor_types=dict(tensors.types),
        layer_bytes=[tensors.blocks.get(i, 0) for i in range(n_layer)],
        output_bytes=tensors.output_bytes,
        other_bytes=tensors.other,
        has_chat_template=bool(meta.get("tokenizer.chat_template")),
        meta=meta,
        kv_heads=kv_heads,
        recurrent=recurrent,
        state_bytes=state_shape.row_bytes(meta, n_embd, n_head) if any(recurrent) else 0,
    )


def metadata(path: str, role: str = "model") -> dict:
    """Every key of a GGUF header as Python values (Ollama's /api/show model_info): scalars, strings and short
    numeric arrays; long arrays (the vocabulary, its scores) as None. Adds general.parameter_count, counted from
    the tensors' shapes, when the file does not state it. Reads the header only."""
    from fsd_local.llama.model import check_gguf_file

    check_gguf_file(path, role)
    lib = g.lib()
    ctx = _open(lib, path, role)
    try:
        out: dict = {}
        for i in range(lib.gguf_get_n_kv(ctx)):
            key = g.text(lib.gguf_get_key(ctx, i))
            value = _value(lib, ctx, i)
            long_array = lib.gguf_get_kv_type(ctx, i) == g.GGUF_ARRAY and not isinstance(value, list)
            out[key] = None if long_array else value
        if "general.parameter_count" not in out:
            count = 0
            for i in range(lib.gguf_get_n_tensors(ctx)):
                kind = lib.gguf_get_tensor_type(ctx, i)
                count += lib.gguf_get_tensor_size(ctx, i) // lib.ggml_type_size(kind) * lib.ggml_blck_size(kind)
            out["general.parameter_count"] = count
    finally:
        lib.gguf_free(ctx)
    return out
