"""The server's reports on itself: /health, and /metrics in Prometheus' format from `prometheus_client`, with a
registry per app (several apps in one process never count into each other) and every counter in the HTTP
process (the Completions come back from the child), so no multiprocess mode is needed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike, ModelProcess
    from fsd_local.results import Completion
    from fsd_local.server.worker import Worker

ROUTES = ("/health", "/metrics")

# (metric name without _total, help, the Stats field summed into it)
_SUMS = (
    ("fsd_completion_tokens", "Tokens generated.", "tokens"),
    ("fsd_prompt_tokens", "Prompt tokens received.", "prompt_tokens"),
    (
        "fsd_prompt_tokens_evaluated",
        "Prompt tokens decoded (the rest came from the reused KV prefix).",
        "prompt_evaluated",
    ),
    ("fsd_rounds", "Draft/verify rounds (plain decoding steps in the ar and draft-only modes).", "rounds"),
    ("fsd_target_calls", "Target model decodes during generation.", "target_calls"),
    ("fsd_drafted_tokens", "Tokens proposed by the draft model.", "drafted"),
    ("fsd_generation_seconds", "Seconds from the end of prompt processing to the last token.", "seconds_total"),
    ("fsd_prompt_seconds", "Seconds spent evaluating prompts.", "prompt_seconds"),
)


class Metrics:
    """Updated from the generation thread and the event loop, read by GET /metrics. prometheus_client's metrics
    are thread-safe; the lock only keeps the running sums behind the two ratio gauges consistent."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._lock = threading.Lock()
        self._accepted = self._drafted = self._tokens = 0
        self._seconds = 0.0
        self._responses = Counter(
            "fsd_http_responses", "HTTP responses by path and status code.", ["path", "code"], registry=r
        )
        self._finished = Counter(
            "fsd_generations", "Finished generations by finish reason.", ["finish_reason"], registry=r
        )
        self._sums = {field: Counter(name, help_, registry=r) for name, help_, field in _SUMS}
        self._accepted_by = Counter(
            "fsd_accepted_tokens",
            "Draft tokens accepted, by reason: sd = passed the lossless test, fuzzy = rescued by tau.",
            ["reason"],
            registry=r,
        )
        self._decode_seconds = Counter(
            "fsd_decode_seconds", "Seconds in model decodes during generation, by model.", ["model"], registry=r
        )
        for reason in ("sd", "fuzzy"):  # present from the start, as zeros
            self._accepted_by.labels(reason)
        for model in ("draft", "target"):
            self._decode_seconds.labels(model)
        self._ratio = Gauge(
            "fsd_acceptance_ratio", "Accepted over drafted tokens since the server started.", registry=r
        )
        self._speed = Gauge(
            "fsd_tokens_per_second", "Generated tokens over generation seconds since the start.", registry=r
        )
        self._queue = Gauge(
            "fsd_queue_requests", "Requests admitted to the generation queue, by state.", ["state"], registry=r
        )
        self._capacity = Gauge(
            "fsd_queue_capacity", "Requests that may wait behind the running ones (--max-queue).", registry=r
        )
        self._slots = Gauge("fsd_slots", "Generation slots (--parallel), by state.", ["state"], registry=r)
        self._slot_tokens = Gauge(
            "fsd_slot_tokens", "Tokens generated so far by each slot's request (0: idle).", ["slot"], registry=r
        )

    def observe(self, c: Completion) -> None:
        st = c.stats
        for field, counter in self._sums.items():
            counter.inc(st[field])
        self._accepted_by.labels("sd").inc(st["accepted_sd"])
        self._accepted_by.labels("fuzzy").inc(st["accepted_fuzzy"])
        self._decode_seconds.labels("draft").inc(st["seconds"]["draft"])
        self._decode_seconds.labels("target").inc(st["seconds"]["target"])
        self._finished.labels(c.finish_reason).inc()
        with self._lock:
            self._accepted += st["accepted_sd"] + st["accepted_fuzzy"]
            self._drafted += st["drafted"]
            self._tokens += st["tokens"]
            self._seconds += st["seconds_total"]
            self._ratio.set(self._accepted / self._drafted if self._drafted else 0.0)
            self._speed.set(self._tokens / self._seconds if self._seconds else 0.0)

    def count_response(self, path: str, status: int) -> None:
        self._responses.labels(path, str(status)).inc()

    def watch_model_process(self, process: ModelProcess) -> None:
        """Export the supervised model process's restarts and deaths (counted by the supervisor itself)."""
        self.registry.register(_ModelProcessCollector(process))

    def render(self, worker: Worker, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type): the Prometheus text format, or OpenMetrics if the scraper's Accept asks for it."""
        self._queue.labels("running").set(worker.running)
        self._queue.labels("waiting").set(worker.waiting)
        self._capacity.set(worker.max_queue)
        slots = worker.report()
        for state in ("active", "idle"):
            self._slots.labels(state).set(sum(s["state"] == state for s in slots))
        for s in slots:
            self._slot_tokens.labels(str(s["id"])).set(s["request"]["tokens"] if "request" in s else 0)
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class _ModelProcessCollector:
    """Read at scrape time from the supervisor: the values live there, so nothing has to be pushed here."""

    def __init__(self, process: ModelProcess):
        self.process = process

    def collect(self):
        s = self.process
        yield CounterMetricFamily(
            "fsd_model_restarts", "Model processes started to replace one that died.", value=s.restarts
        )
        deaths = CounterMetricFamily(
            "fsd_model_process_deaths",
            "Model process deaths by cause (a signal name, or the exit code).",
            labels=["cause"],
        )
        for cause, n in sorted(s.deaths.items()):
            deaths.add_metric([cause], n)
        yield deaths
        yield GaugeMetricFamily(
            "fsd_model_process_up",
            "1 while a model process is loaded and serving, else 0.",
            value=1.0 if s.state == "ok" else 0.0,
        )
        yield GaugeMetricFamily(
            "fsd_model_start_seconds",
            "Seconds the last model process took to start and load the models.",
            value=s.last_start_seconds,
        )


