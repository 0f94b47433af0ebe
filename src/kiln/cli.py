"""The ``kiln`` command line: processes (serve, worker, supervisor) and API commands.

Exit codes (API.md): 0 when the command did what it says (for ``submit --wait`` and
``watch``: the task ended SUCCESS); 1 when the task ended otherwise or the server refused
(404, 409); 2 for usage, connection and authentication errors, with a one-line message on
stderr and no traceback. A setting kiln cannot use (a ``KILN_*`` variable or an option)
is such a usage error, for every command: ``kiln: KILN_PORT='x': expected a port number ...``.

Options that mirror a setting take their help, their environment variable and their
default from :data:`kiln.config.VARIABLES`; the table alone reads the environment.

The processes start safely: ``kiln serve`` binds its port before anything claims work,
and every process waits at most ``KILN_STARTUP_TIMEOUT_S`` for the database and the
storage to answer (SIGTERM and SIGINT end the wait); a port in use, an unreachable
backend or a missing extra is exit 2 with one line, a URL's password hidden. They stop
gracefully: the first SIGTERM or SIGINT drains (workers claim nothing more and let their
running attempts finish within ``KILN_SHUTDOWN_GRACE_S``, then give the rest back
uncounted; a supervisor hands its leadership over), a second one stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import json
import logging
import re
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar
from urllib.parse import unquote, urlsplit

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

import kiln
from kiln import backends, config, logs, transform
from kiln import cli_tasks as tasks
from kiln.client import Client
from kiln.config import Settings
from kiln.errors import ConfigError, InvalidRequest, KilnError
from kiln.process_metrics import LiveMetrics, Readings, supervisor_readings, worker_readings
from kiln.reconcile import DEFAULT_EXAMPLES, Report, ResultLostPolicy, reconcile
from kiln.reconcile import Options as ReconcileOptions

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from prometheus_client.registry import Collector

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("kiln.cli")

JSON = dict[str, Any]

cli = typer.Typer(
    name="kiln",
    help="kiln: a durable job engine for AI generation work.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

#: Errors that mean "you asked wrongly or cannot get in": exit 2.
USAGE_CODES = frozenset(
    {
        "config_error",
        "connection_failed",
        "store_unavailable",
        "storage_error",
        "unauthorized",
        "forbidden",
        "invalid_request",
        "unknown_kind",
    }
)


@cli.callback()
def _root() -> None:
    """kiln: a durable job engine for AI generation work."""


def main() -> None:
    """The console script."""
    cli()


def _exit_code(exc: KilnError) -> int:
    status = getattr(exc, "status_code", None)
    if exc.code in USAGE_CODES or status in (401, 403, 422):
        return 2
    return 1


def _handled(func: Callable[P, R]) -> Callable[P, R]:
    """Turn kiln's errors into a one-line message on stderr and the API.md exit code."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except KilnError as exc:
            for line in tasks.error_lines(exc):
                typer.echo(line, err=True)
            raise typer.Exit(_exit_code(exc)) from None

    return wrapper


# shared options


def _option(field: str, *flags: str, **extra: Any) -> Any:
    """A typer option mirroring the setting ``field``: help, variable and default come
    from the table. It reads only the command line; the table reads the environment."""
    var = config.variable(field)
    meaning = re.sub(r" \(`[^`]*--[a-z-]+`\)", "", var.help)  # the flag is shown anyway
    shown = f"{meaning} [env {var.name}; default {var.default_text}]".replace("`", "")
    return typer.Option(*flags, help=escape(shown), show_default=False, **extra)


Server = Annotated[str | None, _option("server", "--server")]
ApiKey = Annotated[str | None, _option("api_key", "--api-key")]
DataDir = Annotated[Path | None, _option("data_dir", "--data-dir")]
DatabaseUrl = Annotated[str | None, _option("database_url", "--database-url")]
StorageUrl = Annotated[str | None, _option("storage_url", "--storage-url")]
MetricsPort = Annotated[int | None, _option("metrics_port", "--metrics-port", min=0, max=65535)]
MetricsHost = Annotated[str | None, _option("metrics_host", "--metrics-host")]
Gpus = Annotated[int | None, _option("gpus", "--gpus", min=0)]


