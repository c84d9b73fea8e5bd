"""Tiny llama-architecture GGUF models written with the `gguf` package, for fast tests on real llama.cpp.

Weights are random but deterministic; a draft/target pair shares a base and differs by `noise`, so the
draft agrees with the target often but not always (what speculative decoding needs to be exercised).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# single characters: llama.cpp's SPM tokenizer merges pairs, so multi-character pieces would need every
# intermediate piece in the vocabulary too
WORDS = ["▁"] + list("abcdefghijklmnopqrstuvwxyz") + [".", ",", "!", "?", "é", "€"]


def vocabulary(byte_tokens: bool = True, words=WORDS, control=()):
    """`control`: more special (CONTROL) tokens, after the words (e.g. a template's tool-call marker)."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    if byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [6] * 256  # BYTE
    tokens += list(words) + list(control)
    types += [1] * len(words) + [3] * len(control)
    scores = [0.0] * 3 + [-1000.0] * (256 if byte_tokens else 0) + [-float(i) for i in range(len(words))]
    return tokens, scores + [0.0] * len(control), types


def add_tokenizer(w, tokens, scores, types, eos: int = 2) -> None:
    """SPM ("llama") tokenizer metadata shared by every tiny model: <unk>=0, <s>=1 (added), `eos` (</s>=2)."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(True)


# A second tokenizer, byte-level BPE ("gpt2") as SmolLM2, Qwen and Llama 3 use, to test drafting across
# vocabularies against the SentencePiece one above: every byte is a token (GPT-2's byte-to-character table),
# merges make whole words that the SentencePiece vocabulary splits into letters, and the two end a turn with
# different tokens. Ids differ from the SentencePiece vocabulary's throughout.
BPE_WORDS = ["the", "he", " the", " a", "an", " an", "and", " and", "ab", " cab", "é", " é"]
BPE_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # eos: <|im_end|>
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_chars() -> list[str]:
    """GPT-2's byte-to-character table: byte b is written as chr(table[b]) in a byte-level BPE vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def bpe_vocabulary(words=BPE_WORDS, control=BPE_CONTROL):
    """(tokens, types, merges): the control tokens first, the 256 bytes in a shuffled order (so no id means
    the same as in the SentencePiece vocabulary), then each word with the merges that build it left to right."""
    table = byte_chars()
    order = np.random.default_rng(7).permutation(256)
    tokens = list(control) + [table[b] for b in order]
    types = [3] * len(control) + [1] * 256
    merges: list[str] = []
    for word in words:
        chars = [table[b] for b in word.encode("utf-8")]
        for i in range(2, len(chars) + 1):
            left, right = "".join(chars[: i - 1]), chars[i - 1]
            if left + right not in tokens:
                tokens.append(left + right)
                types.append(1)
                merges.append(f"{left} {right}")
    return tokens, types, merges


def add_bpe_tokenizer(w, tokens, types, merges) -> None:
    """Byte-level BPE metadata: no BOS added, <|im_end|> ends a turn (the chat template's end of turn)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def seeded_weights(base_seed: int, seed: int, noise: float, dtype=np.float32):
    """weight(*shape, scale=None): a random matrix of a base shared by every model of `base_seed`, plus `noise`
    times this model's own (`seed`); scale defaults to 1/sqrt(the last dimension)."""
    base = np.random.default_rng(base_seed)
    mine = np.random.default_rng(seed)

    def weight(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        w = base.standard_normal(shape) * scale
        if noise:
            w = w + mine.standard_normal(shape) * scale * noise
        return w.astype(dtype)

    return weight


def add_ffn(w, i: int, weight, n_embd: int, n_ff: int, down_scale: float = 1.0) -> None:
    """Block i's norm and SwiGLU feed-forward tensors (its write to the residual stream scaled by down_scale)."""
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff, scale=down_scale / np.sqrt(n_ff)))


