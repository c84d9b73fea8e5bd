"""What the installed llama.cpp build can run on: versions, compiled-in backends, devices and their memory, RPC, asked
of the loaded library through ggml's device registry (ggml.py); when that fails, the backend names are read from
llama_print_system_info()."""

from __future__ import annotations

import ctypes
import socket
from dataclasses import asdict, dataclass, field

from fsd_local.errors import ModelLoadError
from fsd_local.llama import ggml as g
from fsd_local.llama.bindings import default_threads, init_backend

# ggml registry name -> the name users know the backend by
BACKEND_NAMES = {
    "CPU": "CPU",
    "CUDA": "CUDA",
    "MTL": "Metal",
    "Vulkan": "Vulkan",
    "ROCm": "HIP (ROCm)",
    "MUSA": "MUSA",
    "SYCL": "SYCL",
    "RPC": "RPC",
    "BLAS": "BLAS",
    "OpenCL": "OpenCL",
}
OFFLOAD_KINDS = ("gpu", "igpu")  # devices llama.cpp puts layers on (RPC devices report "gpu" too)


@dataclass
class Device:
    name: str  # e.g. CUDA0, Vulkan1, MTL0, RPC0, CPU
    description: str  # e.g. "NVIDIA GeForce RTX 4090", or the endpoint for RPC devices
    kind: str  # cpu | gpu | igpu | accel | meta
    backend: str  # the registry it belongs to, as users name it (CUDA, Metal, RPC ...)
    free: int  # bytes
    total: int

    @property
    def is_rpc(self) -> bool:
        return self.backend == "RPC"


@dataclass
class BackendInfo:
    llama_cpp_python: str
    llama_cpp: str  # llama.cpp's version string (llama_version)
    ggml: str  # ggml version and commit
    backends: list[str]  # compiled-in backends, as users name them
    devices: list[Device]
    gpu_offload: bool
    rpc: bool
    mmap: bool
    mlock: bool
    threads: int  # what fsd-local uses by default
    system_info: str
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> list[Device]:
        """Local devices that can hold layers (RPC servers excluded: only a model that names them uses them)."""
        return [d for d in self.devices if d.kind in OFFLOAD_KINDS and not d.is_rpc]

    def to_dict(self) -> dict:
        return asdict(self)


def _user_name(reg_name: str) -> str:
    # RPC registries are named "RPC[host:port]" once servers are added
    return "RPC" if reg_name.startswith("RPC") else BACKEND_NAMES.get(reg_name, reg_name)


def _ensure_registry(lib) -> None:
    init_backend()  # also loads the backend modules of a GGML_BACKEND_DL build (ggml_api.load_backend_modules)


def list_devices() -> list[Device]:
    lib = g.lib()
    _ensure_registry(lib)
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(
            Device(
                name=g.text(lib.ggml_backend_dev_name(dev)),
                description=g.text(lib.ggml_backend_dev_description(dev)),
                kind=g.DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "unknown"),
                backend=_user_name(g.text(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)))),
                free=free.value,
                total=total.value,
            )
        )
    return out


def _registered_backends() -> list[str]:
    lib = g.lib()
    _ensure_registry(lib)
    names = [
        _user_name(g.text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))))
        for i in range(lib.ggml_backend_reg_count())
    ]
    return list(dict.fromkeys(names))


def backends_from_system_info(info: str) -> list[str]:
    """'CPU : SSE3 = 1 | ... | CUDA : ARCHS = 890 | ...' -> ['CPU', 'CUDA']: each backend prints 'NAME : '."""
    names = []
    for part in info.split("|"):
        if " : " in part:
            names.append(_user_name(part.split(" : ")[0].strip()))
    return list(dict.fromkeys(names))


