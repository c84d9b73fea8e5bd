"""Cumulative counters of the server, rendered in the Prometheus text exposition format (version 0.0.4)."""
from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsd_local.engine import Completion

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, help, the Stats field summed into it)
_SUMS = (
    ("fsd_completion_tokens_total", "Tokens generated.", "tokens"),
    ("fsd_prompt_tokens_total", "Prompt tokens received.", "prompt_tokens"),
    ("fsd_prompt_tokens_evaluated_total", "Prompt tokens decoded (the rest came from the reused KV prefix).",
     "prompt_evaluated"),
    ("fsd_rounds_total", "Draft/verify rounds (plain decoding steps in the ar and draft-only modes).", "rounds"),
    ("fsd_target_calls_total", "Target model decodes during generation.", "target_calls"),
    ("fsd_drafted_tokens_total", "Tokens proposed by the draft model.", "drafted"),
    ("fsd_generation_seconds_total", "Seconds from the end of prompt processing to the last token.",
     "seconds_total"),
    ("fsd_prompt_seconds_total", "Seconds spent evaluating prompts.", "prompt_seconds"),
)


class Metrics:
    """Updated from the generation thread and the event loop, read by GET /metrics: one lock guards it all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: Counter[str] = Counter()
        self._accepted: Counter[str] = Counter()  # by reason: sd, fuzzy
        self._decode_seconds: Counter[str] = Counter()  # by model: draft, target
        self._finished: Counter[str] = Counter()  # by finish_reason
        self._responses: Counter[tuple[str, int]] = Counter()  # by (path, status)

    def observe(self, c: "Completion") -> None:
        st = c.stats
        with self._lock:
            for _, _, field in _SUMS:
                self._sums[field] += st[field]
            self._accepted["sd"] += st["accepted_sd"]
            self._accepted["fuzzy"] += st["accepted_fuzzy"]
            self._decode_seconds["draft"] += st["seconds"]["draft"]
            self._decode_seconds["target"] += st["seconds"]["target"]
            self._finished[c.finish_reason] += 1

    def count_response(self, path: str, status: int) -> None:
        with self._lock:
            self._responses[(path, status)] += 1

    def render(self, running: int, waiting: int, capacity: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value!r}" for labels, value in samples)  # repr: no precision lost

        with self._lock:
            metric("fsd_http_responses_total", "counter", "HTTP responses by path and status code.",
                   [(f'{{path="{p}",code="{s}"}}', n) for (p, s), n in sorted(self._responses.items())])
            metric("fsd_generations_total", "counter", "Finished generations by finish reason.",
                   [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self._finished.items())])
            for name, help_, field in _SUMS:
                metric(name, "counter", help_, [("", self._sums[field])])
            metric("fsd_accepted_tokens_total", "counter",
                   "Draft tokens accepted, by reason: sd = passed the lossless test, fuzzy = rescued by tau.",
                   [(f'{{reason="{r}"}}', self._accepted[r]) for r in ("sd", "fuzzy")])
            metric("fsd_decode_seconds_total", "counter", "Seconds in model decodes during generation, by model.",
                   [(f'{{model="{m}"}}', float(self._decode_seconds[m])) for m in ("draft", "target")])
            drafted = self._sums["drafted"]
            seconds = self._sums["seconds_total"]
            metric("fsd_acceptance_ratio", "gauge", "Accepted over drafted tokens since the server started.",
                   [("", float(sum(self._accepted.values()) / drafted if drafted else 0.0))])
            metric("fsd_tokens_per_second", "gauge", "Generated tokens over generation seconds since the start.",
                   [("", float(self._sums["tokens"] / seconds if seconds else 0.0))])
        metric("fsd_queue_requests", "gauge", "Requests admitted to the generation queue, by state.",
               [('{state="running"}', running), ('{state="waiting"}', waiting)])
        metric("fsd_queue_capacity", "gauge", "Requests that may wait behind the running one (--max-queue).",
               [("", capacity)])
        return "\n".join(lines) + "\n"
