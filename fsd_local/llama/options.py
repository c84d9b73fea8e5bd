"""How to load one model: options that need nothing loaded (the command line builds them before llama.cpp is
imported, so `fsd-local --help` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}  # enum ggml_type
UNQUANTISED_KV = ("f32", "f16", "bf16")
# enum llama_split_mode. none: the whole model on main_gpu; layer: layers spread over the GPUs; row: rows of each
# matrix spread
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}


@dataclass
class ModelOptions:
    """How to load one model. `n_gpu_layers=-1` offloads every layer when the build has a GPU backend
    (fsd_local.placement chooses counts from free GPU memory). `rpc_servers`: "host:port,..." of llama.cpp
    `ggml-rpc-server`s whose devices this model may use; models without it never touch them."""

    path: str
    n_ctx: int = 4096
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int = -1
    n_batch: int = 512
    # sequences the context holds at once (llama.cpp's n_seq_max; llama/seq_batch.py decodes several in one batch).
    # n_ctx is then every sequence's cells together: shared when kv_unified, else n_ctx / n_seq each (llama.cpp
    # rounds a sequence's share up to 256)
    n_seq: int = 1
    kv_unified: bool = True
    # where the model keeps a recurrent state (kv_cache.py): n_rs_seq, the trailing tokens of a decode call it can
    # drop by llama.cpp's snapshots (architectures without them: none); checkpoint, where it gets no snapshots, a
    # spare sequence each holding an earlier state of its sequence (Model.checkpoint). Transformers ignore both
    n_rs_seq: int = 0
    checkpoint: bool = False
    main_gpu: int = 0
    split_mode: str = "layer"
    tensor_split: list[float] | None = None
    flash_attn: bool | None = None  # None = llama.cpp decides
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    use_mmap: bool = True
    use_mlock: bool = False
    rpc_servers: str | None = None
    vocab_only: bool = False  # tokenizer and metadata only: no weights, no context (doctor's compatibility check)
    # llama.cpp's extra buffer types (repacked weights, AMX): None = decide for this host (cpu_features.py),
    # True/False = --repack / --no-repack
    repack: bool | None = None
    extra: dict = field(default_factory=dict)
