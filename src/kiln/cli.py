"""The ``kiln`` command line: processes (serve, worker, supervisor) and API commands.

Exit codes (API.md): 0 when the command did what it says (for ``submit --wait`` and
``watch``: the task ended SUCCESS); 1 when the task ended otherwise or the server refused
(404, 409); 2 for usage, connection and authentication errors, with a one-line message on
stderr and no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import signal
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import kiln
from kiln import backends, logs, transform
from kiln.client import DEFAULT_SERVER, Client
from kiln.config import Settings
from kiln.errors import InvalidRequest, KilnError
from kiln.process_metrics import LiveMetrics, Readings, supervisor_readings, worker_readings
from kiln.reconcile import DEFAULT_EXAMPLES, Report, ResultLostPolicy, reconcile
from kiln.reconcile import Options as ReconcileOptions

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

P = ParamSpec("P")
R = TypeVar("R")

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
    {"connection_failed", "unauthorized", "forbidden", "invalid_request", "unknown_kind"}
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
            typer.echo(f"kiln: {exc.message}", err=True)
            raise typer.Exit(_exit_code(exc)) from None

    return wrapper


# shared options

Server = Annotated[
    str, typer.Option("--server", envvar="KILN_SERVER", help="the kiln API to talk to")
]
ApiKey = Annotated[
    str | None, typer.Option("--api-key", envvar="KILN_API_KEY", help="sent as a Bearer token")
]
DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        envvar="KILN_DATA_DIR",
        show_default="./kiln-data",
        help="data directory (database and results by default)",
    ),
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="KILN_DATABASE_URL",
        help="sqlite:///path.db; default <data-dir>/kiln.db",
    ),
]
StorageUrl = Annotated[
    str | None,
    typer.Option(
        "--storage-url", envvar="KILN_STORAGE_URL", help="file:///path; default <data-dir>/results"
    ),
]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        envvar="KILN_METRICS_PORT",
        help="serve Prometheus metrics at /metrics on this port",
    ),
]
MetricsHost = Annotated[
    str, typer.Option("--metrics-host", envvar="KILN_METRICS_HOST", help="metrics address")
]


def _settings(**overrides: Any) -> Settings:
    """Settings from the environment, then the options that were given."""
    try:
        settings = Settings.from_env()
    except ValueError as exc:  # e.g. a KILN_METRICS_PORT that is not a number
        raise InvalidRequest(f"bad KILN_* setting: {exc}") from None
    return settings.with_(**{k: v for k, v in overrides.items() if v is not None})


def _app(settings: Settings) -> kiln.App:
    """An App with the built-in kinds (nothing opened yet), logging as the settings say."""
    logs.setup(fmt=settings.log_format, level=settings.log_level)
    app = kiln.App(settings=settings)
    backends.register(app)  # image.generate on KILN_BACKEND (the demo by default)
    transform.register(app)
    return app


def _opened(app: kiln.App) -> kiln.App:
    """``app`` with its store and storage opened: an unusable URL is a usage error."""
    try:
        _ = app.store, app.storage
    except (ValueError, NotImplementedError) as exc:
        raise InvalidRequest(str(exc)) from None
    return app


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
    host: Annotated[str, typer.Option(envvar="KILN_HOST", help="address to listen on")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(envvar="KILN_PORT", min=0, max=65535)] = 8000,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
    workers: Annotated[
        int, typer.Option(envvar="KILN_WORKERS", min=0, help="concurrent tasks in this process")
    ] = 2,
    no_workers: Annotated[
        bool, typer.Option("--no-workers", envvar="KILN_NO_WORKERS", help="API only")
    ] = False,
    no_supervisor: Annotated[
        bool,
        typer.Option(
            "--no-supervisor",
            envvar="KILN_NO_SUPERVISOR",
            help="no supervisor loop here (run `kiln supervisor` processes instead)",
        ),
    ] = False,
    gpus: Annotated[int, typer.Option(envvar="KILN_GPUS", min=0, help="gpu slots")] = 1,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            envvar="KILN_INSECURE",
            help="allow a non-loopback address without API keys",
        ),
    ] = False,
) -> None:
    """API + dashboard + workers + supervisor in one process."""
    settings = _settings(data_dir=data_dir, database_url=database_url, storage_url=storage_url)
    if not settings.auth_enabled and not _loopback(host) and not insecure:
        raise InvalidRequest(
            f"refusing to listen on {host} without API keys: set KILN_API_KEYS or "
            "KILN_ADMIN_KEY, or pass --insecure"
        )
    import uvicorn

    from kiln.api.app import create_app, install_log_redaction

    app = _app(settings)
    try:
        api = create_app(
            app,
            workers=0 if no_workers else workers,
            gpus=gpus,
            supervisor=not no_supervisor,
            settings=settings,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    _opened(app)
    config = uvicorn.Config(api, host=host, port=port, timeout_graceful_shutdown=5)
    install_log_redaction()  # after uvicorn configured its loggers: no ?access_token= in logs
    shown = f"[{host}]" if ":" in host else host
    out = Console(highlight=False)
    out.print(f"kiln dashboard: http://{shown}:{port}/")
    out.print(f"database: {settings.resolved_database_url}")
    out.print(f"storage:  {settings.resolved_storage_url}")
    out.print(
        f"workers:  {0 if no_workers else workers}; auth: "
        f"{'on' if settings.auth_enabled else 'off'}"
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        # uvicorn re-raises the signal that stopped it: after a graceful stop, exit 0.
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()


@cli.command()
@_handled
def worker(
    concurrency: Annotated[
        int, typer.Option(envvar="KILN_CONCURRENCY", min=1, help="tasks run at once")
    ] = 2,
    kinds: Annotated[
        str | None, typer.Option(envvar="KILN_KINDS", help="comma-separated task kinds")
    ] = None,
    gpus: Annotated[int, typer.Option(envvar="KILN_GPUS", min=0, help="gpu slots")] = 1,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = "127.0.0.1",
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
) -> None:
    """A worker process only. SIGTERM or SIGINT gives running attempts back as retryable."""
    settings = _settings(
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        metrics_port=metrics_port,
    )
    app = _app(settings)
    names = [k.strip() for k in kinds.split(",") if k.strip()] if kinds else None
    unknown = sorted(set(names or []) - set(app.kinds))
    if unknown:
        raise InvalidRequest(f"no task kind {', '.join(unknown)} is registered")
    asyncio.run(_run_worker(_opened(app), concurrency, names, gpus, metrics_host))


async def _run_worker(
    app: kiln.App, concurrency: int, kinds: list[str] | None, gpus: int, metrics_host: str
) -> None:
    async with app:
        process = app.worker(concurrency=concurrency, kinds=kinds, resources={"gpu": gpus})
        readings = worker_readings(process)
        upstream: list[Collector] = [*backends.collectors(app), app.breakers]
        with _metrics(app.settings.metrics_port, metrics_host, readings, upstream):
            await _until_signalled(process.run())


@cli.command()
@_handled
def supervisor(
    interval: Annotated[
        float | None,
        typer.Option(envvar="KILN_SUPERVISOR_INTERVAL", min=0.001, help="sweep period, seconds"),
    ] = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = "127.0.0.1",
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    storage_url: StorageUrl = None,
) -> None:
    """A supervisor process only (one of several leads)."""
    settings = _settings(
        data_dir=data_dir,
        database_url=database_url,
        storage_url=storage_url,
        supervisor_interval_s=interval,
        metrics_port=metrics_port,
    )
    asyncio.run(_run_supervisor(_opened(_app(settings)), metrics_host))


async def _run_supervisor(app: kiln.App, metrics_host: str) -> None:
    async with app:
        process = app.supervisor()
        with _metrics(app.settings.metrics_port, metrics_host, supervisor_readings(process)):
            await _until_signalled(process.run())


async def _until_signalled(work: Awaitable[None]) -> None:
    """Run ``work`` until SIGTERM or SIGINT, then cancel it and let it clean up."""
    loop = asyncio.get_running_loop()
    running = asyncio.ensure_future(work)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, running.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await running
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
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


@cli.command()
@_handled
def submit(
    prompt: Annotated[str, typer.Argument(help="what to paint")],
    width: Annotated[int | None, typer.Option(help="64-2048, multiple of 8")] = None,
    height: Annotated[int | None, typer.Option(help="64-2048, multiple of 8")] = None,
    steps: Annotated[int | None, typer.Option(help="1-150")] = None,
    seed: Annotated[int | None, typer.Option(help="0 to 2^32-1")] = None,
    negative_prompt: Annotated[str | None, typer.Option()] = None,
    image_format: Annotated[str | None, typer.Option("--format", help="png, webp, jpeg")] = None,
    step_ms: Annotated[int | None, typer.Option(help="demo backend: ms per step")] = None,
    simulate: Annotated[
        str | None, typer.Option(help='demo backend: simulate options as JSON, {"permanent": true}')
    ] = None,
    priority: Annotated[int | None, typer.Option(help="-100..100, higher first")] = None,
    max_attempts: Annotated[int | None, typer.Option(help="1..20")] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the task until it ends")] = False,
    server: Server = DEFAULT_SERVER,
    api_key: ApiKey = None,
) -> None:
    """Submit an image.generate task and print its id."""
    params = {
        "prompt": prompt,
        "width": width,
        "height": height,
        "steps": steps,
        "seed": seed,
        "negative_prompt": negative_prompt,
        "format": image_format,
        "simulate": _simulate(step_ms, simulate),
    }
    fields: JSON = {"priority": priority, "max_attempts": max_attempts}
    with Client(server, api_key) as client:
        task = client.submit(
            "image.generate",
            {k: v for k, v in params.items() if v is not None},
            idempotency_key=idempotency_key,
            **{k: v for k, v in fields.items() if v is not None},
        )
        typer.echo(task["id"])
        if task["deduplicated"] or task["replayed"]:
            how = "an identical task" if task["deduplicated"] else "the same idempotency key"
            typer.echo(f"kiln: {task['id']} already existed ({how})", err=True)
        if wait:
            raise typer.Exit(_follow(client, task))


@cli.command()
@_handled
def watch(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    server: Server = DEFAULT_SERVER,
    api_key: ApiKey = None,
) -> None:
    """Follow a task with a live progress bar; exit 0 when it ends SUCCESS."""
    with Client(server, api_key) as client:
        raise typer.Exit(_follow(client, client.get(task_id)))


class _ProgressView:
    """One task's live bar: status, stage, step n/m and attempt n/m."""

    def __init__(self, progress: Progress, task: JSON) -> None:
        self.progress = progress
        self.max_attempts = int(task["max_attempts"])
        self.bar = progress.add_task(
            task["id"], total=None, status=task["status"], stage="", steps="", attempt=""
        )
        self.status(task["status"], int(task["attempt"]))
        if task.get("progress"):
            self.step(task.get("stage"), task["progress"])

    def show(self, message: JSON, refresh: Callable[[], JSON]) -> None:
        if message.get("type") == "status":
            if message.get("event") == "retry":
                self.max_attempts = int(refresh()["max_attempts"])
            line = f"{message.get('from') or '-'} → {message['status']} ({message['event']})"
            if message.get("error"):
                line += f": {message['error'].get('code')}"
            self.progress.console.print(line, highlight=False)
            self.status(message["status"], int(message.get("attempt") or 0))
        elif message.get("type") == "progress" and message.get("progress"):
            self.step(message.get("stage"), message["progress"])

    def status(self, status: str, attempt: int) -> None:
        shown = f"attempt {attempt}/{self.max_attempts}" if attempt else ""
        self.progress.update(self.bar, status=status, attempt=shown)

    def step(self, stage: str | None, progress: JSON) -> None:
        step, total = int(progress["step"]), int(progress["total"])
        self.progress.update(
            self.bar, stage=stage or "", steps=f"step {step}/{total}", completed=step, total=total
        )


