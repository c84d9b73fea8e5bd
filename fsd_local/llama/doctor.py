"""`fsd-local doctor`: what this installation runs on and what given GGUF files are, as a dict and as text.
Models are read from their headers and, for the draft/target check, loaded vocabulary-only (no weights)."""

from __future__ import annotations

from typing import Any

from fsd_local import __version__
from fsd_local.llama import backend, cpu_features, gguf_info, placement, state_shape
from fsd_local.llama.kv_cache import SAVED_MAX
from fsd_local.llama.model import Model
from fsd_local.llama.options import KV_TYPES, ModelOptions
from fsd_local.llama.vocab import Pairing, pairing

GiB = 1 << 30
MiB = 1 << 20
WELL_KNOWN = ("CUDA", "Metal", "Vulkan", "HIP (ROCm)", "SYCL")


def model_summary(path: str, role: str, opts: ModelOptions | None = None) -> dict:
    """A model's header, and the caches a context of `opts` (default: one sequence at 4096) allocates for it."""
    info = gguf_info.read(path, role)
    opts = opts or ModelOptions(path)
    spare, snapshots = state_shape.copies(info.architecture, opts.n_seq, opts.n_rs_seq, opts.checkpoint)
    rows = state_shape.rows(info.architecture, opts.n_seq, opts.n_rs_seq, opts.checkpoint)
    one = info.state_bytes * sum(info.recurrent)  # one sequence's recurrent state, every layer's
    kv = info.kv_bytes(opts.n_ctx, KV_TYPES[opts.cache_type_k], KV_TYPES[opts.cache_type_v])
    return {
        "path": info.path,
        "architecture": info.architecture,
        "name": info.name,
        "size_bytes": info.file_bytes,
        "quantisation": info.quantisation,
        "tensor_types": info.tensor_types,
        "layers": info.n_layer,
        "context_train": info.n_ctx_train,
        "embedding": info.n_embd,
        "heads": info.n_head,
        "kv_heads": info.n_head_kv,
        "kv_layers": sum(h > 0 for h in info.kv_heads),
        "recurrent_layers": sum(info.recurrent),
        "vocab_size": info.vocab_size,
        "tokenizer": info.tokenizer,
        "chat_template": info.has_chat_template,
        "n_ctx": opts.n_ctx,
        "kv_bytes": sum(kv),
        # llama.cpp's rows (each sequence, a spare for a checkpoint, each row's snapshots) and the host copies a
        # sequence keeps for a next turn (SequenceCache.keep_state)
        "state": {
            "sequence_bytes": one,
            "sequences": opts.n_seq,
            "spare": spare,
            "snapshots": snapshots,
            "device_bytes": one * rows,
            "host_bytes": one * SAVED_MAX,
        }
        if one
        else None,
    }


def _shape(m: dict) -> str:
    """Layers and heads, the recurrent ones apart."""
    heads = f"{m['heads']} heads ({m['kv_heads']} KV)"
    if not m["recurrent_layers"]:
        return f"{m['layers']} layers, embedding {m['embedding']}, {heads}"
    if not m["kv_layers"]:
        return f"{m['layers']} recurrent layer{'s' if m['layers'] > 1 else ''}, embedding {m['embedding']}"
    return (
        f"{m['layers']} layers ({m['recurrent_layers']} recurrent, {m['kv_layers']} with attention), "
        f"embedding {m['embedding']}, {heads}"
    )


def _caches(m: dict) -> str:
    """What the model's caches take: its KV cache, and the copies of a recurrent state llama.cpp and fsd-local keep."""
    kv = f"KV cache {_size(m['kv_bytes'])}" if m["kv_layers"] else "no KV cache"
    if (st := m["state"]) is None:
        return f"  at --ctx {m['n_ctx']}: {kv}"
    rows = [f"{st['sequences']} sequence{'s' if st['sequences'] > 1 else ''}"]
    spare = "a spare for its checkpoint" if st["spare"] == 1 else "a spare each for their checkpoints"
    rows += [spare] if st["spare"] else []
    rows += [f"{st['snapshots']} snapshots each"] if st["snapshots"] else []
    return (
        f"  at --ctx {m['n_ctx']}: {kv}; recurrent state {_size(st['sequence_bytes'])} a sequence, "
        f"{_size(st['device_bytes'])} in all ({', '.join(rows)}), and up to {SAVED_MAX} host copies for a next turn "
        f"({_size(st['host_bytes'])})"
    )


def compatibility(draft: str, target: str) -> Pairing:
    """The path the pair takes (vocab.pairing): the same tokenizer, the vocabulary map, the text path, or refused."""
    d = t = None
    try:
        d = Model(ModelOptions(draft, vocab_only=True), "draft")
        t = Model(ModelOptions(target, vocab_only=True), "target")
        return pairing(d, t)
    finally:
        for m in (d, t):
            if m is not None:
                m.close()


