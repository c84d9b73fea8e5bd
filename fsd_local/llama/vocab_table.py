"""A model's vocabulary as llama.cpp renders it: every token's bytes (`llama_token_to_piece`), its kind, the
special tokens' texts and ids, and how the tokenizer splits a probe text; read once per model file and kept on
disk (FSD_LOCAL_CACHE/vocab/, keyed by the file's path, size and modification time)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fsd_local.paths import cache_dir

TABLE_VERSION = 4  # raised whenever what a table or a map holds changes
# llama_token_attr bits (llama.h)
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER, ATTR_BYTE = 1, 2, 4, 8, 16, 32
# a token's kind, as the map matches tokens: by bytes (normal, user-defined, byte) or by text (control)
NORMAL, USER, BYTE, CONTROL, OTHER = 0, 1, 2, 3, 4
# Text a draft is likely to write (prose, chat, code, numbers, a little of other scripts): the share of its tokens
# a map carries estimates how much of a draft's probable mass it keeps, before any generation has run.
PROBE_TEXT = (
    "The meeting moved to Thursday, so I rewrote the plan: first we check the logs, then we fix the two failing "
    "tests and ship it before the weekend. Could you send me the numbers from March (about 1,250 orders, 17.5% "
    "more than last year)? Thanks!\n\nSure. Here is a short summary of what changed and why it matters for users "
    "who run the model on a laptop without a GPU.\n\n"
    "def mean(values: list[float]) -> float:\n    if not values:\n        return 0.0\n"
    "    return sum(values) / len(values)\n\n"
    "for (int i = 0; i < n; i++) { total += x[i] * 2; }\n"
    "SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name;\n"
    '{"city": "Paris", "temperature": 21, "sunny": true}\n'
    "Le café est à côté de la gare. Die Straße ist schön. El niño comió pan. 東京は大きい。 Привет, мир.\n"
)


@dataclass(frozen=True)
class VocabTable:
    """The bytes of token i are pieces[offsets[i]:offsets[i + 1]] (control tokens render none; their text is in
    `special_text`); `kind` is NORMAL, USER, BYTE, CONTROL or OTHER (unknown, unused) per token."""

    n_vocab: int
    pieces: np.ndarray  # uint8
    offsets: np.ndarray  # int64, n_vocab + 1
    kind: np.ndarray  # int8
    special_ids: np.ndarray  # int32: the CONTROL tokens
    special_text: tuple[bytes, ...]  # their text (llama_token_to_piece with special=True)
    eog: np.ndarray  # int32: the end-of-generation tokens (llama_vocab_is_eog)
    bos: int
    eos: int
    eot: int  # -1: none
    end: int  # the token that ends an assistant's turn in the chat template (else the end of sequence)
    add_bos: bool
    tokenizer: str  # tokenizer.ggml.model: gpt2 (byte-level BPE), llama (SentencePiece), ...
    probe: np.ndarray  # int32: PROBE_TEXT as this tokenizer splits it
    every_byte: bool  # llama.cpp can tokenise any text with it (_writes_every_byte)
    reads_back: bool  # the probe's tokens render PROBE_TEXT exactly (after a space the tokenizer may write first)

    def piece(self, token: int) -> bytes:
        return self.pieces[self.offsets[token] : self.offsets[token + 1]].tobytes()

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_table(model) -> VocabTable:
    """The table of a loaded Model (vocab_only is enough): one llama_token_to_piece and one llama_vocab_get_attr
    call per token (llama.cpp has no batched form), written straight into one buffer."""
    from fsd_local.llama.bindings import lc

    n = model.n_vocab
    vocab = _address(model.vocab)
    # the C functions themselves, called with plain integers: llama-cpp-python's argument conversion would cost
    # more than the call
    to_piece = ctypes.CFUNCTYPE(
        ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool
    )(_address(lc.llama_token_to_piece))
    get_attr = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)(_address(lc.llama_vocab_get_attr))
    cap = 256
    buf = np.empty(n * 8 + cap, np.uint8)
    base = buf.ctypes.data
    offsets = np.zeros(n + 1, np.int64)
    attrs = np.empty(n, np.int32)
    at = 0
    for i in range(n):
        if at + cap > buf.shape[0]:  # room for the longest piece llama.cpp writes without asking for more
            buf = np.concatenate([buf, np.empty(buf.shape[0], np.uint8)])
            base = buf.ctypes.data
        k = to_piece(vocab, i, base + at, cap, 0, False)
        if k < 0:  # longer than cap bytes: room for it, then again
            buf = np.concatenate([buf, np.empty(-k + cap, np.uint8)])
            base = buf.ctypes.data
            k = to_piece(vocab, i, base + at, -k, 0, False)
        at += k
        offsets[i + 1] = at
        attrs[i] = get_attr(vocab, i)
    kind = np.full(n, OTHER, np.int8)
    kind[(attrs & ATTR_NORMAL) != 0] = NORMAL
    kind[(attrs & ATTR_USER) != 0] = USER
    kind[(attrs & ATTR_BYTE) != 0] = BYTE
    kind[(attrs & ATTR_CONTROL) != 0] = CONTROL
    kind[(attrs & (ATTR_UNKNOWN | ATTR_UNUSED)) != 0] = OTHER
    kind[(kind != CONTROL) & (offsets[1:] == offsets[:-1])] = OTHER  # renders nothing: nothing to match by
    special = np.flatnonzero(kind == CONTROL).astype(np.int32)
    texts = tuple(_special_text(to_piece, vocab, int(t)) for t in special)
    maybe_eog = np.unique(np.concatenate([special, [model.eos, lc.llama_vocab_eot(model.vocab)]]))
    eog = np.array([t for t in maybe_eog.tolist() if 0 <= t < n and model.is_eog(t)], np.int32)
    tokenizer = model.meta("tokenizer.ggml.model") or "?"
    every_byte = _writes_every_byte(buf, offsets, kind, tokenizer)
    # llama.cpp aborts the process when a tokenizer without a token for some byte meets that byte
    probe_ids = model.tokenize(PROBE_TEXT, add_special=False, parse_special=False) if every_byte else []
    probe = np.array(probe_ids, np.int32)
    rendered = b"".join(buf[offsets[t] : offsets[t + 1]].tobytes() for t in probe_ids)
    reads_back = rendered in (PROBE_TEXT.encode(), b" " + PROBE_TEXT.encode())
    return VocabTable(
        n_vocab=n,
        pieces=buf[:at].copy(),
        offsets=offsets,
        kind=kind,
        special_ids=special,
        special_text=texts,
        eog=eog,
        bos=int(model.bos),
        eos=int(model.eos),
        eot=int(lc.llama_vocab_eot(model.vocab)),
        end=end_of_turn(model, every_byte),
        add_bos=bool(model.add_bos),
        tokenizer=tokenizer,
        probe=probe,
        every_byte=every_byte,
        reads_back=reads_back,
    )


def _writes_every_byte(pieces: np.ndarray, offsets: np.ndarray, kind: np.ndarray, tokenizer: str) -> bool:
    """Whether llama.cpp can tokenise any text with this vocabulary: a SentencePiece one needs its 256
    byte-fallback tokens (without one for a byte it meets, llama.cpp aborts the process); byte-level BPE leaves
    out a byte it has no token for (SmolLM2 has none for 0x04, for instance) and the others write their unknown
    token, which the text follower survives (drafting/follow.py)."""
    if tokenizer != "llama":
        return True
    one = (np.diff(offsets) == 1) & (kind == BYTE)
    covered = np.zeros(256, bool)
    covered[pieces[offsets[:-1][one]]] = True
    return bool(covered.all())


def end_of_turn(model, every_byte: bool = True) -> int:
    """The end-of-generation token the model's chat template writes after an assistant's message (a reply ends
    with it: <|im_end|>, <end_of_turn>, <|eot_id|>); without a template, its end of turn, else its end of
    sequence."""
    from fsd_local.errors import ConfigError
    from fsd_local.llama.bindings import lc
    from fsd_local.llama.chat_template import ChatTemplate

    eot = int(lc.llama_vocab_eot(model.vocab))
    fallback = eot if eot >= 0 and model.is_eog(eot) else int(model.eos)
    template = ChatTemplate.from_model(model)
    marker = "fsd-local-reply-end"
    try:
        text = template.render(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], add_generation_prompt=False
        )
    except ConfigError:
        return fallback
    if template.is_fallback or marker not in text or not every_byte:
        return fallback
    after = text[text.find(marker) + len(marker) :]
    return next((t for t in model.tokenize(after, add_special=False) if model.is_eog(t)), fallback)


def _address(obj) -> int:
    value = ctypes.cast(obj, ctypes.c_void_p).value
    assert value, "a loaded vocabulary and libllama's functions have addresses"
    return value


def _special_text(to_piece, vocab: int, token: int) -> bytes:
    buf = ctypes.create_string_buffer(512)
    k = to_piece(vocab, token, ctypes.addressof(buf), len(buf), 0, True)
    return buf.raw[: max(k, 0)]


# ------------------------------------------------------------------ kept on disk
def file_key(path: str) -> list:
    """What a table or a map built from a file depends on: the file (path, size, modification time) and the
    llama.cpp that rendered its pieces."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        llama = version("llama-cpp-python")
    except PackageNotFoundError:  # pragma: no cover - the package is a hard dependency
        llama = "?"
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns, llama]


