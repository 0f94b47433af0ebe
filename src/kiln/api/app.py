"""``create_app``: the v1 HTTP API (API.md) around a :class:`kiln.App`.

The FastAPI app's lifespan opens the kiln App, starts its event tail, runs in-process
workers and a supervisor when asked, and on shutdown stops them and closes the App. How
they stop is the app's :class:`Shutdown` (:func:`shutdown_of`): ``kiln serve`` begins it
at the first SIGTERM, so workers drain within ``KILN_SHUTDOWN_GRACE_S`` while the server
finishes its requests; a lifespan that ends without it gives running attempts back at once.
Either way no attempt is counted (DESIGN.md, I9).

Serving it: ``uvicorn.run(create_app(app), ...)``. Query strings may carry an API key
(``?access_token=`` on streams), so every server log that prints request lines must go
through :class:`RedactAccessToken`; ``create_app`` installs it on uvicorn's loggers
(``uvicorn.access`` and ``uvicorn.error``, which logs WebSocket paths).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from kiln import backends
from kiln.api import bulk, bulk_actions, deliveries, docs, errors, events, schedules, tasks
from kiln.api import comfy as comfy_routes
from kiln.api import usage as usage_routes
from kiln.api import workers as worker_routes
from kiln.api.auth import check_settings
from kiln.api.errors import error_response, error_responses
from kiln.api.hot_paths import HotPaths
from kiln.api.metrics import RequestMetrics, sees_tenants
from kiln.api.openapi import openapi_builder
from kiln.api.request_spans import RequestSpans
from kiln.api.schemas import HealthOut
from kiln.api.server_limits import BodyDeadline
from kiln.api.state import ApiState, api_state
from kiln.app import App
from kiln.config import Settings
from kiln.model_loads import ModelLoadMetrics
from kiln.presence import version
from kiln.process_metrics import LiveMetrics, supervisor_readings, worker_readings
from kiln.worker import RELEASE_TIMEOUT_S, Worker

log = logging.getLogger("kiln.api")

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"
READY_TIMEOUT_S = 5.0
#: kiln traces its requests itself (KILN_TRACING, RequestSpans): FastAPI's own telemetry
#: would look up three OpenTelemetry providers on every request.
NO_FASTAPI_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
FASTAPI_OPTIONS: dict[str, Any] = {
    "title": "kiln",
    "description": "A durable job engine for AI generation work.",
    "docs_url": None,  # served by kiln.api.docs, without a CDN
    "redoc_url": None,
    "telemetry": NO_FASTAPI_TELEMETRY,
}
REDACTED_LOGGERS = ("uvicorn.access", "uvicorn.error")


class RedactAccessToken(logging.Filter):
    """Replaces the value of every ``access_token=`` in a log record with ``[redacted]``.

    Install it on the loggers that print request paths (uvicorn's access log, and
    ``uvicorn.error`` for WebSocket paths): :func:`install_log_redaction` does.
    """

    PATTERN = re.compile(r"(access_token=)[^&\s\"']*", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self.redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {
                k: self.redact(v) if isinstance(v, str) else v for k, v in record.args.items()
            }
        return True

    @classmethod
    def redact(cls, text: str) -> str:
        return cls.PATTERN.sub(r"\1[redacted]", text)


def install_log_redaction(names: Iterable[str] = REDACTED_LOGGERS) -> None:
    """Add one :class:`RedactAccessToken` to each named logger (idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactAccessToken) for f in logger.filters):
            logger.addFilter(RedactAccessToken())


# Shutdown -------------------------------------------------------------------------------

#: How long past the grace the lifespan waits for its loops before it stops them at once.
STOP_MARGIN_S = RELEASE_TIMEOUT_S + 2.0


@dataclass(slots=True)
class Shutdown:
    """How an API process stops its background loops (one per app; see the module doc).

    :meth:`begin` (the first SIGTERM or SIGINT of ``kiln serve``): open streams end with a
    reconnect hint; in-process workers drain: they claim nothing more, their running
    attempts finish within ``grace_s`` and the rest go back to the queue uncounted; the
    supervisor stops and hands its leadership over. :meth:`halt` (a second signal): every
    loop stops now and attempts are given back at once.
    """

    grace_s: float
    begun: bool = False
    closing: asyncio.Event | None = None
    workers: list[Worker] = field(default_factory=list)
    supervisors: list[asyncio.Task[None]] = field(default_factory=list)
    loops: list[asyncio.Task[None]] = field(default_factory=list)

    def started(self, closing: asyncio.Event) -> None:
        """A new lifespan runs (an app may be served more than once)."""
        self.begun = False
        self.closing = closing
        self.workers.clear()
        self.supervisors.clear()
        self.loops.clear()

    def begin(self, grace_s: float | None = None) -> None:
        """Start a graceful stop (once; see the class doc)."""
        if self.begun:
            return
        self.begun = True
        grace = self.grace_s if grace_s is None else grace_s
        log.info("api_stopping", extra={"grace_s": grace, "workers": len(self.workers)})
        if self.closing is not None:
            self.closing.set()
        for worker in self.workers:
            worker.drain(grace)
        for loop in self.supervisors:
            loop.cancel()  # it resigns as it stops

    def halt(self) -> None:
        """Stop every loop now (a second signal)."""
        self.begin(0.0)
        for loop in self.loops:
            loop.cancel()

    async def finished(self) -> None:
        """Wait for the loops to end: the grace plus a margin, then stop them at once."""
        if not self.loops:
            return
        _, late = await asyncio.wait(self.loops, timeout=self.grace_s + STOP_MARGIN_S)
        if late:
            self.halt()
            await asyncio.wait(late, timeout=STOP_MARGIN_S)


