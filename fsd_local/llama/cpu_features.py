"""What the loaded CPU backend was compiled for, what the host CPU reports, and whether weights may be repacked: off
by default when the backend has AMX kernels and the host has AMX or may have it (llama.cpp's AMX path crashes on
some hosts: docs/design.md, "llama.cpp underneath"), on everywhere else."""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass

from fsd_local.llama import ggml as g
from fsd_local.llama.bindings import init_backend


class _Feature(ctypes.Structure):  # struct ggml_backend_feature { const char * name; const char * value; }
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


_GET_FEATURES = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)
AMX_FEATURES = ("AMX_INT8", "AMX_BF16", "AMX_TILE")


@functools.lru_cache(maxsize=1)
def backend_cpu_features() -> dict[str, str]:
    """The CPU backend's own feature list (ggml_backend_get_features of the "CPU" registry): what this build
    (or, with GGML_BACKEND_DL, the variant ggml chose for this CPU) was compiled to use. {} when unavailable."""
    try:
        lib = g.lib()
    except Exception:  # a build without the registry exports: nothing to ask
        return {}
    init_backend()
    reg = lib.ggml_backend_reg_by_name(b"CPU")
    if not reg:
        return {}
    addr = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if not addr:
        return {}
    feats = _GET_FEATURES(addr)(reg)
    out: dict[str, str] = {}
    i = 0
    while feats and feats[i].name:
        out[feats[i].name.decode()] = (feats[i].value or b"").decode()
        i += 1
    return out


def host_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU flags the kernel reports (Linux), or None where there is no /proc/cpuinfo to read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def host_has_amx(flags: set[str] | None = None) -> bool | None:
    """True/False from the host's flags; None when the OS does not say (macOS has no AMX; Windows: unknown)."""
    flags = host_cpu_flags() if flags is None else flags
    if flags is None:
        return False if sys.platform == "darwin" else None
    return "amx_tile" in flags


@dataclass(frozen=True)
class RepackChoice:
    repack: bool  # llama_model_params.use_extra_bufts
    reason: str  # one line for doctor and the load message

    def __str__(self) -> str:
        return f"{'on' if self.repack else 'off'} ({self.reason})"


def decide_repack(features: dict[str, str], host_amx: bool | None, requested: bool | None = None) -> RepackChoice:
    """The rule, pure so it can be tested for every kind of host: an explicit request wins; otherwise repack
    unless the backend has AMX kernels and the host has (or may have) AMX."""
    if requested is not None:
        return RepackChoice(requested, "--repack given" if requested else "--no-repack given")
    backend_amx = [f for f in AMX_FEATURES if features.get(f, "0") not in ("", "0")]
    if not backend_amx:
        return RepackChoice(True, "the CPU backend has no AMX kernels")
    if host_amx is False:
        return RepackChoice(True, f"the CPU backend has {'/'.join(backend_amx)} kernels but this CPU lacks AMX")
    seen = "this CPU reports AMX" if host_amx else "this OS does not say whether the CPU has AMX"
    return RepackChoice(
        False,
        f"the CPU backend has {'/'.join(backend_amx)} kernels and {seen}: llama.cpp's "
        "AMX path crashes on such hosts (llama.cpp PR #26954), so weights keep their "
        "file layout; --repack turns it back on",
    )


def repack_choice(requested: bool | None = None) -> RepackChoice:
    """The choice for this process's backend and host."""
    return decide_repack(backend_cpu_features(), host_has_amx(), requested)
