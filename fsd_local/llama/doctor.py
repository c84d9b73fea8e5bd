"""`fsd-local doctor`: what this installation runs on and what given GGUF files are, as a dict and as text.
Models are read from their headers and, for the draft/target check, loaded vocabulary-only (no weights)."""

from __future__ import annotations

from typing import Any

from fsd_local import __version__
from fsd_local.llama import backend, cpu_features, gguf_info, placement
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.llama.vocab import Pairing, pairing

GiB = 1 << 30
MiB = 1 << 20
WELL_KNOWN = ("CUDA", "Metal", "Vulkan", "HIP (ROCm)", "SYCL")


def model_summary(path: str, role: str) -> dict:
    info = gguf_info.read(path, role)
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
        "vocab_size": info.vocab_size,
        "tokenizer": info.tokenizer,
        "chat_template": info.has_chat_template,
    }


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


def report(target: str | None = None, draft: str | None = None, n_ctx: int = 4096) -> dict:
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
    for role, path in (("target", target), ("draft", draft)):
        if path:
            out["models"][role] = model_summary(path, role)
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
            ModelOptions(target, n_ctx=n_ctx),
            ModelOptions(draft, n_ctx=n_ctx) if draft else None,
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
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


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
            f"  {m['architecture']} ({m['name'] or 'unnamed'}), {m['layers']} layers, "
            f"embedding {m['embedding']}, {m['heads']} heads ({m['kv_heads']} KV), "
            f"trained context {m['context_train']}",
            f"  {_size(m['size_bytes'])}, quantisation {m['quantisation']} (tensors: {types})",
            f"  vocabulary {m['vocab_size']} tokens, {m['tokenizer']}; chat template {_yes(m['chat_template'])}",
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
