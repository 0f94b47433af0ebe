"""The process commands: ``kiln serve``, ``kiln worker``, ``kiln supervisor``, and how a
process starts (the database and storage reached within ``KILN_STARTUP_TIMEOUT_S``, the
port bound before anything claims) and stops (the first signal drains, a second stops)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Annotated
from urllib.parse import unquote, urlsplit

import typer
from rich.console import Console

import kiln
from kiln import backends, config
from kiln.backends import comfy_workflow
from kiln.config import Settings
from kiln.errors import ConfigError
from kiln.model_loads import ModelLoadMetrics
from kiln.presence import models_loaded
from kiln.process_metrics import LiveMetrics, Readings, supervisor_readings, worker_readings

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from prometheus_client.registry import Collector

from kiln.cli.base import (
    DatabaseUrl,
    DataDir,
    Gpus,
    MetricsHost,
    MetricsPort,
    StorageUrl,
    app_of,
    cli,
    handled,
    kind_names,
    log,
    option,
    port_of,
    port_text,
    settings_of,
)
from kiln.cli.heap import settle_heap
from kiln.cli.worker_processes import process_count, started_beside, usable_cores

#: The extra that provides a URL scheme's driver: what to install when it is missing.
EXTRAS = {
    "postgresql": ("PostgreSQL support", "postgres"),
    "postgres": ("PostgreSQL support", "postgres"),
    "s3": ("S3 storage support", "s3"),
}
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def opened(app: kiln.App) -> kiln.App:
    """``app`` with its store and storage opened (nothing is read yet): an unusable URL or
    a driver that is not installed is a usage error."""
    settings = app.settings
    for url, part in (
        (settings.resolved_database_url, app.now),  # the store's clock: opens the store
        (settings.resolved_storage_url, lambda: app.storage),
    ):
        try:
            part()
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(str(exc)) from None
        except ImportError as exc:
            raise _missing_extra(url, exc) from None
    _ = app.engine.tracing  # KILN_TRACING=on without the otel extra: a usage error too
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
    await app.connect()  # PostgreSQL: connects and applies pending migrations


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
@handled
def serve(
    host: Annotated[str | None, option("host", "--host")] = None,
    port: Annotated[int | None, option("port", "--port", metavar="PORT", parser=port_text)] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
    workers: Annotated[int | None, option("workers", "--workers", min=0)] = None,
    worker_processes: Annotated[
        str | None, option("worker_processes", "--worker-processes", metavar="N|auto")
    ] = None,
    no_workers: Annotated[bool, option("no_workers", "--no-workers")] = False,
    no_supervisor: Annotated[bool, option("no_supervisor", "--no-supervisor")] = False,
    gpus: Gpus = None,
    insecure: Annotated[bool, option("insecure", "--insecure")] = False,
) -> None:
    """API + dashboard + workers + supervisor in one process."""
    settings = settings_of(
        host=host,
        port=port_of("port", "--port", port),
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        workers=workers,
        no_workers=no_workers or None,  # a flag only turns its setting on
        no_supervisor=no_supervisor or None,
        gpus=gpus,
        insecure=insecure or None,
    )
    if worker_processes is not None:  # auto is None, which the overrides would skip
        settings = settings.with_(worker_processes=_processes_of(worker_processes))
    if settings.sqlite_submit_process == "auto":  # the API's writer off its loop's core
        settings = settings.with_(sqlite_submit_process="on" if usable_cores() >= 2 else "off")
    _refuse_an_open_address(settings)
    from kiln.api.app import create_app

    app = app_of(settings)
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
    opened(app)
    listening = _listen(settings.host, settings.port)  # before any worker can claim
    settle_heap(settings.gc_threshold)
    try:
        _serve(app, api, listening)
    finally:
        listening.close()


def _processes_of(raw: str) -> int | None:
    """``--worker-processes`` as its setting reads it: ``auto`` (None) or a count."""
    var = config.variable("worker_processes")
    try:
        value = var.parse(raw)
    except ValueError:
        raise var.refusal("--worker-processes", raw) from None
    assert value is None or isinstance(value, int)
    return value


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
        **uvicorn_options(app.settings),  # head size, connections, head and body deadlines
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
    with started_beside(app) as beside:  # once the database and the storage answer
        server = GracefulServer(uvicorn_config, shutdown_of(api), also=beside.forward)
        await server.serve(sockets=[listening])


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
    extra = process_count(settings)
    if extra:
        out.print(f"worker processes: {extra} (`kiln worker`, {workers} tasks each)")
    if settings.sqlite_submit_process == "on" and settings.resolved_database_url.startswith(
        "sqlite:"
    ):
        out.print("submit process: on (plain submissions written beside the API)")


@cli.command()
@handled
def worker(
    concurrency: Annotated[int | None, option("concurrency", "--concurrency", min=1)] = None,
    kinds: Annotated[str | None, option("kinds", "--kinds")] = None,
    gpus: Gpus = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
    exit_with_parent: Annotated[bool, typer.Option("--exit-with-parent", hidden=True)] = False,
) -> None:
    """A worker process only.

    SIGTERM or SIGINT drains it: it claims nothing more, lets running attempts finish within
    KILN_SHUTDOWN_GRACE_S, then gives the rest back to the queue uncounted; a second signal
    gives them back at once.
    """
    settings = settings_of(
        concurrency=concurrency,
        kinds=kind_names(kinds),
        gpus=gpus,
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        metrics_port=port_of("metrics_port", "--metrics-port", metrics_port),
        metrics_host=metrics_host,
    )
    if comfy_workflow.KIND in (settings.kinds or ()) and concurrency is None:
        settings = _one_prompt_at_a_time(settings)
    app = app_of(settings)
    names = list(settings.kinds) if settings.kinds else None
    unknown = sorted(set(names or []) - set(app.kinds))
    if unknown:
        raise ConfigError(f"no task kind {', '.join(unknown)} is registered", variable="KILN_KINDS")
    opened(app)
    settle_heap(settings.gc_threshold)
    asyncio.run(_run_worker(app, names, exit_with_parent))


def _one_prompt_at_a_time(settings: Settings) -> Settings:
    """A worker of `comfy.workflow` drives one ComfyUI instance, which runs one prompt at
    a time: unless KILN_CONCURRENCY or --concurrency says otherwise, it claims one job at
    a time, so it holds no job back from the other instances' workers."""
    if "KILN_CONCURRENCY" in os.environ:
        return settings
    return settings.with_(concurrency=1)