def _follow(client: Client, task: JSON) -> int:
    """Show the task's events until it ends; the exit code its final status means."""
    err = Console(stderr=True, highlight=False)
    columns = (
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[status]}"),
        TextColumn("{task.fields[stage]}"),
        BarColumn(),
        TextColumn("{task.fields[steps]}"),
        TextColumn("{task.fields[attempt]}"),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=err) as progress:
            view = _ProgressView(progress, task)
            for message in client.stream(task["id"]):
                view.show(message, lambda: client.get(task["id"]))
    except KeyboardInterrupt:
        typer.echo(f"kiln: stopped watching; task {task['id']} goes on", err=True)
        return 130
    return _ended(client, client.get(task["id"]))


def _ended(client: Client, task: JSON) -> int:
    if task["status"] == "SUCCESS":
        for output in (task.get("result") or {}).get("outputs", []):
            typer.echo(client.output_url(output))
        return 0
    error = task.get("error") or {}
    reason = f": {error.get('code')}: {error.get('message')}" if error else ""
    typer.echo(f"kiln: task {task['id']} ended {task['status']}{reason}", err=True)
    return 1


@cli.command()
@_handled
def status(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    as_json: Annotated[bool, typer.Option("--json", help="print the task as JSON")] = False,
    server: Server = DEFAULT_SERVER,
    api_key: ApiKey = None,
) -> None:
    """Show a task."""
    with Client(server, api_key) as client:
        task = client.get(task_id)
        if as_json:
            typer.echo(json.dumps(task, indent=2))
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
    if task.get("error"):
        yield f"error: {task['error'].get('code')}: {task['error'].get('message')}"
    for output in (task.get("result") or {}).get("outputs", []):
        yield f"output: {client.output_url(output)}"
    yield f"created: {task['created_at']}  updated: {task['updated_at']}"