def _settings(**overrides: Any) -> Settings:
    """Settings from the environment, then the options that were given (not None)."""
    settings = Settings.from_env()
    return settings.with_(**{k: v for k, v in overrides.items() if v is not None})


def _client(server: str | None, api_key: str | None) -> Client:
    """A client on ``--server`` / ``--api-key``, else KILN_SERVER / KILN_API_KEY."""
    settings = Settings.from_env(only=("server", "api_key"))
    return Client(server or settings.server, api_key or settings.api_key)


def _kinds(raw: str | None) -> tuple[str, ...] | None:
    """``--kinds a,b`` as names; None when not given (or naming none)."""
    names = tuple(k.strip() for k in (raw or "").split(",") if k.strip())
    return names or None


def _app(settings: Settings) -> kiln.App:
    """An App with the built-in kinds (nothing opened yet), logging as the settings say."""
    logs.setup(fmt=settings.log_format, level=settings.log_level)
    app = kiln.App(settings=settings)
    backends.register(app)  # image.generate on KILN_BACKEND (the demo by default)
    transform.register(app)
    return app


#: The extra that provides a URL scheme's driver: what to install when it is missing.
EXTRAS = {
    "postgresql": ("PostgreSQL support", "postgres"),
    "postgres": ("PostgreSQL support", "postgres"),
    "s3": ("S3 storage support", "s3"),
}
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _opened(app: kiln.App) -> kiln.App:
    """``app`` with its store and storage opened (nothing is read yet): an unusable URL or
    a driver that is not installed is a usage error."""
    settings = app.settings
    for url, part in (
        (settings.resolved_database_url, lambda: app.store),
        (settings.resolved_storage_url, lambda: app.storage),
    ):
        try:
            part()
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(str(exc)) from None
        except ImportError as exc:
            raise _missing_extra(url, exc) from None
    return app


def _missing_extra(url: str, exc: ImportError) -> ConfigError:
    what, extra = EXTRAS.get(urlsplit(url).scheme, (None, None))
    if extra is None:
        return ConfigError(f"a package kiln needs cannot be imported ({exc}): reinstall kiln")
    return ConfigError(f"{what} is not installed: pip install 'kiln[{extra}]'")


def _hidden(url: str) -> str:
    """``url`` with its password hidden, as ``kiln settings`` shows it."""
    return config.variable("database_url").shown_value(url)