def report(
    target: str | None = None, draft: str | None = None, n_ctx: int = 4096, rewind: tuple[dict, dict] = ({}, {})
) -> dict:
    """`rewind`: how the engine asks the target and the draft to rewind a recurrent state (round.rewind_options):
    the caches and the placement count the state copies it makes."""
    info = backend.detect()
    features = cpu_features.backend_cpu_features()
    host_amx = cpu_features.host_has_amx()
    choice = cpu_features.decide_repack(features, host_amx)
    out: dict[str, Any] = {
        "fsd_local": __version__,
        "backend": info.to_dict(),
        "models": {},
        "cpu": {
            "backend_features": sorted(k for k, v in features.items() if v not in ("", "0")),
            "host_amx": host_amx,
            "repack": choice.repack,
            "repack_reason": choice.reason,
        },
    }
    opts = {
        role: ModelOptions(path, n_ctx=n_ctx, **how)
        for role, path, how in (("target", target, rewind[0]), ("draft", draft, rewind[1]))
        if path
    }
    for role, o in opts.items():
        out["models"][role] = model_summary(o.path, role, o)
    if target and draft:
        p = compatibility(draft, target)
        # compatible: the engine runs the pair, with one tokenizer or through the vocabulary map
        out["compatible"], out["compatibility_problem"] = p.path != "refused", p.reason
        sizes = [out["models"][r]["size_bytes"] for r in ("draft", "target")]
        if p.path in ("map", "text") and sizes[0] > sizes[1]:  # the engine refuses a draft with more parameters
            out["compatible"] = False
            out["compatibility_problem"] = f"{p.reason}; the draft's file is larger than the target's"
        out["pairing"] = p.to_dict() | {"description": p.describe()}
    if target:
        t, d, summary = placement.resolve(
            opts["target"],
            opts.get("draft"),
            target_auto=True,
            draft_auto=True,
        )
        out["placement"] = {
            "n_ctx": n_ctx,
            "target_ngl": t.n_gpu_layers,
            "draft_ngl": d.n_gpu_layers if d else None,
            "summary": summary,
        }
    return out


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def render(r: dict) -> str:
    b = r["backend"]
    gpus = [d for d in b["devices"] if d["kind"] in backend.OFFLOAD_KINDS]
    lines = [
        f"fsd-local {r['fsd_local']}: llama-cpp-python {b['llama_cpp_python']}, llama.cpp {b['llama_cpp']}, "
        f"ggml {b['ggml']}",
        "backends:    "
        + ", ".join(b["backends"])
        + "   ("
        + ", ".join(f"{name}: {_yes(name in b['backends'])}" for name in WELL_KNOWN)
        + ")",
    ]
    for d in b["devices"]:
        lines.append(
            f"device:      {d['name']} [{d['backend']}, {d['kind']}] {d['description']}: "
            f"{_size(d['free'])} free of {_size(d['total'])}"
        )
    offload = _yes(b["gpu_offload"])
    if not gpus:
        offload += (
            " (no GPU device; this build is CPU-only: rebuild with native/build.sh cuda|metal|vulkan)"
            if set(b["backends"]) <= {"CPU", "BLAS", "RPC"}
            else " (GPU backend compiled in, no device found)"
        )
    lines.append(f"GPU offload: {offload}")
    lines.append(
        "RPC:         "
        + (
            "yes (--rpc HOST:PORT spreads the target over ggml-rpc-server machines)"
            if b["rpc"]
            else "no: this build lacks the RPC backend (rebuild with native/build.sh PROFILE --rpc)"
        )
    )
    lines.append(f"threads:     {b['threads']} by default; mmap {_yes(b['mmap'])}, mlock {_yes(b['mlock'])}")
    lines.append(f"system info: {b['system_info']}")
    if "cpu" in r:
        c = r["cpu"]
        amx = {True: "yes", False: "no", None: "unknown (the OS does not report CPU flags)"}[c["host_amx"]]
        lines.append(f"CPU backend: {' '.join(c['backend_features']) or 'no feature list'}; this CPU has AMX: {amx}")
        lines.append(f"repack:      {'on' if c['repack'] else 'off'} by default: {c['repack_reason']}")
    lines += [f"note:        {n}" for n in b["notes"]]
    for role, m in r["models"].items():
        types = ", ".join(f"{k} x{v}" for k, v in sorted(m["tensor_types"].items(), key=lambda kv: -kv[1]))
        lines += [
            f"{role}: {m['path']}",
            f"  {m['architecture']} ({m['name'] or 'unnamed'}), {_shape(m)}, trained context {m['context_train']}",
            f"  {_size(m['size_bytes'])}, quantisation {m['quantisation']} (tensors: {types})",
            f"  vocabulary {m['vocab_size']} tokens, {m['tokenizer']}; chat template {_yes(m['chat_template'])}",
            _caches(m),
        ]
    if "compatible" in r:
        path, problem = r["pairing"]["path"], r["compatibility_problem"]
        verdict = "compatible across tokenizers" if path in ("map", "text") and r["compatible"] else "INCOMPATIBLE"
        lines.append(
            "draft -> target: " + ("compatible (same tokenizer)" if path == "same" else f"{verdict}: {problem}")
        )
        if path != "same":
            lines.append(f"  across tokenizers: {r['pairing']['description']}")
    if "placement" in r:
        lines.append(f"auto placement at --ctx {r['placement']['n_ctx']}: {r['placement']['summary']}")
    if "kernel_cache" in r:
        lines.append(kernel_cache_line(r["kernel_cache"]))
    return "\n".join(lines)


def kernel_cache_line(k: dict) -> str:
    """The kernel cache's place and state (kernels/jit_cache.py `state`), and how to clear it."""
    held = f"{k['kernels']} kernels, {_size(k['bytes'])}" if k["kernels"] else "empty (the first run compiles, ~20 s)"
    extra = [f"{k['other_cpu']} for another CPU"] if k["other_cpu"] else []
    extra += [f"{k['defective']} unusable (recompiled when reached)"] if k["defective"] else []
    if k["stale_folders"]:
        n = k["stale_folders"]
        extra.append(f"{n} folder{'s' if n > 1 else ''} of other versions, {_size(k['stale_bytes'])}")
    return (
        f"kernel cache: {k['path']}: {held}" + "".join(f"; {e}" for e in extra) + "\n"
        "  clear it with `fsd-local doctor --clear-kernel-cache` (safe while fsd-local runs: at worst a recompile)"
    )