async def _run_worker(app: kiln.App, kinds: list[str] | None, with_parent: bool) -> None:
    settings = app.settings
    async with app:
        if not await _unless_signalled(_reachable(app)):
            return
        process = app.worker(
            concurrency=settings.concurrency, kinds=kinds, resources={"gpu": settings.gpus}
        )
        readings = worker_readings(process)

        def held() -> set[str]:  # model names come from tasks: name these only
            kinds = (app.kinds[name] for name in process.kinds)
            return {*models_loaded(kinds), *settings.metrics_models}

        upstream: list[Collector] = [
            *backends.collectors(app),
            app.breakers,
            ModelLoadMetrics(process.model_loads, shown=held),
        ]
        with _metrics(settings.metrics_port, settings.metrics_host, readings, upstream):
            await _until_signalled(process.run(), drain=process.drain, parent=with_parent)


def _follow_parent(asked: Callable[[], None]) -> None:
    """Hear the ``kiln serve`` that started this process on stdin, a pipe from it
    (kiln.cli.worker_processes): each byte is a stopping step it passes on (``asked``: the
    first drains, a second gives the attempts back at once, as its own signals do); end of
    file, that it is gone (SIGKILL included): this process signals itself and drains."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()

    def readable() -> None:
        try:
            more = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            more = b""
        for _ in more[:2]:
            asked()
        if not more:
            loop.remove_reader(fd)
            log.info("parent_gone", extra={"parent": os.getppid()})
            os.kill(os.getpid(), signal.SIGTERM)

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)


@cli.command()
@handled
def supervisor(
    interval_s: Annotated[
        float | None,
        option("supervisor_interval_s", "--interval-s", "--interval", min=0.001),
    ] = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
) -> None:
    """A supervisor process only (one of several leads).

    SIGTERM or SIGINT stops it and hands its leadership over at once.
    """
    settings = settings_of(
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        supervisor_interval_s=interval_s,
        metrics_port=port_of("metrics_port", "--metrics-port", metrics_port),
        metrics_host=metrics_host,
    )
    app = opened(app_of(settings))
    settle_heap(settings.gc_threshold)
    asyncio.run(_run_supervisor(app))


async def _run_supervisor(app: kiln.App) -> None:
    settings = app.settings
    async with app:
        if not await _unless_signalled(_reachable(app)):
            return
        process = app.supervisor()
        readings = supervisor_readings(process)
        with _metrics(settings.metrics_port, settings.metrics_host, readings):
            await _until_signalled(process.run())


async def _until_signalled(
    work: Awaitable[None], drain: Callable[[], None] | None = None, *, parent: bool = False
) -> None:
    """Run ``work`` until it ends or signals stop it. The first SIGTERM or SIGINT calls
    ``drain`` (the work then ends by itself), or cancels the work when there is no drain;
    a second one cancels it. Cancelled work cleans up as it ends (a worker gives its
    attempts back, a supervisor hands its leadership over). With ``parent``, the steps
    ``kiln serve`` passes on (:func:`_follow_parent`) count with the signals, not on top
    of them: a signal that reached this process too (a terminal's Ctrl-C reaches the
    whole process group) and its copy passed on are one step."""
    loop = asyncio.get_running_loop()
    running = asyncio.ensure_future(work)
    signals = passed_on = done = 0

    def step() -> None:
        nonlocal done
        wanted = max(signals, passed_on)
        if wanted == done:
            return
        done = wanted
        log.info("signalled", extra={"signals": wanted})
        if wanted == 1 and drain is not None:
            drain()
        else:
            running.cancel()

    def stop() -> None:
        nonlocal signals
        signals += 1
        step()

    def asked() -> None:
        nonlocal passed_on
        passed_on += 1
        step()

    if parent:
        _follow_parent(asked)
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