@cli.command()
@_handled
def cancel(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    server: Server = DEFAULT_SERVER,
    api_key: ApiKey = None,
) -> None:
    """Cancel a task (running tasks stop at their worker's next heartbeat)."""
    with Client(server, api_key) as client:
        task = client.cancel(task_id)
    if task["status"] == "CANCELLED":
        typer.echo(f"{task['id']} CANCELLED")
    else:
        typer.echo(f"{task['id']} cancel requested ({task['status']})")


@cli.command()
@_handled
def retry(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    server: Server = DEFAULT_SERVER,
    api_key: ApiKey = None,
) -> None:
    """Retry a final FAILED, TIMEOUT or CANCELLED task now."""
    with Client(server, api_key) as client:
        task = client.retry(task_id)
    typer.echo(f"{task['id']} {task['status']} (attempts allowed: {task['max_attempts']})")


@cli.command()
@_handled
def review(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    decision: Annotated[str, typer.Argument(help="approve or reject")],
    reason: Annotated[str | None, typer.Option(help="why (shown on a reject)")] = None,
    server: Server = DEFAULT_SERVER,
    api_key: ApiKey = None,
) -> None:
    """Approve or reject a task in NEEDS_REVIEW (admin key)."""
    with Client(server, api_key) as client:
        task = client.review(task_id, decision, reason)
    typer.echo(f"{task['id']} {task['status']}")


