"""The few ggml C functions llama-cpp-python does not bind, the backend device registry and the GGUF reader, bound
from the libggml / libggml-base that ship next to libllama in the llama_cpp package and are loaded with it."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsd_local.errors import ModelLoadError

c_void_p, c_char_p, c_size_t, c_int, c_int64, c_bool = (
    ctypes.c_void_p,
    ctypes.c_char_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int64,
    ctypes.c_bool,
)

# enum ggml_backend_dev_type (ggml-backend.h)
DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
# enum gguf_type (gguf.h)
(
    GGUF_UINT8,
    GGUF_INT8,
    GGUF_UINT16,
    GGUF_INT16,
    GGUF_UINT32,
    GGUF_INT32,
    GGUF_FLOAT32,
    GGUF_BOOL,
    GGUF_STRING,
    GGUF_ARRAY,
    GGUF_UINT64,
    GGUF_INT64,
    GGUF_FLOAT64,
) = range(13)


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", c_bool), ("ctx", c_void_p)]


# name: (library, return type, argument types)
_PROTOTYPES = {
    # registry (libggml)
    "ggml_backend_reg_count": ("ggml", c_size_t, []),
    "ggml_backend_reg_get": ("ggml", c_void_p, [c_size_t]),
    "ggml_backend_reg_by_name": ("ggml", c_void_p, [c_char_p]),
    "ggml_backend_register": ("ggml", None, [c_void_p]),
    "ggml_backend_load_all": ("ggml", None, []),
    "ggml_backend_load_all_from_path": ("ggml", None, [c_char_p]),
    "ggml_backend_dev_count": ("ggml", c_size_t, []),
    "ggml_backend_dev_get": ("ggml", c_void_p, [c_size_t]),
    # devices and registries (libggml-base)
    "ggml_backend_reg_name": ("ggml-base", c_char_p, [c_void_p]),
    "ggml_backend_reg_get_proc_address": ("ggml-base", c_void_p, [c_void_p, c_char_p]),
    "ggml_backend_dev_name": ("ggml-base", c_char_p, [c_void_p]),
    "ggml_backend_dev_description": ("ggml-base", c_char_p, [c_void_p]),
    "ggml_backend_dev_memory": ("ggml-base", None, [c_void_p, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)]),
    "ggml_backend_dev_type": ("ggml-base", c_int, [c_void_p]),
    "ggml_backend_dev_backend_reg": ("ggml-base", c_void_p, [c_void_p]),
    # versions and tensor types (libggml-base)
    "ggml_version": ("ggml-base", c_char_p, []),
    "ggml_commit": ("ggml-base", c_char_p, []),
    "ggml_type_name": ("ggml-base", c_char_p, [c_int]),
    "ggml_row_size": ("ggml-base", c_size_t, [c_int, c_int64]),
    "ggml_type_size": ("ggml-base", c_size_t, [c_int]),
    "ggml_blck_size": ("ggml-base", c_int64, [c_int]),
    # GGUF reader (libggml-base)
    "gguf_init_from_file": ("ggml-base", c_void_p, [c_char_p, _GGUFInitParams]),
    "gguf_free": ("ggml-base", None, [c_void_p]),
    "gguf_find_key": ("ggml-base", c_int64, [c_void_p, c_char_p]),
    "gguf_get_n_kv": ("ggml-base", c_int64, [c_void_p]),
    "gguf_get_key": ("ggml-base", c_char_p, [c_void_p, c_int64]),
    "gguf_get_kv_type": ("ggml-base", c_int, [c_void_p, c_int64]),
    "gguf_get_arr_type": ("ggml-base", c_int, [c_void_p, c_int64]),
    "gguf_get_arr_n": ("ggml-base", c_size_t, [c_void_p, c_int64]),
    "gguf_get_arr_data": ("ggml-base", c_void_p, [c_void_p, c_int64]),
    "gguf_get_val_data": ("ggml-base", c_void_p, [c_void_p, c_int64]),
    "gguf_get_val_str": ("ggml-base", c_char_p, [c_void_p, c_int64]),
    "gguf_get_arr_str": ("ggml-base", c_char_p, [c_void_p, c_int64, c_size_t]),
    "gguf_get_data_offset": ("ggml-base", c_size_t, [c_void_p]),
    "gguf_get_tensor_offset": ("ggml-base", c_size_t, [c_void_p, c_int64]),
    "gguf_get_n_tensors": ("ggml-base", c_int64, [c_void_p]),
    "gguf_get_tensor_name": ("ggml-base", c_char_p, [c_void_p, c_int64]),
    "gguf_get_tensor_type": ("ggml-base", c_int, [c_void_p, c_int64]),
    "gguf_get_tensor_size": ("ggml-base", c_size_t, [c_void_p, c_int64]),
}


class GGML:
    """Attribute access to the bound functions: `lib().ggml_backend_dev_count()`."""

    if TYPE_CHECKING:  # the functions of _PROTOTYPES are set as attributes in __init__

        def __getattr__(self, name: str) -> Callable[..., Any]: ...

    def __init__(self):
        import llama_cpp.llama_cpp as bindings
        from llama_cpp._ctypes_extensions import load_shared_library

        libs = {}
        for name in ("ggml-base", "ggml"):
            # Open the very file libllama links against (its SONAME, libggml.so.0 on Linux): wheels ship
            # libggml.so and libggml.so.0 as two copies, and a second copy means a second device registry
            # that libllama never reads.
            soname = Path(bindings._base_path) / f"lib{name}.so.0"
            try:
                libs[name] = (
                    ctypes.CDLL(str(soname), mode=ctypes.RTLD_GLOBAL)
                    if soname.exists()
                    else load_shared_library(name, bindings._base_path)
                )
            except (OSError, RuntimeError) as exc:
                raise ModelLoadError(
                    f"cannot open {name} next to llama-cpp-python's libllama "
                    f"({bindings._base_path}): {exc}; reinstall llama-cpp-python"
                ) from None
        for fname, (lib, restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(libs[lib], fname)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, fname, fn)


@functools.lru_cache(maxsize=1)
def lib() -> GGML:
    return GGML()


def library_dir() -> str:
    """The folder of llama-cpp-python's libllama (and of any backend modules a GGML_BACKEND_DL build put there)."""
    import llama_cpp.llama_cpp as bindings

    return str(bindings._base_path)


def load_backend_modules() -> int:
    """Builds with GGML_BACKEND_DL (native/profiles/cpu-portable.env) compile each backend as a module that
    nothing loads by itself: ggml's own search looks next to the Python executable, not next to libllama. Load
    them from libllama's folder (ggml picks the best CPU variant for this CPU). Returns the registry count."""
    g = lib()
    if not g.ggml_backend_reg_count():
        g.ggml_backend_load_all_from_path(library_dir().encode())
    return g.ggml_backend_reg_count()


def text(value: bytes | None) -> str:
    return value.decode("utf-8", "replace") if value else ""