def shutdown_of(api: FastAPI) -> Shutdown:
    """The :class:`Shutdown` of an app made by :func:`create_app`."""
    shutdown: Shutdown = api.state.kiln_shutdown
    return shutdown


class GracefulServer(uvicorn.Server):
    """uvicorn's server stopping the way ``kiln serve`` does: the first SIGTERM or SIGINT
    begins the app's :class:`Shutdown` (streams close with a reconnect hint, workers drain)
    while uvicorn stops taking connections and finishes the requests in flight; a second
    one stops at once (uvicorn's force exit, attempts given back at once). ``also`` hears
    each signal too (``kiln serve`` passes it on to its worker processes)."""

    def __init__(
        self,
        config: uvicorn.Config,
        shutdown: Shutdown,
        also: Callable[[int], None] = lambda sig: None,
    ) -> None:
        super().__init__(config)
        self.kiln_shutdown = shutdown
        self.also = also
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)
        late = [loop for loop in self.kiln_shutdown.loops if not loop.done()]
        if late:  # a force exit skips the lifespan's end: let the give-backs land
            await asyncio.wait(late, timeout=STOP_MARGIN_S)
        if self.force_exit and getattr(self, "lifespan", None) is not None:
            # Then end the lifespan too (the store and storage close), instead of leaving
            # it to be cancelled at the loop's end, which uvicorn reports as a traceback.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.lifespan.shutdown(), timeout=STOP_MARGIN_S)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        super().handle_exit(sig, frame)
        if self.signals > 1:
            self.force_exit = True
        self.also(sig)
        if self._loop is not None:  # a signal handler: act on the event loop, not here
            self._loop.call_soon_threadsafe(self._stop, self.signals)

    def _stop(self, signals: int) -> None:
        log.info("api_signalled", extra={"signals": signals})
        if signals == 1:
            self.kiln_shutdown.begin()
        else:
            self.kiln_shutdown.halt()


# Lifespan -------------------------------------------------------------------------------


async def _background(name: str, loop: Awaitable[None]) -> None:
    try:
        await loop
    except asyncio.CancelledError:
        raise
    except Exception:  # a loop's edge: log it; the API keeps answering
        log.exception("background_loop_failed", extra={"loop": name})


def _lifespan(
    state: ApiState, *, workers: int, gpus: int, supervisor: bool
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        install_log_redaction()
        app = state.app
        shutdown = shutdown_of(api)
        shutdown.started(events.reset_closing(api))
        await app.open()
        try:
            await app.hub.start()
            if workers > 0:
                worker = app.worker(concurrency=workers, resources={"gpu": gpus})
                state.metrics.registry.register(LiveMetrics(*worker_readings(worker)))
                state.metrics.registry.register(
                    ModelLoadMetrics(worker.model_loads, shown=state.metrics.models_shown)
                )
                for collector in backends.collectors(app):  # upstream latency and breakers
                    state.metrics.registry.register(collector)
                shutdown.workers.append(worker)
                shutdown.loops.append(asyncio.create_task(_background("worker", worker.run())))
            if supervisor:
                sweeper = app.supervisor()
                state.metrics.registry.register(LiveMetrics(*supervisor_readings(sweeper)))
                loop = asyncio.create_task(_background("supervisor", sweeper.run()))
                shutdown.supervisors.append(loop)
                shutdown.loops.append(loop)
            yield
        finally:
            shutdown.begin(0.0)  # nobody began a drain: give running attempts back now
            await _stopped(shutdown)
            await app.close()

    return lifespan


async def _stopped(shutdown: Shutdown) -> None:
    """Wait for the loops to end, also when the lifespan itself is being cancelled."""
    try:
        await shutdown.finished()
    except asyncio.CancelledError:
        shutdown.halt()
        if shutdown.loops:
            await asyncio.wait(shutdown.loops, timeout=STOP_MARGIN_S)
        raise


# Operations routes ----------------------------------------------------------------------

ops = APIRouter()


@ops.get("/healthz", summary="The process answers", response_model=HealthOut)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@ops.get(
    "/readyz",
    summary="The store and the storage answer",
    response_model=HealthOut,
    responses=error_responses(503),
)
async def readyz(request: Request) -> Response:
    try:
        await asyncio.wait_for(api_state(request).app.ready(), READY_TIMEOUT_S)
    except Exception as exc:  # any failure of either backend means "not ready"
        log.warning("not_ready", extra={"error": type(exc).__name__})
        return error_response("not_ready", "the store or the storage does not answer")
    return JSONResponse({"status": "ok"})


@ops.get(
    "/metrics",
    summary="Prometheus metrics: the deployment's tasks plus this process (per-tenant "
    "series: the metrics key or the admin key)",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(401),
    },
)
async def metrics(request: Request) -> Response:
    state = api_state(request)
    tenants = sees_tenants(state.settings, request.headers.get("authorization"))
    body = await state.metrics.render(
        state.app.engine, tenants=tenants, models=state.settings.metrics_models
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)