def tensors_of(path) -> dict:
    """Every tensor of the GGUF at `path` by name ({} for None): what a `lexicon_of` model takes from it."""
    import gguf

    return {} if path is None else {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


def finish(w) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gguf(
    path,
    *,
    seed: int = 0,
    base_seed: int = 1234,
    noise: float = 0.0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int | None = None,
    n_ff: int = 128,
    n_ctx: int = 512,
    byte_tokens: bool = True,
    words=WORDS,
    logit_scale: float = 1.0,
    dtype=np.float32,
    control=(),
    split_max_tensors: int = 0,
    tokenizer: str = "spm",
    block_scale: float = 1.0,
) -> Path:
    """split_max_tensors > 0: written as llama.cpp's split files (PATH-00001-of-0000N.gguf, ...); the first
    part's path is returned. tokenizer "bpe": the byte-level BPE vocabulary (bpe_vocabulary) instead.
    block_scale: the scale of the blocks' writes to the residual stream (write_tiny_lfm2_gguf's lexicon_of)."""
    import gguf

    if tokenizer == "bpe":
        tokens, types, merges = bpe_vocabulary()
    else:
        tokens, scores, types = vocabulary(byte_tokens, words, control)
    n_vocab = len(tokens)
    weight = seeded_weights(base_seed, seed, noise, dtype)

    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    w.add_name(f"tiny-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    n_kv = n_head_kv or n_head
    n_embd_kv = n_embd // n_head * n_kv
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    if tokenizer == "bpe":
        add_bpe_tokenizer(w, tokens, types, merges)
    else:
        add_tokenizer(w, tokens, scores, types)
    w.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    ones = np.ones(n_embd, dtype=np.float32)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            rows = n_embd_kv if name in ("attn_k", "attn_v") else n_embd
            scale = block_scale / np.sqrt(n_embd) if name == "attn_output" else None
            w.add_tensor(f"blk.{i}.{name}.weight", weight(rows, n_embd, scale=scale))
        add_ffn(w, i, weight, n_embd, n_ff, down_scale=block_scale)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", weight(n_vocab, n_embd, scale=logit_scale / np.sqrt(n_embd) * 3))
    finish(w)
    if split_max_tensors:
        return next(Path(path).parent.glob(Path(path).stem + "-00001-of-*.gguf"))
    return Path(path)


def write_tiny_mamba_gguf(
    path,
    *,
    seed: int = 0,
    n_embd: int = 32,
    n_layer: int = 1,
    d_state: int = 4,
    d_conv: int = 4,
    dt_rank: int = 4,
    n_ctx: int = 512,
    byte_tokens: bool = True,
    words=WORDS,
    lexicon_of=None,
    block_scale: float = 1.0,
) -> Path:
    """A tiny Mamba (recurrent, state-space) model sharing `vocabulary()` with write_tiny_gguf: llama.cpp
    reports it as recurrent, so its per-sequence state cannot be rewound to an earlier position.

    Tensor names and ggml shapes follow the vendored llama.cpp's llama_model_mamba::load_arch_tensors
    (numpy shapes are the ggml shapes reversed); llama.cpp only supports d_inner == 2 * n_embd. `lexicon_of`
    and `block_scale` as write_tiny_lfm2_gguf's: a Mamba that agrees often with a tiny llama of its width."""
    import gguf

    tokens, scores, types = vocabulary(byte_tokens, words)
    n_vocab = len(tokens)
    d_inner = 2 * n_embd
    rng = np.random.default_rng(seed)
    lexicon = tensors_of(lexicon_of)

    def weight(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_name(f"tiny-mamba-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    add_tokenizer(w, tokens, scores, types)
    embd = weight(n_vocab, n_embd, scale=1.0)
    w.add_tensor("token_embd.weight", lexicon.get("token_embd.weight", embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_in.weight", weight(2 * d_inner, n_embd))
        w.add_tensor(f"blk.{i}.ssm_conv1d.weight", weight(d_inner, d_conv))
        w.add_tensor(f"blk.{i}.ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_x.weight", weight(dt_rank + 2 * d_state, d_inner))
        w.add_tensor(f"blk.{i}.ssm_dt.weight", weight(d_inner, dt_rank))
        w.add_tensor(f"blk.{i}.ssm_dt.bias", np.zeros(d_inner, dtype=np.float32))
        # A = -exp(A_log) as the HF converter stores it: S4D-real initialisation, negative so the state decays
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
        w.add_tensor(f"blk.{i}.ssm_a", a)
        w.add_tensor(f"blk.{i}.ssm_d", np.ones(d_inner, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_out.weight", weight(n_embd, d_inner, scale=block_scale / np.sqrt(d_inner)))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    output = weight(n_vocab, n_embd)
    w.add_tensor("output.weight", lexicon.get("output.weight", output))
    finish(w)
    return Path(path)


def write_tiny_lfm2_gguf(
    path,
    *,
    seed: int = 0,
    base_seed: int = 4321,
    noise: float = 0.0,
    n_embd: int = 64,
    layers: str = "cca",
    n_head: int = 4,
    n_ff: int = 128,
    l_cache: int = 3,
    n_ctx: int = 512,
    byte_tokens: bool = True,
    words=WORDS,
    logit_scale: float = 1.0,
    lexicon_of=None,
    block_scale: float = 1.0,
) -> Path:
    """A tiny LFM2 (hybrid: short-convolution blocks, whose state is recurrent, and attention blocks), F32,
    sharing `vocabulary()` with write_tiny_gguf. `layers`: one letter a block, "c" convolution, "a" attention;
    like write_tiny_gguf, two of these with one base_seed and different `noise` agree often but not always.

    Tensor names and ggml shapes follow the vendored llama.cpp's llama_model_lfm2::load_arch_tensors (numpy
    shapes are the ggml shapes reversed); a block is recurrent where its KV head count is 0.

    `lexicon_of`: a GGUF of this vocabulary and width (a write_tiny_gguf model) whose token embeddings and output
    matrix this model takes, its blocks' writes to the residual stream scaled by `block_scale`: the two lean on
    one token-to-token map, so a transformer and a hybrid agree often (a pair across architectures)."""
    import gguf

    tokens, scores, types = vocabulary(byte_tokens, words)
    n_vocab, n_layer, head = len(tokens), len(layers), n_embd // n_head
    weight = seeded_weights(base_seed, seed, noise)
    lexicon = tensors_of(lexicon_of)
    out = block_scale / np.sqrt(n_embd)  # the scale of what a block writes to the residual stream

    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_name(f"tiny-lfm2-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv([n_head if kind == "a" else 0 for kind in layers])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head)
    w.add_uint32(gguf.Keys.ShortConv.L_CACHE.format(arch="lfm2"), l_cache)
    add_tokenizer(w, tokens, scores, types)
    embd = weight(n_vocab, n_embd, scale=1.0)
    w.add_tensor("token_embd.weight", lexicon.get("token_embd.weight", embd))
    ones = np.ones(n_embd, dtype=np.float32)
    for i, kind in enumerate(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        if kind == "a":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head, dtype=np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head, dtype=np.float32))
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                scale = out if name == "attn_output" else None
                w.add_tensor(f"blk.{i}.{name}.weight", weight(n_embd, n_embd, scale=scale))
        elif kind == "c":
            w.add_tensor(f"blk.{i}.shortconv.conv.weight", weight(n_embd, l_cache, scale=0.5))
            w.add_tensor(f"blk.{i}.shortconv.in_proj.weight", weight(3 * n_embd, n_embd))
            w.add_tensor(f"blk.{i}.shortconv.out_proj.weight", weight(n_embd, n_embd, scale=out))
        else:
            raise ValueError(f"layers: {kind!r} is neither 'c' (convolution) nor 'a' (attention)")
        add_ffn(w, i, weight, n_embd, n_ff, down_scale=block_scale)
    w.add_tensor("token_embd_norm.weight", ones)
    output = weight(n_vocab, n_embd, scale=logit_scale / np.sqrt(n_embd) * 3)
    w.add_tensor("output.weight", lexicon.get("output.weight", output))
    finish(w)
    return Path(path)