def detect() -> BackendInfo:
    import llama_cpp as lc

    init_backend()
    system_info = g.text(lc.llama_print_system_info()).strip()
    notes = []
    try:
        lib = g.lib()
        backends, devices = _registered_backends(), list_devices()
        ggml_version = f"{g.text(lib.ggml_version())} ({g.text(lib.ggml_commit())})"
    except (ModelLoadError, AttributeError) as exc:  # a build without these exports: names only, no memory
        backends, devices, ggml_version = backends_from_system_info(system_info), [], "unknown"
        notes.append(f"device list unavailable ({exc}); backends read from llama_print_system_info")
    return BackendInfo(
        llama_cpp_python=lc.__version__,
        llama_cpp=g.text(lc.llama_version()),
        ggml=ggml_version,
        backends=backends,
        devices=devices,
        gpu_offload=bool(lc.llama_supports_gpu_offload()),
        rpc=bool(lc.llama_supports_rpc()),
        mmap=bool(lc.llama_supports_mmap()),
        mlock=bool(lc.llama_supports_mlock()),
        threads=default_threads(),
        system_info=system_info,
        notes=notes,
    )


# ------------------------------------------------------------------ RPC
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)  # ggml_backend_rpc_add_server(endpoint)
_added: set[str] = set()  # endpoints registered in this process
RPC_CONNECT_TIMEOUT = 5.0  # seconds


def parse_rpc_servers(servers: str) -> list[str]:
    endpoints = [s.strip() for s in servers.split(",") if s.strip()]
    for ep in endpoints:
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ModelLoadError(f"RPC server {ep!r} is not HOST:PORT (e.g. 192.168.1.20:50052)")
    if not endpoints:
        raise ModelLoadError("no RPC servers given: pass HOST:PORT[,HOST:PORT...]")
    return endpoints


def add_rpc_servers(servers: str) -> list[str]:
    """Register each `rpc-server` endpoint as llama.cpp devices, as llama.cpp's own --rpc does. Registration is
    process-wide; Model hides RPC devices from models that did not ask for them. Returns the endpoints."""
    import llama_cpp as lc

    endpoints = parse_rpc_servers(servers)
    init_backend()
    if not lc.llama_supports_rpc():
        raise ModelLoadError(
            "this llama-cpp-python build has no RPC backend; rebuild it with "
            "`native/build.sh PROFILE --rpc` (see docs/backends.md, 'Spreading the target over several machines')"
        )
    lib = g.lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    addr = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not addr:
        raise ModelLoadError("this build's RPC backend has no ggml_backend_rpc_add_server; rebuild llama-cpp-python")
    add_server = _ADD_SERVER(addr)
    for ep in endpoints:
        if ep in _added:
            continue
        hint = (
            "start `ggml-rpc-server -H 0.0.0.0 -p PORT` there (built from the same llama.cpp version: "
            "native/build.sh --rpc-server)"
        )
        host, _, port = ep.rpartition(":")
        try:  # ggml-rpc aborts the whole process when it cannot connect, so try first
            socket.create_connection((host.strip("[]"), int(port)), timeout=RPC_CONNECT_TIMEOUT).close()
        except OSError as exc:
            raise ModelLoadError(f"RPC server {ep} did not answer ({exc.strerror or exc}); {hint}") from None
        server_reg = add_server(ep.encode())
        if not server_reg:
            raise ModelLoadError(f"RPC server {ep} has no devices; {hint}")
        lib.ggml_backend_register(server_reg)
        _added.add(ep)
    return endpoints


def rpc_registered() -> bool:
    return bool(_added)


def rpc_devices(endpoints: list[str]) -> list[int]:
    """Handles of the devices of these registered RPC endpoints (an RPC device's description is its endpoint).
    Models pass them to llama.cpp explicitly: the registry ggml_api binds is not necessarily the one libllama
    reads (wheels ship libggml.so and libggml.so.0 as two copies, each with its own registry)."""
    lib = g.lib()
    wanted, out = set(endpoints), []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = g.text(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)))
        if reg.startswith("RPC") and g.text(lib.ggml_backend_dev_description(dev)) in wanted:
            out.append(dev)
    return out


def local_offload_devices() -> list[int]:
    """Handles of the local devices llama.cpp would offload to, RPC excluded: discrete GPUs, or integrated
    ones when there is no discrete GPU (llama.cpp's own default rule)."""
    lib = g.lib()
    gpus: list[int] = []
    igpus: list[int] = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = g.text(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)))
        kind = g.DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev))
        if reg.startswith("RPC"):
            continue
        (gpus if kind == "gpu" else igpus if kind == "igpu" else []).append(dev)
    return gpus or igpus
