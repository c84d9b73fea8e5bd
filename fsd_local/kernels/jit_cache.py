"""Where numba keeps compiled kernels: a directory named by numba's version and a hash of every kernel source, so any
change recompiles them all once (a cached kernel embeds the jitted code it calls from other files). Import this
before any module that defines a kernel (fastmath.py does)."""

import hashlib
import os
from pathlib import Path

import numba

from fsd_local.paths import cache_dir

PACKAGE = Path(__file__).parent.parent


def kernel_sources() -> list[Path]:
    """Every file that defines a cached kernel: this whole folder, and the benchmark's own NumPy-side kernel."""
    return sorted(Path(__file__).parent.glob("*.py")) + [PACKAGE / "bench" / "kernels.py"]


def kernel_cache_dir() -> Path:
    digest = hashlib.sha256()
    for path in kernel_sources():
        digest.update(path.relative_to(PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    base = os.environ.get("NUMBA_CACHE_DIR") or cache_dir() / "numba"
    return Path(base) / f"{numba.__version__}-{digest.hexdigest()[:16]}"


numba.config.CACHE_DIR = str(kernel_cache_dir())  # type: ignore[attr-defined]  # numba sets it at run time


def is_warm() -> bool:
    """True when compiled kernels for these sources are on disk (the first load otherwise compiles, ~20 s)."""
    return any(Path(numba.config.CACHE_DIR).rglob("*.nbi"))  # type: ignore[attr-defined]
