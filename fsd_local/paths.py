"""Where fsd-local keeps what it builds and measures: the demo models, the compiled kernels, the measured costs
(costs.json) and the index of local models' headers (FSD_LOCAL_CACHE, else $XDG_CACHE_HOME/fsd-local, else
~/.cache/fsd-local). Downloaded models live in the Hugging Face cache instead."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("FSD_LOCAL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "fsd-local"
    )
    return Path(base)