FALLBACK_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kiln</title></head>
<body><h1>kiln</h1><p id="note">Loading tasks…</p><ul id="tasks"></ul>
<script>
async function load() {
  const key = localStorage.getItem("kiln.apiKey") || "";
  const headers = key ? {Authorization: "Bearer " + key} : {};
  const res = await fetch("/v1/tasks?limit=50", {headers});
  const note = document.getElementById("note");
  if (res.status === 401) {
    const entered = prompt("API key");
    if (entered) { localStorage.setItem("kiln.apiKey", entered); return load(); }
    note.textContent = "An API key is needed."; return;
  }
  const page = await res.json();
  note.textContent = page.items.length + " recent tasks";
  const list = document.getElementById("tasks");
  for (const task of page.items) {
    const item = document.createElement("li");
    item.textContent = task.id + " " + task.kind + " " + task.status;
    list.appendChild(item);
  }
}
load();
</script></body></html>
"""


@ops.get("/", include_in_schema=False)
async def index() -> Response:
    page = DASHBOARD_DIR / "index.html"
    if await asyncio.to_thread(page.is_file):
        return FileResponse(page, media_type="text/html")
    return HTMLResponse(FALLBACK_PAGE)


# The app --------------------------------------------------------------------------------


def create_app(
    app: App,
    *,
    workers: int = 0,
    gpus: int = 1,
    supervisor: bool = False,
    settings: Settings | None = None,
    ping_interval_s: float = 15.0,
) -> FastAPI:
    """The HTTP API of ``app`` (API.md).

    ``workers > 0`` runs one in-process worker loop of that concurrency with ``gpus``
    GPU slots; ``supervisor`` runs a supervisor loop. ``settings`` (auth keys, body limit)
    default to ``app.settings``. ``ping_interval_s`` is the keep-alive period of streams.
    A configuration the server must not start with raises ValueError.
    """
    settings = settings or app.settings
    check_settings(settings)
    state = ApiState(app, settings, ping_interval_s=ping_interval_s)
    api = FastAPI(
        version=version(),
        lifespan=_lifespan(state, workers=workers, gpus=gpus, supervisor=supervisor),
        **FASTAPI_OPTIONS,
    )
    api.state.kiln = state
    api.state.kiln_shutdown = Shutdown(grace_s=settings.shutdown_grace_s)
    errors.install(api)
    comfy_routes.install_errors(api)  # /api/v2 paths answer in the v2 envelope
    api.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    api.add_middleware(RequestMetrics, metrics=state.metrics)
    if app.engine.tracing is not None:  # KILN_TRACING: outermost, so it spans the rest
        api.add_middleware(RequestSpans, tracing=app.engine.tracing)
    else:  # the busiest requests skip the router (kiln.api.hot_paths)
        build = api.build_middleware_stack
        api.build_middleware_stack = lambda: HotPaths(build(), state)  # type: ignore[method-assign]
    api.include_router(bulk_actions.router)  # before /tasks/{task_id}/...
    api.include_router(tasks.router)
    api.include_router(bulk.router)
    api.include_router(deliveries.router)
    api.include_router(events.router)
    api.include_router(worker_routes.router)
    api.include_router(schedules.router)
    api.include_router(usage_routes.router)
    api.include_router(comfy_routes.router)  # the Comfy API v2, /api/v2 (docs/comfy.md)
    included = len(api.router.routes)
    api.include_router(ops)
    operations = api.router.routes[included:]
    docs.install(api)
    if DASHBOARD_DIR.is_dir():
        api.mount("/dashboard", StaticFiles(directory=DASHBOARD_DIR), name="dashboard")
    document = list(api.router.routes)  # the order the OpenAPI document lists them in
    api.openapi = openapi_builder(api, app, settings, document)  # type: ignore[method-assign]
    # A request is matched against the routes one by one, in order: the operations routes
    # (probes every few seconds; exact paths no other route takes) are tried first.
    api.router.routes[:] = operations + [r for r in document if r not in operations]
    install_log_redaction()
    return api
