"""The cost-realistic demo target (`--demo wide`): SmolLM2's function at a ~1.4B model's cost, every matrix padded
with zeros to a wider shape so that the function stays the narrow model's up to rounding, written as F16 and
quantised to Q8_0 by llama.cpp's own quantiser (docs/design.md, "The demo targets")."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

from fsd_local.errors import ModelLoadError

WIDE_BLOCKS = list(range(0, 16)) + [14, 15] + list(range(16, 30))
WIDE_SHAPE = {"width": 1920, "ffn": 5120}  # 30 heads, 10 KV heads for SmolLM2's head dim 64
WIDE_NOTE = (
    "wide demo target: SmolLM2-135M's function padded with zeros to a ~1.4B model's shape (32 layers, width "
    "1920, Q8_0): it costs what a larger model costs on this machine while computing what the small one does."
)
Q8_0_BYTES_PER_WEIGHT = 34 / 32  # 32 int8 weights and one F16 scale per block


def _spec(reader, arch: str, width: int, ffn: int) -> dict:
    """The narrow shape and the wide one; raises ModelLoadError if the padding cannot keep the function."""

    def get(key):
        f = reader.fields.get(f"{arch}.{key}")
        return None if f is None else f.contents()

    h, f, heads = int(get("embedding_length")), int(get("feed_forward_length")), int(get("attention.head_count"))
    kv = int(get("attention.head_count_kv") or heads)
    hd = h // heads
    if arch != "llama":
        raise ModelLoadError(f"widening pads a llama-architecture GGUF; this one is {arch!r}")
    heads_w = width // hd
    if width % hd or width < h or ffn < f or (heads_w * kv) % heads:
        raise ModelLoadError(
            f"width {width} must be a multiple of the model's head dim {hd}, at least its width {h}, and give a "
            f"whole number of KV heads ({kv} per {heads} heads); ffn {ffn} at least its {f}"
        )
    kv_w = heads_w * kv // heads
    return {
        "h": h,
        "f": f,
        "heads": heads,
        "kv": kv,
        "hd": hd,
        "width": width,
        "ffn": ffn,
        "heads_w": heads_w,
        "kv_w": kv_w,
    }


def _wide_shape(name: str, shape: tuple, sp: dict) -> tuple:
    """The padded numpy shape of a tensor (numpy order: output rows first, then input columns)."""
    grow = {sp["h"]: sp["width"], sp["kv"] * sp["hd"]: sp["kv_w"] * sp["hd"], sp["f"]: sp["ffn"]}
    if name in ("token_embd.weight", "output.weight"):  # vocabulary rows stay
        return (shape[0], sp["width"])
    return tuple(grow.get(n, n) for n in shape)


def _pad(name: str, data, sp: dict):
    import numpy as np

    shape = _wide_shape(name, data.shape, sp)
    out = np.zeros(shape, np.float32)
    out[tuple(slice(0, n) for n in data.shape)] = data
    if name.endswith("norm.weight"):
        out *= math.sqrt(sp["h"] / sp["width"])
    return out


def estimate_bytes(src: str | os.PathLike, blocks: list[int], width: int, ffn: int) -> int:
    """Bytes of the Q8_0 file `widen` writes (within a few kB of header)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(src))
    sp = _spec(reader, reader.fields["general.architecture"].contents(), width, ffn)
    total = 0
    for t in reader.tensors:
        name, shape = t.name, tuple(int(n) for n in reversed(t.shape))
        n = math.prod(_wide_shape(name, shape, sp))
        size = n * 4 if len(shape) == 1 else n * Q8_0_BYTES_PER_WEIGHT
        if name.startswith("blk."):
            size *= len(blocks) / len({int(x.name.split(".")[1]) for x in reader.tensors if x.name.startswith("blk.")})
        total += size
    return int(total)


