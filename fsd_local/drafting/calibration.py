"""The measured costs of a pair on this machine kept on disk (`CostStore`), and `measure_costs`, which times them
on purpose (docs/design.md, "The cold start, and costs kept on disk")."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from time import perf_counter, time
from typing import TYPE_CHECKING

from fsd_local.paths import cache_dir

if TYPE_CHECKING:
    from fsd_local.drafting.length import DraftLength
    from fsd_local.llama.model import Model

STORED_WEIGHT = 2.0  # how many decodes a stored size counts for: a shape to start from, not a measurement today
SAVE_EVERY = 30.0  # seconds: a reply that measured nothing new is written back at most this often
CATCH_UP_BATCH = 8  # the catch-up batch measure_costs times on the draft model
MEASURE_PASSES = 2  # each size timed this often (the fastest kept: other jobs only ever slow a decode down)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _model_key(m: Model) -> list:
    o = m.opts
    st = os.stat(m.path)
    return [
        os.path.realpath(m.path),
        st.st_size,
        int(st.st_mtime),
        o.n_threads,
        o.n_threads_batch,
        o.n_gpu_layers,
        o.n_batch,
        o.flash_attn,
        o.cache_type_k,
        o.cache_type_v,
        o.split_mode,
        o.rpc_servers,
        m.repack.repack,
    ]


class CostStore:
    """The measured costs of one pair on this machine, read when an engine loads and written after its replies."""

    def __init__(self, path: Path | None, key: str):
        self.path, self.key = path, key
        self._saved_at = 0.0
        self._saved: dict | None = None

    @classmethod
    def for_models(cls, target: Model, draft: Model | None) -> CostStore:
        where = os.environ.get("FSD_LOCAL_COSTS")
        path = None if where == "off" else Path(where) if where else cache_dir() / "costs.json"
        try:
            from importlib.metadata import version

            llama = version("llama-cpp-python")
        except Exception:
            llama = "?"
        devices = _devices()
        parts = [_cpu(), os.cpu_count(), llama, devices, _model_key(target)]
        parts.append(_model_key(draft) if draft else None)
        return cls(path, json.dumps(parts, separators=(",", ":")))

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: start afresh (it is only a head start)
        return data if isinstance(data, dict) else {}

    def load(self, lengths: DraftLength) -> None:
        """Start `lengths` from the stored costs of this pair and machine, if any."""
        entry = self._read().get(self.key)
        if isinstance(entry, dict):
            try:
                restore(lengths, entry)
            except (TypeError, ValueError, KeyError, IndexError):
                pass  # a malformed entry: measured afresh
        self._saved = snapshot(lengths)

    def save(self, lengths: DraftLength) -> None:
        """Write the measured costs back if something new was measured (a size, the draft), or every SAVE_EVERY
        s, merged with the entry on disk: a size never decoded here keeps the seconds stored for it."""
        if self.path is None:
            return
        now = snapshot(lengths)
        before = self._saved or {"sizes": {}, "draft": None}
        new = set(now["sizes"]) != set(before["sizes"]) or now["draft"] != before["draft"]
        if not new and time() - self._saved_at < SAVE_EVERY:
            return
        data = self._read()
        # merged with what is on disk: another engine of the same pair (a second process, a bench's engines side
        # by side) may have written sizes this one never decoded, and dropping them would leave a later engine
        # to guess them off the line through the others (a plain step's price, above all)
        disk = data.get(self.key)
        if isinstance(disk, dict) and isinstance(disk.get("sizes"), dict):
            now = {**now, "sizes": {**disk["sizes"], **now["sizes"]}}
            for key in ("draft", "catch_up"):
                if not now.get(key) and isinstance(disk.get(key), (int, float)):
                    now[key] = disk[key]
        data[self.key] = now
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
        except OSError:
            return  # a read-only cache: the costs are measured again next time
        self._saved, self._saved_at = now, time()


def _devices() -> list[str]:
    try:
        from fsd_local.llama.backend import list_devices

        return sorted(f"{d.backend}:{d.description}" for d in list_devices())
    except Exception:
        return []


def snapshot(lengths: DraftLength) -> dict:
    """The measured costs of a policy as plain numbers: each measured batch size's seconds, the draft model's
    seconds per drafted token and per caught-up token (0: not measured)."""
    sizes = {str(n): seconds for n, seconds in lengths.verify.measured_sizes().items()}
    cm = lengths.costs.get(("model", 0))
    draft = cm.measured_draft_seconds if cm is not None else 0.0
    return {"sizes": sizes, "draft": draft, "catch_up": lengths.measured_catch_up_seconds}


def restore(lengths: DraftLength, entry: dict) -> None:
    """Start a policy from stored costs, each size worth STORED_WEIGHT decodes; an entry without a plain step's
    size restores none (priced off the larger batches, a CPU plain step reads several times too dear)."""
    sizes = {int(n): float(s) for n, s in entry.get("sizes", {}).items()}
    if 1 not in sizes:
        sizes = {}
    for n in sorted(sizes):
        for _ in range(int(STORED_WEIGHT)):
            lengths.observe_batch(n, sizes[n])
    if float(entry.get("draft", 0)) > 0:
        lengths.observe_draft_token(float(entry["draft"]))
    if float(entry.get("catch_up", 0)) > 0:
        lengths.observe_catch_up(CATCH_UP_BATCH, CATCH_UP_BATCH * float(entry["catch_up"]))


def measure_costs(lengths: DraftLength, target: Model, draft: Model | None, n_hi: int, token: int) -> float:
    """Time what is not measured yet: the target's decode of each size 1..n_hi, the draft's token and a
    catch-up batch, the fastest of MEASURE_PASSES each; the cache is left as it was. Returns the seconds."""
    t0 = perf_counter()
    todo = [n for n in range(1, n_hi + 1) if not lengths.verify.measured_at(n)]
    for n, seconds in time_sizes(target, todo, token).items():
        lengths.observe_batch(n, seconds)
    cm = lengths.cost(("model", 0))
    if draft is not None and not cm.draft_measured:
        # the draft's own BOS: a draft of another vocabulary may not have the target's id
        timed = time_sizes(draft, [1, CATCH_UP_BATCH], draft.bos if draft.bos >= 0 else 0)
        if 1 in timed:
            lengths.observe_draft_token(timed[1])
        if CATCH_UP_BATCH in timed:
            lengths.observe_catch_up(CATCH_UP_BATCH, timed[CATCH_UP_BATCH])
    return perf_counter() - t0


def time_sizes(m: Model, sizes: list[int], token: int, passes: int = MEASURE_PASSES) -> dict[int, float]:
    """The fastest of `passes` decodes of each size (logits on every row), the largest first (llama.cpp sizes its
    buffers for it), up then down; the cache is as it was on return (`fsd-local bench --costs` prints these)."""
    base = len(m.tokens)
    sizes = [n for n in sizes if base + n <= m.n_ctx]
    if not sizes:
        return {}
    best = dict.fromkeys(sizes, float("inf"))
    m.checkpoint()  # a recurrent state without snapshots comes back to it (elsewhere: nothing)
    try:
        m.decode([token] * max(sizes), "from:0")
        m.synchronize()
        m.truncate(base)
        for p in range(passes):
            for n in sizes if p % 2 == 0 else sizes[::-1]:
                t = perf_counter()
                m.decode([token] * n, "from:0")
                m.synchronize()
                best[n] = min(best[n], perf_counter() - t)
                m.truncate(base)
    finally:
        m.truncate(base)
    return best