def _one_line(exc: BaseException, url: str) -> str:
    """The first line of an error's message, without the URL's password."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer"
    text = " ".join((str(exc).strip().splitlines() or [type(exc).__name__])[0].split())
    password = urlsplit(url).password
    for secret in {password, unquote(password or "")} - {None, ""}:
        text = text.replace(str(secret), "***")
    return text or type(exc).__name__


async def _store_answers(app: kiln.App) -> None:
    await app.store.last_seq()  # PostgreSQL: connects and applies pending migrations


async def _storage_answers(app: kiln.App) -> None:
    key = f"_kiln/startup-{uuid.uuid4().hex}"
    await app.storage.put(key, b"ok")
    await app.storage.delete(key)


async def _reachable(app: kiln.App) -> None:
    """Wait until the database and the storage answer, at most KILN_STARTUP_TIMEOUT_S;
    then raise ConfigError naming the one that does not (exit 2)."""
    settings = app.settings
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.startup_timeout_s
    parts = (
        ("database", settings.resolved_database_url, "KILN_DATABASE_URL", _store_answers),
        ("storage", settings.resolved_storage_url, "KILN_STORAGE_URL", _storage_answers),
    )
    for what, url, variable, answers in parts:
        delay_s = 0.1
        while True:
            try:
                await asyncio.wait_for(answers(app), max(deadline - loop.time(), 0.01))
                break
            except Exception as exc:  # any failure: wait and try again, then say which
                reason = _one_line(exc, url)
                if loop.time() + delay_s >= deadline:
                    raise ConfigError(
                        f"cannot reach the {what} at {_hidden(url)} within "
                        f"{settings.startup_timeout_s:g} s ({reason}): check {variable} "
                        f"and that it is up",
                        variable=variable,
                    ) from None
                log.debug("startup_waiting", extra={"part": what, "error": reason})
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 2.0)


async def _unless_signalled(work: Awaitable[None]) -> bool:
    """Run ``work`` (a startup step) unless SIGTERM or SIGINT cancels it first; whether
    it ran to its end."""
    loop = asyncio.get_running_loop()
    running = asyncio.ensure_future(work)
    for sig in SIGNALS:
        loop.add_signal_handler(sig, running.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await running
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
    if running.cancelled():
        log.info("stopped_while_starting")
        return False
    return True


# processes


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@cli.command()
@_handled
def serve(
    host: Annotated[str | None, _option("host", "--host")] = None,
    port: Annotated[int | None, _option("port", "--port", min=0, max=65535)] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
    workers: Annotated[int | None, _option("workers", "--workers", min=0)] = None,
    no_workers: Annotated[bool, _option("no_workers", "--no-workers")] = False,
    no_supervisor: Annotated[bool, _option("no_supervisor", "--no-supervisor")] = False,
    gpus: Gpus = None,
    insecure: Annotated[bool, _option("insecure", "--insecure")] = False,
) -> None:
    """API + dashboard + workers + supervisor in one process."""
    settings = _settings(
        host=host,
        port=port,
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        workers=workers,
        no_workers=no_workers or None,  # a flag only turns its setting on
        no_supervisor=no_supervisor or None,
        gpus=gpus,
        insecure=insecure or None,
    )
    _refuse_an_open_address(settings)
    from kiln.api.app import create_app

    app = _app(settings)
    try:
        api = create_app(
            app,
            workers=0 if settings.no_workers else settings.workers,
            gpus=settings.gpus,
            supervisor=not settings.no_supervisor,
            settings=settings,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _opened(app)
    listening = _listen(settings.host, settings.port)  # before any worker can claim
    try:
        _serve(app, api, listening)
    finally:
        listening.close()


def _serve(app: kiln.App, api: FastAPI, listening: socket.socket) -> None:
    """Run the server on the bound socket, on uvicorn's event loop (uvloop when installed)."""
    import uvicorn

    from kiln.api.server_limits import uvicorn_options

    port = int(listening.getsockname()[1])
    uvicorn_config = uvicorn.Config(
        api,
        host=app.settings.host,
        port=port,
        timeout_graceful_shutdown=5,
        **uvicorn_options(app.settings),  # head size, connections, head deadline
    )
    with asyncio.Runner(loop_factory=uvicorn_config.get_loop_factory()) as runner:
        runner.run(_served(app, api, listening, uvicorn_config))


async def _served(
    app: kiln.App, api: FastAPI, listening: socket.socket, uvicorn_config: uvicorn.Config
) -> None:
    """Wait for the database and the storage, then serve until a signal stops the server
    (see :class:`kiln.api.app.GracefulServer`)."""
    from kiln.api.app import GracefulServer, install_log_redaction, shutdown_of

    if not await _unless_signalled(_reachable(app)):
        return  # stopped while starting: nothing was claimed
    install_log_redaction()  # after uvicorn configured its loggers: no ?access_token= in logs
    _print_banner(app.settings, uvicorn_config.port)
    for sig in SIGNALS:
        # uvicorn re-raises the signal that stopped it: after a graceful stop, exit 0.
        signal.signal(sig, lambda *_: None)
    await GracefulServer(uvicorn_config, shutdown_of(api)).serve(sockets=[listening])


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening: a port in use is exit 2, found
    before anything starts (no task claimed by a server that cannot serve)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{shown} is already in use (another kiln serve?): stop that process or "
                "choose another port with --port or KILN_PORT",
                variable="KILN_PORT",
            ) from None
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"cannot listen on {shown}: {reason}: check --host/KILN_HOST and --port/KILN_PORT",
            variable="KILN_HOST",
        ) from None
    sock.set_inheritable(True)
    return sock


def _refuse_an_open_address(settings: Settings) -> None:
    if settings.auth_enabled or _loopback(settings.host) or settings.insecure:
        return
    raise ConfigError(
        f"refusing to listen on {settings.host} without API keys: set KILN_API_KEYS or "
        "KILN_ADMIN_KEY, or pass --insecure",
        variable="KILN_HOST",
    )


