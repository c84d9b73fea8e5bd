"""One GGUF model through llama-cpp-python's low-level API: its own model, context, batch and KV sequences.
`tokens` mirrors what sequence 0's cache holds (`seqs`, one list per sequence, where ModelOptions.n_seq > 1), so
the engine rewinds by position (`truncate`) and reuses the longest common prefix (`keep_common_prefix`)."""

from __future__ import annotations

import ctypes
import os
from time import perf_counter
from typing import Any

import numpy as np

from fsd_local.errors import ModelLoadError
from fsd_local.llama import backend
from fsd_local.llama.bindings import clear_log, default_threads, init_backend, lc, recent_log
from fsd_local.llama.cpu_features import repack_choice
from fsd_local.llama.kv_cache import SEQ, SequenceCache
from fsd_local.llama.options import KV_TYPES, SPLIT_MODES, UNQUANTISED_KV, ModelOptions
from fsd_local.llama.samplers import BackendSampler, wanted

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ


def check_gguf_file(path: str, role: str = "model") -> None:
    """Fail early, in words, on what llama.cpp would only log: missing, unreadable, or not GGUF."""
    if not path:
        raise ModelLoadError(f"no {role} model given: pass a .gguf file path")
    if not os.path.exists(path):
        raise ModelLoadError(f"{role} model file not found: {path} (check the path, or `fsd-local pull` a pair)")
    if os.path.isdir(path):
        raise ModelLoadError(f"{role} model path is a directory, not a .gguf file: {path}")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {role} model file {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{role} model {path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "convert it with llama.cpp's convert_hf_to_gguf.py or download a .gguf build"
        )


def _check_options(opts: ModelOptions, role: str) -> None:
    """Say what is wrong before llama.cpp fails with a log line."""
    for name in ("cache_type_k", "cache_type_v"):
        if getattr(opts, name) not in KV_TYPES:
            raise ModelLoadError(
                f"{role}: unknown KV cache type {getattr(opts, name)!r}; choose one of {', '.join(KV_TYPES)}"
            )
    if opts.flash_attn is False and opts.cache_type_v not in UNQUANTISED_KV:
        raise ModelLoadError(
            f"{role}: a quantised V cache ({opts.cache_type_v}) needs flash attention; "
            "use --flash-attn on or auto, or an f16 V cache"
        )
    if not 1 <= opts.n_seq <= MAX_SEQ:
        raise ModelLoadError(f"{role}: {opts.n_seq} sequences asked; a context holds 1 to {MAX_SEQ} (--parallel)")
    if opts.split_mode not in SPLIT_MODES:
        raise ModelLoadError(f"{role}: unknown split mode {opts.split_mode!r}; choose one of {', '.join(SPLIT_MODES)}")
    if opts.tensor_split and (
        len(opts.tensor_split) > lc.llama_max_devices()
        or any(x < 0 for x in opts.tensor_split)
        or not any(opts.tensor_split)
    ):
        raise ModelLoadError(
            f"{role}: tensor split {opts.tensor_split} must be at most {lc.llama_max_devices()} "
            "non-negative proportions, one per GPU, not all zero (e.g. 3,1)"
        )


def _device_list(opts: ModelOptions):
    """None = llama.cpp's default device choice; once any model registered RPC servers, an explicit NULL-terminated
    list: a model's own servers' devices first, then the local ones (docs/design.md, "llama.cpp underneath")."""
    if opts.rpc_servers:
        endpoints = backend.add_rpc_servers(opts.rpc_servers)
        if opts.vocab_only:
            return None
        devices = backend.rpc_devices(endpoints) + backend.local_offload_devices()
        return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
    if not backend.rpc_registered() or opts.vocab_only:
        return None
    local = backend.local_offload_devices()
    return (ctypes.c_void_p * (len(local) + 1))(*local, None)


def _vocab_size(path: str) -> int | None:
    """The size of the file's vocabulary, loaded alone (None: not even that loads)."""
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    model = lc.llama_model_load_from_file(path.encode(), mp)
    if not model:
        return None
    try:
        return lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    finally:
        lc.llama_model_free(model)


def _no_tokenizer(role: str, path: str) -> str:
    return (
        f"{role} model {path} has no tokenizer (no token list in the GGUF): fsd-local needs the model's vocabulary; "
        "convert it again with its tokenizer, or use a GGUF from the model's publisher"
    )


# llama_get_logits returning the address itself (llama-cpp-python's binding returns a float pointer to cast)
_logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ctypes.cast(lc.llama_get_logits, ctypes.c_void_p).value or 0
)