@cli.command("list")
@_handled
def list_tasks(
    task_status: Annotated[str | None, typer.Option("--status", help="e.g. PENDING")] = None,
    kind: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1, max=200)] = 50,
    cursor: Annotated[str | None, typer.Option(help="next_cursor of a previous page")] = None,
    server: Server = DEFAULT_SERVER,
    api_key: ApiKey = None,
) -> None:
    """List tasks, newest first."""
    with Client(server, api_key) as client:
        page = client.list(status=task_status, kind=kind, limit=limit, cursor=cursor)
    Console(highlight=False).print(_task_table(page["items"]))
    if page.get("next_cursor"):
        typer.echo(f"more: --cursor {page['next_cursor']}", err=True)


def _task_table(tasks: list[JSON]) -> Table:
    """Ids and statuses are never cut short, whatever the terminal's width."""
    table = Table()
    table.add_column("id", no_wrap=True, min_width=max((len(t["id"]) for t in tasks), default=2))
    table.add_column("kind")
    table.add_column(
        "status", no_wrap=True, min_width=max((len(t["status"]) for t in tasks), default=6)
    )
    table.add_column("attempt", no_wrap=True)
    table.add_column("progress", no_wrap=True)
    table.add_column("created")
    for task in tasks:
        progress = task.get("progress")
        shown = f"{progress['step']}/{progress['total']}" if progress else ""
        attempt = f"{task['attempt']}/{task['max_attempts']}"
        table.add_row(task["id"], task["kind"], task["status"], attempt, shown, task["created_at"])
    return table


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
    grace_s: Annotated[
        float | None,
        typer.Option(min=0, help="orphan age to repair [env KILN_RECONCILE_GRACE_S; 3600]"),
    ] = None,
    result_lost: Annotated[
        ResultLostPolicy | None,
        typer.Option(
            "--result-lost",
            help="with --repair, a lost result's task is re-run or marked FAILED result_lost "
            "[env KILN_RESULT_LOST_POLICY; fail]",
        ),
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


@cli.command()
def states() -> None:
    """Print the task state diagram (Mermaid), generated from the state table."""
    from kiln.states import mermaid

    typer.echo(mermaid(), nl=False)


__all__ = ["cli", "main"]