def _print_banner(settings: Settings, port: int) -> None:
    host = settings.host
    shown = f"[{host}]" if ":" in host else host
    workers = 0 if settings.no_workers else settings.workers
    out = Console(highlight=False)
    out.print(f"kiln dashboard: http://{shown}:{port}/")
    out.print(f"database: {_hidden(settings.resolved_database_url)}")
    out.print(f"storage:  {_hidden(settings.resolved_storage_url)}")
    out.print(f"workers:  {workers}; auth: {'on' if settings.auth_enabled else 'off'}")


@cli.command()
@_handled
def worker(
    concurrency: Annotated[int | None, _option("concurrency", "--concurrency", min=1)] = None,
    kinds: Annotated[str | None, _option("kinds", "--kinds")] = None,
    gpus: Gpus = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
) -> None:
    """A worker process only. SIGTERM or SIGINT drains it: it claims nothing more, lets
    running attempts finish within KILN_SHUTDOWN_GRACE_S, then gives the rest back to the
    queue uncounted; a second signal gives them back at once."""
    settings = _settings(
        concurrency=concurrency,
        kinds=_kinds(kinds),
        gpus=gpus,
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    app = _app(settings)
    names = list(settings.kinds) if settings.kinds else None
    unknown = sorted(set(names or []) - set(app.kinds))
    if unknown:
        raise ConfigError(f"no task kind {', '.join(unknown)} is registered", variable="KILN_KINDS")
    asyncio.run(_run_worker(_opened(app), names))


async def _run_worker(app: kiln.App, kinds: list[str] | None) -> None:
    settings = app.settings
    async with app:
        if not await _unless_signalled(_reachable(app)):
            return
        process = app.worker(
            concurrency=settings.concurrency, kinds=kinds, resources={"gpu": settings.gpus}
        )
        readings = worker_readings(process)
        upstream: list[Collector] = [*backends.collectors(app), app.breakers]
        with _metrics(settings.metrics_port, settings.metrics_host, readings, upstream):
            await _until_signalled(process.run(), drain=process.drain)


@cli.command()
@_handled
def supervisor(
    interval_s: Annotated[
        float | None,
        _option("supervisor_interval_s", "--interval-s", "--interval", min=0.001),
    ] = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
) -> None:
    """A supervisor process only (one of several leads). SIGTERM or SIGINT stops it and
    hands its leadership over at once."""
    settings = _settings(
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        supervisor_interval_s=interval_s,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    asyncio.run(_run_supervisor(_opened(_app(settings))))


async def _run_supervisor(app: kiln.App) -> None:
    settings = app.settings
    async with app:
        if not await _unless_signalled(_reachable(app)):
            return
        process = app.supervisor()
        readings = supervisor_readings(process)
        with _metrics(settings.metrics_port, settings.metrics_host, readings):
            await _until_signalled(process.run())


async def _until_signalled(work: Awaitable[None], drain: Callable[[], None] | None = None) -> None:
    """Run ``work`` until it ends or signals stop it. The first SIGTERM or SIGINT calls
    ``drain`` (the work then ends by itself), or cancels the work when there is no drain;
    a second one cancels it. Cancelled work cleans up as it ends (a worker gives its
    attempts back, a supervisor hands its leadership over)."""
    loop = asyncio.get_running_loop()
    running = asyncio.ensure_future(work)
    signals = 0

    def stop() -> None:
        nonlocal signals
        signals += 1
        log.info("signalled", extra={"signals": signals})
        if signals == 1 and drain is not None:
            drain()
        else:
            running.cancel()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await running
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def _metrics(
    port: int | None, host: str, readings: Readings, collectors: Iterable[Collector] = ()
) -> Iterator[None]:
    if port is None:
        yield
        return
    from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

    registry = CollectorRegistry()
    registry.register(LiveMetrics(*readings))
    for collector in collectors:
        registry.register(collector)
    ProcessCollector(registry=registry)
    server, thread = start_http_server(port, addr=host, registry=registry)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# API commands


def _simulate(step_ms: int | None, raw: str | None) -> JSON | None:
    simulate: JSON = {}
    if raw:
        try:
            parsed = json.loads(raw)
        except ValueError:
            raise InvalidRequest(f"--simulate is not valid JSON: {raw!r}") from None
        if not isinstance(parsed, dict):
            raise InvalidRequest("--simulate must be a JSON object")
        simulate.update(parsed)
    if step_ms is not None:
        simulate["step_ms"] = step_ms
    return simulate or None


What = Annotated[
    str,
    typer.Argument(
        metavar="PROMPT|KIND", help="a prompt for image.generate, or a kind (image.transform)"
    ),
]
Params = Annotated[
    list[str] | None,
    typer.Option("--param", "-p", help="key=value (JSON when it parses: 20, true, [1,2])"),
]
ParamsFile = Annotated[Path | None, typer.Option("--params-file", help="a JSON object")]
Inputs = Annotated[
    list[str] | None, typer.Option("--input", "-i", help="name=@path: upload an input")
]
Side = Annotated[int | None, typer.Option(help="64-2048, multiple of 8")]
Simulate = Annotated[
    str | None, typer.Option(help='demo backend: simulate options as JSON, {"permanent": true}')
]
ReviewWait = Annotated[
    bool,
    typer.Option(
        "--review-wait/--no-review-wait",
        help="keep waiting when the task is held for review, or exit 1",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="print the task as JSON")]


@cli.command(context_settings={"help_option_names": ["-h", "--help"]})
@_handled
def submit(
    what: What,
    param: Params = None,
    params_file: ParamsFile = None,
    input_file: Inputs = None,
    width: Side = None,
    height: Side = None,
    steps: Annotated[int | None, typer.Option(help="1-150")] = None,
    seed: Annotated[int | None, typer.Option(help="0 to 2^32-1")] = None,
    negative_prompt: Annotated[str | None, typer.Option()] = None,
    image_format: Annotated[str | None, typer.Option("--format", help="png, webp, jpeg")] = None,
    step_ms: Annotated[int | None, typer.Option(help="demo backend: ms per step")] = None,
    simulate: Simulate = None,
    priority: Annotated[int | None, typer.Option(help="-100..100, higher first")] = None,
    max_attempts: Annotated[int | None, typer.Option(help="1..20")] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the task until it ends")] = False,
    review_wait: ReviewWait = True,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Submit a task and print its id: `kiln submit "a red fox" --steps 20`, or any kind,
    `kiln submit image.transform -p op=thumbnail -p width=256 -p height=256 -i image=@in.png`."""
    kind = what if tasks.is_kind(what) else "image.generate"
    params = tasks.params_from(param or [], params_file)
    if kind == "image.generate":
        shaped = {"prompt": what, "width": width, "height": height, "steps": steps,
                  "seed": seed, "negative_prompt": negative_prompt, "format": image_format,
                  "simulate": _simulate(step_ms, simulate)}  # fmt: skip
        params = {**{k: v for k, v in shaped.items() if v is not None}, **params}
    files = [tasks.InputFile.parse(spec) for spec in input_file or []]
    fields = {"priority": priority, "max_attempts": max_attempts}
    with _client(server, api_key) as client:
        task = tasks.submit_with_progress(
            client, kind, params, files, idempotency_key=idempotency_key,
            **{k: v for k, v in fields.items() if v is not None},
        )  # fmt: skip
        _submitted(client, task, wait=wait, review_wait=review_wait, as_json=as_json)


def _submitted(client: Client, task: JSON, *, wait: bool, review_wait: bool, as_json: bool) -> None:
    if task["deduplicated"] or task["replayed"]:
        how = "an identical task" if task["deduplicated"] else "the same idempotency key"
        typer.echo(f"kiln: {task['id']} already existed ({how})", err=True)
    if wait:
        if not as_json:
            typer.echo(task["id"])
        raise typer.Exit(tasks.follow(client, task, review_wait=review_wait, as_json=as_json))
    if as_json:
        tasks.print_json(task)
    else:
        typer.echo(task["id"])


@cli.command()
@_handled
def watch(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    review_wait: ReviewWait = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="print each event, then the task, as JSON")
    ] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Follow a task with a live progress bar; exit 0 when it ends SUCCESS."""
    with _client(server, api_key) as client:
        found = client.get(task_id)
        raise typer.Exit(tasks.follow(client, found, review_wait=review_wait, as_json=as_json))


@cli.command()
@_handled
def status(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    as_json: Annotated[bool, typer.Option("--json", help="print the task as JSON")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Show a task."""
    with _client(server, api_key) as client:
        task = client.get(task_id)
        if as_json:
            tasks.print_json(task)
            return
        for line in _describe(client, task):
            typer.echo(line)


def _describe(client: Client, task: JSON) -> Iterator[str]:
    yield f"{task['id']}  {task['kind']}  {task['status']}"
    if task.get("queue_position"):
        yield f"queue position: {task['queue_position']}"
    yield f"attempt: {task['attempt']}/{task['max_attempts']}"
    progress = task.get("progress")
    if progress and not task["final"]:
        yield f"stage: {task.get('stage') or '-'}  step {progress['step']}/{progress['total']}"
    if task.get("cancel_requested") and not task["final"]:
        yield "cancel requested"
    if task.get("next_retry_at") and task["status"] == "RETRYING":
        yield f"next retry at: {task['next_retry_at']}"
    if task["status"] == "NEEDS_REVIEW":
        yield tasks.review_hint(task["id"])
    if task.get("error"):
        yield f"error: {task['error'].get('code')}: {task['error'].get('message')}"
    for output in (task.get("result") or {}).get("outputs", []):
        yield f"output: {client.output_url(output)}"
    yield f"created: {task['created_at']}  updated: {task['updated_at']}"


@cli.command()
@_handled
def cancel(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Cancel a task (running tasks stop at their worker's next heartbeat)."""
    with _client(server, api_key) as client:
        task = client.cancel(task_id)
    if as_json:
        tasks.print_json(task)
    elif task["status"] == "CANCELLED":
        typer.echo(f"{task['id']} CANCELLED")
    else:
        typer.echo(f"{task['id']} cancel requested ({task['status']})")


@cli.command()
@_handled
def retry(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Retry a final FAILED, TIMEOUT or CANCELLED task now."""
    with _client(server, api_key) as client:
        task = client.retry(task_id)
    if as_json:
        tasks.print_json(task)
    else:
        typer.echo(f"{task['id']} {task['status']} (attempts allowed: {task['max_attempts']})")


@cli.command()
@_handled
def review(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    decision: Annotated[str, typer.Argument(help="approve or reject")],
    reason: Annotated[str | None, typer.Option(help="why (shown on a reject)")] = None,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Approve or reject a task in NEEDS_REVIEW (admin key)."""
    with _client(server, api_key) as client:
        task = client.review(task_id, decision, reason)
    if as_json:
        tasks.print_json(task)
    else:
        typer.echo(f"{task['id']} {task['status']}")


@cli.command("list")
@_handled
def list_tasks(
    task_status: Annotated[str | None, typer.Option("--status", help="e.g. PENDING")] = None,
    kind: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1, max=200)] = 50,
    cursor: Annotated[str | None, typer.Option(help="next_cursor of a previous page")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the page as JSON (items, next_cursor)")
    ] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """List tasks, newest first."""
    with _client(server, api_key) as client:
        page = client.list(status=task_status, kind=kind, limit=limit, cursor=cursor)
    if as_json:
        tasks.print_json(page)
        return
    Console(highlight=False).print(tasks.task_table(page["items"]))
    if page.get("next_cursor"):
        typer.echo(f"more: --cursor {page['next_cursor']}", err=True)


# operator commands


@cli.command("reconcile")
@_handled
def reconcile_command(
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="delete orphan objects older than --grace-s, and apply --result-lost to "
            "SUCCESS tasks whose output is missing or corrupt",
        ),
    ] = False,
    grace_s: Annotated[float | None, _option("reconcile_grace_s", "--grace-s", min=0)] = None,
    result_lost: Annotated[
        ResultLostPolicy | None, _option("result_lost_policy", "--result-lost")
    ] = None,
    examples: Annotated[
        int, typer.Option(min=0, help="items of each list the report shows; counts stay exact")
    ] = DEFAULT_EXAMPLES,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
) -> None:
    """Compare storage with the store. Exit 0 when nothing is wrong (or all was repaired)."""
    settings = _settings(
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        reconcile_grace_s=grace_s,
        result_lost_policy=result_lost,
    )
    options = ReconcileOptions(
        repair=repair,
        grace_s=settings.reconcile_grace_s,
        result_lost=ResultLostPolicy(settings.result_lost_policy),
        examples=examples,
    )
    report = asyncio.run(_reconcile(_opened(_app(settings)), options))
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        for line in _report_lines(report):
            typer.echo(line)
    raise typer.Exit(0 if report.resolved else 1)


async def _reconcile(app: kiln.App, options: ReconcileOptions) -> Report:
    async with app:
        return await reconcile(app, options)


def _report_lines(report: Report) -> Iterator[str]:
    yield (
        f"checked {report.tasks_checked} SUCCESS tasks ({report.outputs_checked} outputs) "
        f"and {report.objects_checked} objects under tasks/ in {report.duration_s:.1f} s"
    )
    for item in report.missing:
        yield f"{item.problem}: task {item.task_id} output {item.key}"
    for orphan in report.orphans:
        owner = f"task {orphan.task_id} {orphan.task_status or '(not in the store)'}"
        age = "age unknown" if orphan.age_s is None else f"{orphan.age_s:.0f} s old"
        yield f"orphan: {orphan.key} ({owner}, {orphan.size} bytes, {age})"
    if report.truncated:
        yield f"(lists show at most {report.examples} items each; the counts are exact)"
    if report.repair:
        yield from _repair_lines(report)
    if report.clean:
        yield "clean: storage and store agree"
    else:
        yield (
            f"problems: {report.missing_count} missing and {report.corrupt_count} corrupt "
            f"outputs of {report.lost_tasks} SUCCESS tasks, {report.orphan_count} orphans "
            f"({report.orphan_bytes} bytes)"
        )


def _repair_lines(report: Report) -> Iterator[str]:
    for repaired in report.repaired:
        yield f"repaired: task {repaired.task_id} {repaired.action} (result_lost)"
    yield (
        f"repair: deleted {report.deleted_count} orphan objects older than "
        f"{report.grace_s:g} s, kept {report.kept_count} younger ones; "
        f"result lost ({report.result_lost_policy}): {report.rerun_count} tasks rerun, "
        f"{report.failed_count} marked FAILED, {report.conflicts} moved on first"
    )


@cli.command("settings")
@_handled
def settings_command(
    as_markdown: Annotated[
        bool, typer.Option("--markdown", help="print the table as the docs show it")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the table as JSON")] = False,
) -> None:
    """Print every KILN_* variable: its value here, its default and what it does."""
    if as_markdown:
        typer.echo(config.markdown(), nl=False)
        return
    current = Settings.from_env()
    if as_json:
        tasks.print_json([
            {"variable": var.name, "value": var.shown_value(getattr(current, var.field)),
             "default": var.default_text.replace("`", ""), "unit": var.unit,
             "meaning": var.help.replace("`", "")}
            for var in config.VARIABLES
        ])  # fmt: skip
        return
    table = Table(Column("variable", no_wrap=True), "value", "default", "unit", "meaning")
    for var in config.VARIABLES:
        cells = (
            var.name,
            var.shown_value(getattr(current, var.field)),
            var.default_text.replace("`", ""),
            var.unit,
            var.help.replace("`", ""),
        )
        table.add_row(*(escape(cell) for cell in cells))
    Console(highlight=False).print(table)


@cli.command()
def states(
    as_json: Annotated[
        bool, typer.Option("--json", help="print the state table itself as JSON")
    ] = False,
) -> None:
    """Print the task state diagram (Mermaid), generated from the state table."""
    from kiln.states import FINAL, TRANSITIONS, Status, mermaid

    if not as_json:
        typer.echo(mermaid(), nl=False)
        return
    table = {
        "statuses": [{"status": str(s), "final": s in FINAL} for s in Status],
        "transitions": [
            {"event": str(rule.event), "from": sorted(str(s) for s in rule.sources),
             "to": sorted(str(s) for s in rule.targets), "by": str(rule.actor),
             "fenced": rule.fenced, "guard": rule.doc}
            for rule in TRANSITIONS
        ],
    }  # fmt: skip
    tasks.print_json(table)


__all__ = ["cli", "main"]
