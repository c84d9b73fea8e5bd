"""A recurrent state's shape read from a GGUF header, as the pinned llama.cpp's loaders and llama_hparams decide it:
which layers keep one, which keep a KV cache, the bytes of one layer's state for one sequence, and how many such
rows a context allocates (its sequences, the spare, the snapshots)."""

from __future__ import annotations

# llama.cpp's recurrent and hybrid architectures (llm_arch_is_recurrent / is_hybrid); the loaded model's
# llama_model_is_recurrent / is_hybrid is the authority, this names them before loading
PURE = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
RECURRENT = {
    *PURE,
    *("jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe"),
    *("qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp"),
    *("deepseek4", "minimax-01"),
}
# those whose state llama.cpp rolls back by snapshots (llm_arch_supports_rs_rollback); a loaded context's
# llama_n_rs_seq is the authority
SNAPSHOTS = {"qwen35", "qwen35moe", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "deepseek4", "glm5-next"}
SNAPSHOTS |= {"kimi-k3", "qwen4exp", "bailingmoe3"}
_INTERVAL = {"qwen35", "qwen35moe", "qwen3next", "qwen4exp", "minimax-01"}  # attention every Nth layer (default 4)
KEYS = (  # read by gguf_info as "<architecture>.<key>"
    *("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.group_count", "shortconv.l_cache"),
    *("wkv.head_size", "token_shift_count", "kda.head_dim", "full_attention_interval"),
    *("attention.recurrent_layers", "nextn_predict_layers", "feed_forward_length"),
)
F32 = 4  # llama.cpp keeps recurrent states (and their snapshots) unquantised


def _per_layer(value, n_layer: int, default: int = 0) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value[:n_layer]] + [default] * (n_layer - len(value))
    return [int(value) if isinstance(value, int) else default] * n_layer


def layers(arch: str, meta: dict, n_layer: int, n_head_kv) -> tuple[list[bool], list[int]]:
    """(recurrent, kv_heads) per layer: which layers keep a recurrent state, and the KV heads each caches (0 where a
    layer keeps none)."""
    kv = _per_layer(n_head_kv, n_layer)
    if arch not in RECURRENT:
        return [False] * n_layer, kv
    main = n_layer - int(meta.get("nextn_predict_layers") or 0)  # MTP blocks are attention
    if arch in PURE or arch == "falcon-h1":  # falcon-h1: every layer has both, side by side
        recurrent = [True] * n_layer
    elif isinstance(meta.get("attention.recurrent_layers"), list):
        recurrent = [bool(v) for v in _per_layer(meta["attention.recurrent_layers"], n_layer)]
    elif arch in _INTERVAL:
        every = int(meta.get("full_attention_interval") or 4)
        recurrent = [i < main and (i + 1) % every != 0 for i in range(n_layer)]
    elif arch.startswith("nemotron_h"):  # layers with neither attention nor a feed-forward are Mamba
        ff = _per_layer(meta.get("feed_forward_length"), n_layer, 1)
        recurrent = [h == 0 and f == 0 for h, f in zip(kv, ff)]
    else:
        recurrent = [h == 0 for h in kv]
    if arch != "falcon-h1":
        kv = [0 if r else h for r, h in zip(recurrent, kv)]
    return recurrent, kv


def row_bytes(meta: dict, n_embd: int, n_head: int) -> int:
    """One layer's recurrent state for one sequence: llama_hparams::n_embd_r (convolution or token shift) plus
    n_embd_s (the state proper), F32."""
    d_conv, d_inner = int(meta.get("ssm.conv_kernel") or 0), int(meta.get("ssm.inner_size") or 0)
    d_state, groups = int(meta.get("ssm.state_size") or 0), int(meta.get("ssm.group_count") or 0)
    if wkv := int(meta.get("wkv.head_size") or 0):  # RWKV
        return F32 * (int(meta.get("token_shift_count") or 2) * n_embd + n_embd * wkv)
    if l_cache := int(meta.get("shortconv.l_cache") or 0):  # LFM2's short convolutions
        return F32 * (n_embd * (l_cache - 1) + d_state * d_inner)
    if kda := int(meta.get("kda.head_dim") or 0):  # Kimi's delta attention
        return F32 * (3 * (d_conv - 1 if d_conv else 3) * n_head * kda + kda * kda * n_head)
    return F32 * (max(d_conv - 1, 0) * (d_inner + 2 * groups * d_state) + d_state * d_inner)  # Mamba, gated delta


def copies(arch: str, n_seq: int, n_rs_seq: int, checkpoint: bool) -> tuple[int, int]:
    """(spare sequences, snapshots a row) that a context of these options takes, as Model._create_context asks: a
    spare a sequence for its checkpoints where there are no snapshots (several sequences have none)."""
    snapshots = n_rs_seq if arch in SNAPSHOTS and n_seq == 1 else 0
    return (n_seq if checkpoint and snapshots == 0 else 0), snapshots


def rows(arch: str, n_seq: int, n_rs_seq: int, checkpoint: bool) -> int:
    """The state rows such a context allocates a recurrent layer: each sequence's, the spare's, their snapshots."""
    spare, snapshots = copies(arch, n_seq, n_rs_seq, checkpoint)
    return (n_seq + spare) * (1 + snapshots)