def store_path(kind: str, parts: list) -> Path:
    digest = hashlib.blake2b(json.dumps([TABLE_VERSION, *parts]).encode(), digest_size=12).hexdigest()
    return cache_dir() / "vocab" / f"{kind}-{digest}.npz"


def save_arrays(path: Path, arrays: dict, meta: dict) -> None:
    """Write atomically; a cache that cannot be written only costs the time to build it again."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def load_arrays(path: Path) -> tuple[dict, dict] | None:
    """(arrays, meta) as save_arrays wrote them, or None when missing or unreadable (then it is built again)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
        return arrays, meta
    except (OSError, ValueError, KeyError, UnicodeDecodeError, EOFError):
        return None


def _to_disk(t: VocabTable) -> tuple[dict, dict]:
    texts = np.frombuffer(b"".join(t.special_text), np.uint8)
    text_off = np.cumsum([0, *map(len, t.special_text)]).astype(np.int64)
    arrays = dict(
        pieces=t.pieces, offsets=t.offsets, kind=t.kind, special_ids=t.special_ids, texts=texts, text_off=text_off
    )
    arrays.update(eog=t.eog, probe=t.probe)
    meta: dict[str, object] = {"n_vocab": t.n_vocab, "bos": t.bos, "eos": t.eos, "eot": t.eot, "end": t.end}
    meta.update(add_bos=t.add_bos, tokenizer=t.tokenizer, every_byte=t.every_byte, reads_back=t.reads_back)
    return arrays, meta


def _from_disk(a: dict, meta: dict) -> VocabTable:
    off = a["text_off"]
    texts = tuple(a["texts"][off[i] : off[i + 1]].tobytes() for i in range(len(off) - 1))
    return VocabTable(
        pieces=a["pieces"],
        offsets=a["offsets"],
        kind=a["kind"],
        special_ids=a["special_ids"],
        special_text=texts,
        eog=a["eog"],
        probe=a["probe"],
        **meta,
    )


def table_of(path: str, model=None) -> VocabTable:
    """The table of the GGUF at `path`, from the cache when the file is unchanged; `model`: the file already
    loaded (else it is loaded vocabulary-only)."""
    where = store_path("table", file_key(path))
    found = load_arrays(where)
    if found is not None:
        try:
            return _from_disk(*found)
        except (KeyError, TypeError, IndexError):
            pass  # written by another version: built again
    if model is None:
        from fsd_local.llama.model import Model
        from fsd_local.llama.options import ModelOptions

        loaded = Model(ModelOptions(path, vocab_only=True), "vocabulary")
        try:
            table = read_table(loaded)
        finally:
            loaded.close()
    else:
        table = read_table(model)
    save_arrays(where, *_to_disk(table))
    return table
