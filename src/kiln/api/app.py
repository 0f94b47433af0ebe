"""``create_app``: the v1 HTTP API (API.md) around a :class:`kiln.App`.

The FastAPI app's lifespan opens the kiln App, starts its event tail, runs in-process
workers and a supervisor when asked, and on shutdown stops them and closes the App.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from importlib import metadata
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from kiln import backends
from kiln.api import errors, events, tasks
from kiln.api.auth import check_settings
from kiln.api.errors import error_response, error_responses
from kiln.api.metrics import RequestMetrics
from kiln.api.openapi import openapi_builder
from kiln.api.schemas import HealthOut
from kiln.api.server_limits import BodyDeadline
from kiln.api.state import ApiState, api_state
from kiln.app import App
from kiln.config import Settings
from kiln.process_metrics import LiveMetrics, supervisor_readings, worker_readings

log = logging.getLogger("kiln.api")

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"
READY_TIMEOUT_S = 5.0
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
        await app.open()
        loops: list[asyncio.Task[None]] = []
        try:
            await app.hub.start()
            if workers > 0:
                worker = app.worker(concurrency=workers, resources={"gpu": gpus})
                state.metrics.registry.register(LiveMetrics(*worker_readings(worker)))
                for collector in backends.collectors(app):  # upstream latency and breakers
                    state.metrics.registry.register(collector)
                loops.append(asyncio.create_task(_background("worker", worker.run())))
            if supervisor:
                sweeper = app.supervisor()
                state.metrics.registry.register(LiveMetrics(*supervisor_readings(sweeper)))
                loops.append(asyncio.create_task(_background("supervisor", sweeper.run())))
            yield
        finally:
            for loop in loops:
                loop.cancel()
            for loop in loops:
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
            await app.close()

    return lifespan


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
    summary="Prometheus metrics: the deployment's tasks plus this process",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    state = api_state(request)
    body = await state.metrics.render(state.app.engine)
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


def _version() -> str:
    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:
        return "0.0.0"


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
        title="kiln",
        version=_version(),
        description="A durable job engine for AI generation work.",
        lifespan=_lifespan(state, workers=workers, gpus=gpus, supervisor=supervisor),
        redoc_url=None,
    )
    api.state.kiln = state
    errors.install(api)
    api.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    api.add_middleware(RequestMetrics, metrics=state.metrics)
    api.include_router(tasks.router)
    api.include_router(events.router)
    api.include_router(ops)
    if DASHBOARD_DIR.is_dir():
        api.mount("/dashboard", StaticFiles(directory=DASHBOARD_DIR), name="dashboard")
    api.openapi = openapi_builder(api, app, settings)  # type: ignore[method-assign]
    install_log_redaction()
    return api
