"""The kernel cache: `jit` is numba's njit with every compiled form kept on disk, one self-checking file each, in a
folder named by numba's and llvmlite's versions and a hash of every kernel source (docs/design.md, "The kernel
cache"). Every kernel is declared with `jit`, never with numba's own cache=True."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import shutil
import struct
import sys
import uuid
from functools import cache
from pathlib import Path

import llvmlite
import numba
from numba.core.caching import CompileResultCacheImpl, FunctionCache, _CacheLocator
from numba.core.serialize import dumps

from fsd_local.paths import cache_dir

PACKAGE = Path(__file__).parent.parent
FORMAT = 1  # the layout of an entry file below; a change makes a new folder
MAGIC = b"FSDK"
SUFFIX = ".nbc"
KERNELS: list = []  # every dispatcher `jit` made, in the order their modules defined them
_said: set[str] = set()


def kernel_sources() -> list[Path]:
    """Every file that defines a cached kernel: this whole folder, and the benchmark's own NumPy-side kernel."""
    return sorted(Path(__file__).parent.glob("*.py")) + [PACKAGE / "bench" / "kernels.py"]


@cache
def sources_digest() -> str:
    """A hash of the kernel sources and of what compiles them (numba, llvmlite, Python, this file's format)."""
    digest = hashlib.sha256(f"{FORMAT} {numba.__version__} {llvmlite.__version__} {sys.version}".encode())
    for path in kernel_sources():
        digest.update(path.relative_to(PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """The folder that holds the kernel caches of every installed version: $NUMBA_CACHE_DIR, else fsd-local's."""
    return Path(os.environ.get("NUMBA_CACHE_DIR") or cache_dir() / "numba")


def kernel_cache_dir() -> Path:
    return cache_root() / f"{numba.__version__}-{sources_digest()}"


def say_once(line: str) -> None:
    """One line on stderr, once per process whatever the number of times it is asked for."""
    if line not in _said:
        _said.add(line)
        print(f"fsd-local: {line}", file=sys.stderr, flush=True)


def start_parallel_backend() -> None:
    """Start numba's threading layer. A cached kernel that calls a parallel one needs it running before it loads,
    and numba records that only when the parallel callee was compiled, not loaded, in the writing process."""
    numba.get_num_threads()  # starts the layer on its first call (numba.np.ufunc.parallel._launch_threads)


class _Locator(_CacheLocator):
    """Kernels of one source folder (kernels/, bench/) in a subfolder of kernel_cache_dir()."""

    def __init__(self, py_func, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno

    def ensure_cache_path(self) -> None:
        pass  # made by the first save; a folder that cannot be written is said once there

    def get_cache_path(self) -> str:
        return str(kernel_cache_dir() / Path(self._py_file).parent.name)

    def get_source_stamp(self):
        return sources_digest()

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        return cls(py_func, py_file)


class _Impl(CompileResultCacheImpl):
    _locator_classes = [_Locator]


def compiled_by() -> dict:
    """What compiles a kernel here: an entry written by anything else is not loaded."""
    return {
        "format": FORMAT,
        "numba": numba.__version__,
        "llvmlite": llvmlite.__version__,
        "python": sys.version.split()[0],
        "sources": sources_digest(),
    }


def entry_header(key) -> dict:
    """What an entry records of how and for what (its key: signature, CPU, bytecode) it was compiled."""
    return {**compiled_by(), "cpu": repr(key[1]), "key": repr(key)}


def read_entry(path: Path) -> tuple[dict | None, bytes, str | None]:
    """(header, payload, problem): problem names what makes the file unusable whatever it is loaded for, else None."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        return None, b"", f"cannot be read ({e.strerror or e})"
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 4:
        return None, b"", "is not an fsd-local kernel entry"
    (n,) = struct.unpack_from("<I", raw, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = pickle.loads(raw[start : start + n])
        assert isinstance(header, dict)
    except Exception:
        return None, b"", "is damaged (its header does not read)"
    digest, payload = raw[start + n : start + n + 32], raw[start + n + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        return header, b"", "is damaged (checksum mismatch: truncated or overwritten)"
    ours = compiled_by()
    for field, what in (("format", "entry format"), ("numba", "numba"), ("llvmlite", "llvmlite"), ("python", "Python")):
        if header.get(field) != ours[field]:
            return header, b"", f"was written by {what} {header.get(field)} (this is {ours[field]})"
    if header.get("sources") != ours["sources"]:
        return header, b"", "was compiled from other kernel sources"
    return header, payload, None


class _Entries:
    """One function's compiled forms, one file each named by a hash of its key (signature, CPU, bytecode): two
    processes that compile at once write whole files under distinct names, and no shared index can go stale."""

    def __init__(self, folder: str, base: str) -> None:
        self.folder, self.base = Path(folder), base

    def path(self, key) -> Path:
        return self.folder / f"{self.base}.{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}{SUFFIX}"

    def defect(self, path: Path, problem: str) -> None:
        say_once(f"kernel cache entry {path.name} {problem}; compiling it again")

    def load(self, key):
        path = self.path(key)
        if not path.exists():
            return None
        header, payload, problem = read_entry(path)
        if problem is None and header is not None and header.get("key") != repr(key):
            problem = (
                f"was compiled for another CPU ({header.get('cpu')})"
                if header.get("cpu") != repr(key[1])
                else "holds another signature"
            )
        if problem is not None:
            self.defect(path, problem)
            return None
        try:
            return pickle.loads(payload)
        except Exception as e:
            self.defect(path, f"does not unpickle ({type(e).__name__})")
            return None

    def save(self, key, data) -> None:
        payload = dumps(data)
        header = pickle.dumps(entry_header(key), protocol=pickle.HIGHEST_PROTOCOL)
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.tmp.{uuid.uuid4().hex[:12]}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)  # readers see the old file or the whole new one
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            say_once(
                f"cannot write the kernel cache in {self.folder} ({e.strerror or e}); kernels compile anew each run"
            )

    def flush(self) -> None:
        for p in self.folder.glob(f"{self.base}.*{SUFFIX}"):
            p.unlink(missing_ok=True)


class KernelCache(FunctionCache):
    """numba's per-function cache over _Entries: a defect found on load is one line on stderr and a recompile, and
    loading starts the parallel backend first."""

    _impl_class = _Impl

    def __init__(self, py_func) -> None:
        super().__init__(py_func)
        self._cache_file = _Entries(self._cache_path, self._impl.filename_base)

    def _load_overload(self, sig, target_context):
        if not self._enabled:
            return None
        key = self._index_key(sig, target_context.codegen())
        data = self._cache_file.load(key)
        if data is None:
            return None
        start_parallel_backend()
        try:
            return self._impl.rebuild(target_context, data)
        except Exception as e:
            self._cache_file.defect(self._cache_file.path(key), f"does not load ({type(e).__name__}: {e})")
            return None

    def _save_overload(self, sig, data) -> None:
        if self._enabled and self._impl.check_cachable(data):
            self._cache_file.save(self._index_key(sig, data.codegen), self._impl.reduce(data))


def jit(fn=None, **options):
    """numba.njit(**options) whose compiled forms live in the kernel cache; `@jit` or `@jit(parallel=True, ...)`."""

    def wrap(f):
        dispatcher = numba.njit(**options)(f)
        dispatcher._cache = KernelCache(f)
        KERNELS.append(dispatcher)
        return dispatcher

    return wrap if fn is None else wrap(fn)


def entries() -> list[Path]:
    return sorted(kernel_cache_dir().rglob(f"*{SUFFIX}"))


def is_warm() -> bool:
    """True when compiled kernels for these sources are on disk (the first load otherwise compiles, ~20 s)."""
    return bool(entries())


_VERSION_FOLDER = re.compile(r"^\d+\.\d+[\w.+]*-[0-9a-f]{16}$")


def _folders() -> list[Path]:
    """The kernel-cache folders under cache_root(), of this version and others (numba-version-hash, nothing else)."""
    root = cache_root()
    return sorted(p for p in root.iterdir() if p.is_dir() and _VERSION_FOLDER.match(p.name)) if root.is_dir() else []


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def state() -> dict:
    """The cache's place and what it holds: kernels usable here, entries for another CPU, damaged or foreign ones,
    and the folders older versions left."""
    here = kernel_cache_dir()
    usable = other_cpu = defective = 0
    for path in entries():
        header, _, problem = read_entry(path)
        if problem is not None or header is None:
            defective += 1
        elif header.get("cpu") == _host_cpu():
            usable += 1
        else:
            other_cpu += 1
    others = [p for p in _folders() if p != here]
    return {
        "path": str(here),
        "kernels": usable,
        "other_cpu": other_cpu,
        "defective": defective,
        "bytes": _size(here) if here.is_dir() else 0,
        "stale_folders": len(others),
        "stale_bytes": sum(_size(p) for p in others),
    }


@cache
def _host_cpu() -> str:
    from numba.core.registry import cpu_target

    return repr(cpu_target.target_context.codegen().magic_tuple())


def clear() -> int:
    """Delete every kernel-cache folder (this version's and older ones) under cache_root(); the bytes freed."""
    freed = 0
    for folder in _folders():
        freed += _size(folder)
        shutil.rmtree(folder, ignore_errors=True)
    return freed