def widen(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    blocks: list[int],
    width: int,
    ffn: int,
    quantize: str | None = "q8_0",
    threads: int = 0,
) -> Path:
    """Write the model `src` padded with zeros to `width` (heads scaled alike) and `ffn`, with transformer blocks
    `blocks` of the source renumbered 0..n-1; quantize "q8_0" (llama.cpp's quantiser) or None (F32, exact).
    Written to temporary files next to dst, then renamed."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter, LlamaFileType

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    sp = _spec(reader, arch, width, ffn)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    out_dtype = np.float16 if quantize else np.float32
    set_to = {
        f"{arch}.block_count": len(blocks),
        f"{arch}.embedding_length": width,
        f"{arch}.feed_forward_length": ffn,
        f"{arch}.attention.head_count": sp["heads_w"],
        f"{arch}.attention.head_count_kv": sp["kv_w"],
        "general.file_type": int(LlamaFileType.MOSTLY_F16 if quantize else LlamaFileType.ALL_F32),
    }
    parts: list[str] = []
    try:
        fd, flat = tempfile.mkstemp(dir=dst.parent, suffix=".partial")
        os.close(fd)
        parts.append(flat)
        writer = GGUFWriter(flat, arch)
        _copy_fields(reader, writer, set_to, f"{arch}.attention.layer_norm_rms_epsilon", sp["h"], width)
        _write_tensors(writer, _tensor_order(reader, blocks, src), sp, out_dtype)
        writer.close()
        if quantize:
            _quantize(flat, dst, quantize, threads, parts)
        else:
            os.chmod(flat, 0o644)
            os.replace(flat, dst)
    finally:
        for p in parts:
            if os.path.exists(p):
                os.unlink(p)
    return dst


def _copy_fields(reader, writer, set_to: dict, eps_key: str, h: int, width: int) -> None:
    """Every metadata field of the source, those in `set_to` replaced and the norm's epsilon scaled by h / width."""
    from gguf import GGUFValueType

    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in set_to:
            writer.add_uint32(name, set_to[name])
        elif name == eps_key:  # the mean of squares is over width dims now (docs/design.md, "The demo targets")
            writer.add_float32(name, float(f.contents()) * h / width)
        else:
            vtype = f.types[0]
            writer.add_key_value(
                name, f.contents(), vtype, sub_type=f.types[1] if vtype == GGUFValueType.ARRAY else None
            )


def _tensor_order(reader, blocks: list[int], src) -> list[tuple[str, Any]]:
    """(new name, source tensor) in the written order: the embedding, blocks `blocks` renumbered, the rest."""
    per_block: dict[int, list] = {}
    others = []
    for t in reader.tensors:
        parts_ = t.name.split(".", 2)
        if parts_[0] == "blk":
            per_block.setdefault(int(parts_[1]), []).append((parts_[2], t))
        else:
            others.append((t.name, t))
    missing = sorted(set(blocks) - set(per_block))
    if missing:
        raise ModelLoadError(f"{src} has no blocks {missing}")
    order = [(n, t) for n, t in others if n == "token_embd.weight"]
    for new_i, old_i in enumerate(blocks):
        order += [(f"blk.{new_i}.{suffix}", t) for suffix, t in per_block[old_i]]
    return order + [(n, t) for n, t in others if n != "token_embd.weight"]


def _write_tensors(writer, order: list[tuple[str, Any]], sp: dict, out_dtype) -> None:
    """The header, then each tensor widened (one in memory at a time); vectors stay F32."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    def narrow(t):
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return np.asarray(t.data, np.float32)
        return quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    for name, t in order:
        shape = _wide_shape(name, tuple(int(n) for n in reversed(t.shape)), sp)
        dtype = np.float32 if len(shape) == 1 else out_dtype
        writer.add_tensor_info(name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, t in order:
        base = name.split(".", 2)[-1] if name.startswith("blk.") else name
        data = _pad(base, narrow(t).reshape(tuple(int(n) for n in reversed(t.shape))), sp)
        writer.write_tensor_data(data.astype(np.float32 if data.ndim == 1 else out_dtype))


def _quantize(src: str, dst: Path, kind: str, threads: int, parts: list) -> None:
    from fsd_local.llama.bindings import init_backend, lc

    ftypes = {"q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0}
    if kind not in ftypes:
        raise ModelLoadError(f"quantize {kind!r}: choose one of {', '.join(ftypes)}")
    init_backend()
    fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".partial")
    os.close(fd)
    parts.append(tmp)
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftypes[kind]
    params.nthread = threads
    rc = lc.llama_model_quantize(src.encode(), tmp.encode(), params)
    if rc != 0:
        raise ModelLoadError(f"llama.cpp could not quantise {src} to {kind} (code {rc})")
    os.chmod(tmp, 0o644)
    os.replace(tmp, dst)