class Model(SequenceCache):
    def __init__(self, opts: ModelOptions, role: str = "model"):
        self.opts = opts
        self.role = role
        self.path = opts.path
        self.model = self.ctx = None
        self._batch = None
        check_gguf_file(opts.path, role)
        _check_options(opts, role)
        init_backend()
        self._load_weights(opts, role)
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        if self.n_vocab <= 0:  # vocabulary-only, llama.cpp loads it, then aborts the process at the first tokenisation
            self.close()
            raise ModelLoadError(_no_tokenizer(role, opts.path))
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}  # is_eog's answers: asked of every draft and every emitted token
        self._piece_buf = ctypes.create_string_buffer(256)
        if opts.vocab_only:
            return
        self._create_context(opts)
        self.tokens: list[int] = []
        # what each sequence's cache holds; edited in place, so seqs[0] stays the list `tokens` names
        self.seqs: list[list[int]] = [self.tokens] + [[] for _ in range(1, self.n_seq)]
        self.n_outputs = 0
        self.decode_seconds = 0.0  # time spent inside llama.cpp's decode calls, for the loop's own time (stats)
        self._view: np.ndarray | None = None  # the output buffer as an array, kept while llama.cpp keeps it
        self._view_addr: int | None = None
        # Where every device is the host (a CPU-only build, no RPC server), llama_decode has finished writing the
        # rows when it returns, and llama.cpp reallocates its output buffer only to grow it: while no decode
        # outputs more rows than the view at the address last read holds (decode() forgets the view when one
        # does, whether or not its rows are read), the buffer is where it was and `logits` needs no call into
        # llama.cpp (each costs ~7-10 us after a CPU decode has evicted the caches, five times a round). Any
        # other build synchronises through llama_get_logits every time.
        self._host_only = not lc.llama_supports_gpu_offload() and not opts.rpc_servers
        self._view_rows = 0  # rows known to fit the buffer at _view_addr (0: read the address again)
        self.sampler = BackendSampler(self.ctx, SEQ, self._device_sampling)  # llama/samplers.py

    def _load_weights(self, opts: ModelOptions, role: str) -> None:
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = opts.n_gpu_layers if opts.n_gpu_layers >= 0 else 2**31 - 1
        mp.split_mode = SPLIT_MODES[opts.split_mode]
        mp.main_gpu = opts.main_gpu
        mp.vocab_only = opts.vocab_only
        self.repack = repack_choice(opts.repack)
        mp.use_extra_bufts = self.repack.repack
        mp.load_mode = (lc.LLAMA_LOAD_MODE_MMAP if opts.use_mmap else lc.LLAMA_LOAD_MODE_NONE) | (
            lc.LLAMA_LOAD_MODE_MLOCK if opts.use_mlock else 0
        )
        if opts.tensor_split:  # llama.cpp reads llama_max_devices() entries
            self._tensor_split = (ctypes.c_float * lc.llama_max_devices())(*opts.tensor_split)
            mp.tensor_split = self._tensor_split
        self._devices = _device_list(opts)
        if self._devices is not None:
            mp.devices = ctypes.cast(self._devices, ctypes.c_void_p).value
        clear_log()
        self.model = lc.llama_model_load_from_file(opts.path.encode(), mp)
        if not self.model:
            if not opts.vocab_only and _vocab_size(opts.path) == 0:  # its embeddings cannot fit no vocabulary
                raise ModelLoadError(_no_tokenizer(role, opts.path))
            raise ModelLoadError(
                f"llama.cpp could not load {role} model {opts.path} (corrupt, truncated, or an architecture "
                f"this llama.cpp build does not know): {recent_log() or 'no details logged'}"
            )
        self.architecture = self.meta("general.architecture") or "unknown"
        self.recurrent = bool(lc.llama_model_is_recurrent(self.model) or lc.llama_model_is_hybrid(self.model))

    def _create_context(self, opts: ModelOptions) -> None:
        """The context (opts' sequences, sizes and KV types) and its batch for sequence 0, filled by vector
        writes."""
        # a recurrent state rewinds by snapshots where asked and the architecture keeps them (llama.cpp reads
        # n_rs_seq back as 0 where it does not), else, with opts.checkpoint, by a spare sequence each: sequence
        # n_seq + s shares sequence s's cells (a unified cache), its recurrent state copied only when s decodes on.
        # Never both (seq_cp ignores a pending snapshot index), and snapshots for one sequence only: several
        # sequences in one decode leave some rolled back wrong (docs/measurements/recurrent-batch.md)
        one = self.recurrent and opts.n_seq == 1
        spare = opts.checkpoint and self.recurrent and (opts.n_rs_seq <= 0 or not one)
        self.ctx = self._new_context(opts, one and not spare, spare)
        if opts.checkpoint and one and not spare and lc.llama_n_rs_seq(self.ctx) == 0:
            lc.llama_free(self.ctx)  # no snapshots for this architecture (Mamba, RWKV, ...): spares instead
            self.ctx, spare = None, True
            self.ctx = self._new_context(opts, False, True)
        self.n_ctx: int = lc.llama_n_ctx_seq(self.ctx)  # the most one sequence holds
        self.n_cells: int = lc.llama_n_ctx(self.ctx)  # every sequence's together
        self.n_seq: int = lc.llama_n_seq_max(self.ctx) // (2 if spare else 1)
        self.n_rs_seq: int = lc.llama_n_rs_seq(self.ctx)  # 0 where the architecture has no snapshots
        self._spare = self.n_seq if spare else -1
        self.forget_states()
        self.rewinds = not self.recurrent or spare or self.n_rs_seq > 0
        self._shared = self.n_cells < self.n_seq * self.n_ctx  # a unified cache: the sequences share its cells
        self.n_batch: int = opts.n_batch
        self.mem: Any = lc.llama_get_memory(self.ctx)
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        # the batch's arrays as NumPy views, filled with one vector write each per decode; one sequence, set once
        b, nb = self._batch, self.n_batch
        self._token = np.ctypeslib.as_array(b.token, (nb,))
        self._pos = np.ctypeslib.as_array(b.pos, (nb,))
        self._want = np.ctypeslib.as_array(b.logits, (nb,))
        np.ctypeslib.as_array(b.n_seq_id, (nb,))[:] = 1
        for j in range(nb):
            b.seq_id[j][0] = SEQ
        self._at = np.arange(self.n_ctx, dtype=np.int32)  # each position, to copy from
        self._token_p, self._pos_p, self._want_p = b.token, b.pos, b.logits

    def _new_context(self, opts: ModelOptions, snapshots: bool, spare: bool):
        """A llama.cpp context for opts, with its snapshots (opts.n_rs_seq) and a spare sequence where asked."""
        cp = lc.llama_context_default_params()
        cp.n_ctx = opts.n_ctx
        cp.n_batch = cp.n_ubatch = opts.n_batch
        cp.n_seq_max = opts.n_seq * (2 if spare else 1)
        cp.kv_unified = opts.kv_unified or spare
        cp.n_rs_seq = opts.n_rs_seq if snapshots else 0
        cp.n_threads = opts.n_threads or default_threads()
        cp.n_threads_batch = opts.n_threads_batch or cp.n_threads
        cp.no_perf = True
        self._device_sampling = wanted(opts.n_gpu_layers, bool(opts.rpc_servers), self.n_layer)
        if self._device_sampling:  # a backend sampler picks a token for every output row: a verify batch's too
            cp.n_outputs_max_per_seq = opts.n_batch
        if opts.flash_attn is not None:
            cp.flash_attn_type = (
                lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if opts.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        cp.type_k, cp.type_v = KV_TYPES[opts.cache_type_k], KV_TYPES[opts.cache_type_v]
        ctx = lc.llama_init_from_model(self.model, cp)
        if not ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for {opts.path}: {recent_log()}")
        return ctx

    # ---------------------------------------------------------------- metadata
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    @property
    def n_layer(self) -> int:
        return lc.llama_model_n_layer(self.model)

    @property
    def bos(self) -> int:
        return lc.llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return lc.llama_vocab_eos(self.vocab)

    @property
    def add_bos(self) -> bool:
        return bool(lc.llama_vocab_get_add_bos(self.vocab))

    def is_eog(self, token: int) -> bool:
        e = self._eog.get(token)
        if e is None:
            e = self._eog[token] = bool(lc.llama_vocab_is_eog(self.vocab, token))
        return e

    def token_text(self, token: int) -> bytes:
        return lc.llama_vocab_get_text(self.vocab, token) or b""

    # ---------------------------------------------------------------- text <-> tokens
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token renders to (special tokens render as nothing). Cached: called per emitted token."""
        b = self._pieces.get(token)
        if b is None:
            n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self.vocab, token, big, -n, 0, False)
                b = big.raw[:n]
            else:
                b = self._piece_buf.raw[:n]
            self._pieces[token] = b
        return b

    def detokenize(self, tokens) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def decode(self, tokens, logits: str = "last") -> None:
        """Append tokens to the cache. logits: 'last', 'none', or 'from:J' (rows for tokens[J:])."""
        if not tokens:
            return
        if len(tokens) == 1 and logits == "last":
            self.decode_one(tokens[0])
            return
        self._check_room(len(tokens))
        first_row = len(tokens) - 1 if logits == "last" else (len(tokens) if logits == "none" else int(logits[5:]))
        if len(tokens) > self.n_batch and first_row < len(tokens) - self.n_batch:
            raise ValueError("logit rows must fit in one batch")
        b = self._batch
        assert b is not None, f"{self.role} model is closed"
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            n, base = len(chunk), len(self.tokens)
            self._token[:n] = chunk
            self._pos[:n] = self._at[base : base + n]  # a copy: np.add(out=) costs twice as much cold
            self._want[:n] = 1
            self._want[: max(0, first_row - start)] = 0
            b.n_tokens = n
            t = perf_counter()
            rc = lc.llama_decode(self.ctx, b)
            self.decode_seconds += perf_counter() - t
            if rc != 0:
                self._failed(rc)
            self.tokens.extend(chunk)
            self._call[SEQ] = (len(self.tokens), n)  # what a recurrent state's snapshots can roll back (kv_cache.py)
            self.n_outputs = len(chunk) - min(len(chunk), max(0, first_row - start))
            if self.n_outputs > self._view_rows:  # llama.cpp may have grown (moved) its buffer: read it again
                self._view_rows = 0

    def decode_one(self, token: int) -> None:
        """decode([token], "last"): the draft's inner loop and every plain step, so it does nothing else (after a
        CPU decode every line runs on evicted caches): three stores into the batch, the call, the bookkeeping."""
        self._check_room(1)
        b = self._batch
        assert b is not None, f"{self.role} model is closed"
        self._token_p[0], self._pos_p[0], self._want_p[0] = token, len(self.tokens), 1
        b.n_tokens = 1
        t = perf_counter()
        rc = lc.llama_decode(self.ctx, b)
        self.decode_seconds += perf_counter() - t
        if rc != 0:
            self._failed(rc)
        self.tokens.append(token)
        self.n_outputs = 1

    def _failed(self, rc: int, seq_ids=(SEQ,)) -> None:
        # on failure llama.cpp restores the cache except after an abort or a fatal error; it may have grown (moved)
        # its output buffer before failing, so the view is read again
        self._view_rows, self._call = 0, [(0, 0)] * self.n_seq
        for s in seq_ids:
            del self.seqs[s][self._pos_max(s) + 1 :]
        raise RuntimeError(f"llama_decode failed for the {self.role} model (code {rc}): {recent_log()}")

    def synchronize(self) -> None:
        t = perf_counter()
        lc.llama_synchronize(self.ctx)
        self.decode_seconds += perf_counter() - t

    def logits(self, rows: int | None = None) -> np.ndarray:
        """Zero-copy view of the last decode's last `rows` logit rows (default: all it output), shape (rows,
        n_vocab); valid until the next decode. llama.cpp keeps the output rows contiguous, in batch order."""
        rows = self.n_outputs if rows is None else rows
        if not 0 < rows <= self.n_outputs:
            raise ValueError(f"{self.role} model: {rows} logit rows asked, the last decode output {self.n_outputs}")
        if self.n_outputs <= self._view_rows:  # host-only: the buffer has not moved (__init__)
            return self._view[self.n_outputs - rows : self.n_outputs]  # type: ignore[index]
        addr = _logits_address(self.ctx)
        if addr is None:
            raise RuntimeError(f"{self.role} model returned no logits: {recent_log()}")
        view = self._view
        if view is None or self._view_addr != addr or view.shape[0] < self.n_outputs:  # llama.cpp moved or grew it
            buf = (ctypes.c_float * (self.n_outputs * self.n_vocab)).from_address(addr)
            view = self._view = np.frombuffer(buf, dtype=np.float32).reshape(self.n_outputs, self.n_vocab)
            self._view_addr = addr
        if self._host_only:
            self._view_rows = view.shape[0]
        return view[self.n_outputs - rows : self.n_outputs]

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        self._view, self._view_rows = None, 0  # the buffer goes with the context
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            lc.llama_free(self.ctx)
            self.ctx = None
            self.sampler.close()  # after the context that held it
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None

    def __del__(self):  # pragma: no cover - deterministic close() is the normal path
        try:
            self.close()
        except Exception:
            pass