def install(app: FastAPI, metrics: Metrics, engine: EngineLike, worker: Worker, guarded: list[Any], name: str) -> None:
    """Add /health (open to all) and /metrics."""

    @app.get("/health")
    async def health() -> JSONResponse:
        # ok | restarting (the model process died and a new one is loading) | failed (gave up; reason says why)
        state, reason = engine.state, engine.reason
        body: dict[str, Any] = {
            "status": state,
            "model": name,
            "queue": {"running": worker.running, "waiting": worker.waiting, "max_queue": worker.max_queue},
            "slots": worker.report(),
        }
        if reason:
            body["reason"] = reason
        if (process := engine.model_process) is not None:
            body["model_process"] = {"restarts": process.restarts, "start_seconds": process.last_start_seconds}
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/metrics", dependencies=guarded)
    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render(worker, request.headers.get("accept"))
        return Response(body, media_type=content_type)


class CountResponses:
    """ASGI middleware counting responses by route and status. `routes` are paths, or templates whose last part is
    a parameter ("/v1/models/{model}"); a path no route names is counted as "other"."""

    def __init__(self, app: Any, metrics: Metrics, routes: Sequence[str]):
        self.app, self.metrics = app, metrics
        self.paths = frozenset(r for r in routes if "{" not in r)
        self.templates = [(r[: r.index("{")], r) for r in routes if "{" in r]

    def label(self, path: str) -> str:
        if path in self.paths:
            return path
        return next((t for prefix, t in self.templates if path.startswith(prefix)), "other")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        label = self.label(scope["path"])

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_response(label, message["status"])
            await send(message)

        await self.app(scope, receive, counted)
