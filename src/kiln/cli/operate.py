"""The operator commands: ``kiln workers``, ``kiln usage``, ``kiln webhooks``,
``kiln redeliver``, ``kiln reconcile``, ``kiln settings``, ``kiln states``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

import kiln
from kiln import config
from kiln.cli import task_io as tasks
from kiln.config import Settings
from kiln.reconcile import DEFAULT_EXAMPLES, Report, ResultLostPolicy, reconcile
from kiln.reconcile import Options as ReconcileOptions

if TYPE_CHECKING:
    pass

from kiln.cli.base import (
    JSON,
    ApiKey,
    DatabaseUrl,
    DataDir,
    Server,
    StorageUrl,
    app_of,
    cli,
    client_of,
    handled,
    option,
    settings_of,
)
from kiln.cli.processes import opened

# operator commands


@cli.command("workers")
@handled
def workers_command(
    as_json: Annotated[bool, typer.Option("--json", help="print the API's answer")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """List the live worker processes: kinds, attempts in hand, models loaded (admin key)."""
    with client_of(server, api_key) as client:
        found = client.workers()
    if as_json:
        tasks.print_json(found)
        return
    if not found["workers"]:
        typer.echo("no live workers", err=True)
        return
    Console(highlight=False).print(worker_table(found["workers"]))


def worker_table(workers: list[JSON], now: datetime | None = None) -> Table:
    """Workers as rows: where, what they claim, attempts in hand of their slots, models,
    how long since each started (``started_at``, RFC 3339)."""
    now = now or datetime.now(UTC)
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    table.add_column("HOST", no_wrap=True)
    table.add_column("PID", no_wrap=True, justify="right")
    table.add_column("RUNNING", no_wrap=True, justify="right")
    table.add_column("KINDS", overflow="fold")
    table.add_column("MODELS", overflow="fold")
    table.add_column("VERSION", no_wrap=True)
    table.add_column("UP", no_wrap=True, justify="right")
    for worker in workers:
        table.add_row(
            escape(str(worker["host"])),
            str(worker["pid"]),
            f"{worker['running']}/{worker['slots']}",
            escape(", ".join(worker["kinds"])),
            escape(", ".join(worker["models"]) or "-"),
            escape(str(worker["version"])),
            escape(tasks.age(str(worker["started_at"]), now)),
        )
    return table


@cli.command("usage")
@handled
def usage_command(
    since: Annotated[
        str | None,
        typer.Option("--from", help="RFC 3339 time or date (default: 30 days before --to)"),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--to", help="RFC 3339 time or date (default: now)")
    ] = None,
    group_by: Annotated[
        str,
        typer.Option(
            "--group-by", help="comma-separated: tenant, kind, model, day, outcome, worker, pool"
        ),
    ] = "tenant,kind,model",
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="one tenant's usage (admin key)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the API's answer")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """GPU-seconds and the seconds attempts waited, loaded and generated (the ledger)."""
    groups = [name.strip() for name in group_by.split(",") if name.strip()]
    with client_of(server, api_key) as client:
        found = client.usage(since, until, groups, tenant)
    if as_json:
        tasks.print_json(found)
        return
    if not found["items"]:
        typer.echo("no usage in this window", err=True)
        return
    Console(highlight=False).print(usage_table(found["group_by"], found["items"]))
    if found["truncated"]:
        typer.echo("more groups than shown: narrow the window or the grouping", err=True)


def usage_table(group_by: list[str], items: list[JSON]) -> Table:
    """The ledger's groups as rows: their keys, attempts, and seconds."""
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for name in group_by:
        table.add_column(name.upper(), overflow="fold")
    for name in ("ATTEMPTS", "WAITING_S", "LOADING_S", "GENERATING_S", "GPU_S"):
        table.add_column(name, no_wrap=True, justify="right")
    for item in items:
        keys = [escape(str(item[name])) if item[name] is not None else "-" for name in group_by]
        seconds = [
            f"{item[name]:.1f}"
            for name in ("waiting_s", "loading_s", "generating_s", "gpu_seconds")
        ]
        table.add_row(*keys, str(item["attempts"]), *seconds)
    return table


@cli.command("webhooks")
@handled
def webhooks_command(
    task_id: Annotated[str, typer.Argument(metavar="TASK_ID")],
    as_json: Annotated[bool, typer.Option("--json", help="print the API's answer")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """List a task's webhook deliveries: status, attempts, last answer, next attempt."""
    with client_of(server, api_key) as client:
        found = client.webhooks(task_id)
    if as_json:
        tasks.print_json(found)
        return
    if not found["items"]:
        note = "" if found.get("webhook") else " (the task has no webhook)"
        typer.echo(f"no webhook deliveries{note}", err=True)
        return
    Console(highlight=False).print(delivery_table(found["items"]))


def delivery_table(deliveries: list[JSON], now: datetime | None = None) -> Table:
    """Deliveries as rows: the id to redeliver, the event, how its attempts went, and for
    a pending one how soon the next attempt is due (fits 80 columns)."""
    now = now or datetime.now(UTC)
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    table.add_column("ID", no_wrap=True)
    table.add_column("EVENT", no_wrap=True)
    table.add_column("STATUS", no_wrap=True)
    table.add_column("TRIES", no_wrap=True, justify="right")
    table.add_column("NEXT", no_wrap=True)
    table.add_column("LAST ANSWER", overflow="fold")
    for item in deliveries:
        answer = item["last_error"] or item["last_response_status"] or "-"
        table.add_row(
            escape(str(item["id"])),
            escape(str(item["event"])),
            str(item["status"]),
            str(item["attempts"]),
            _due_in(item["next_attempt_at"], now),
            escape(str(answer)),
        )
    return table


def _due_in(stamp: str | None, now: datetime) -> str:
    """How soon an API time comes: ``now``, ``12s``, ``3m``; ``-`` for none."""
    if stamp is None:
        return "-"
    seconds = (datetime.fromisoformat(stamp) - now).total_seconds()
    if seconds <= 0:
        return "now"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


@cli.command("redeliver")
@handled
def redeliver_command(
    task_id: Annotated[str, typer.Argument(metavar="TASK_ID")],
    delivery_id: Annotated[str, typer.Argument(metavar="DELIVERY_ID")],
    as_json: Annotated[bool, typer.Option("--json", help="print the delivery as JSON")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Send a webhook delivery again now, with the same webhook-id (admin key)."""
    with client_of(server, api_key) as client:
        found = client.redeliver(task_id, delivery_id)
    if as_json:
        tasks.print_json(found)
        return
    typer.echo(f"{found['id']} {found['status']} (attempts so far: {found['attempts']})")


@cli.command("reconcile")
@handled
def reconcile_command(
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="delete orphan objects older than --grace-s, and apply --result-lost to "
            "SUCCESS tasks whose output is missing or corrupt",
        ),
    ] = False,
    grace_s: Annotated[float | None, option("reconcile_grace_s", "--grace-s", min=0)] = None,
    result_lost: Annotated[
        ResultLostPolicy | None, option("result_lost_policy", "--result-lost")
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
    settings = settings_of(
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
    report = asyncio.run(_reconcile(opened(app_of(settings)), options))
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
@handled
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
        tasks.print_json(
            [
                {
                    "variable": var.name,
                    "value": var.shown_value(getattr(current, var.field)),
                    "default": var.default_text.replace("`", ""),
                    "unit": var.unit,
                    "meaning": var.help.replace("`", ""),
                }
                for var in config.VARIABLES
            ]
        )
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
            {
                "event": str(rule.event),
                "from": sorted(str(s) for s in rule.sources),
                "to": sorted(str(s) for s in rule.targets),
                "by": str(rule.actor),
                "fenced": rule.fenced,
                "guard": rule.doc,
            }
            for rule in TRANSITIONS
        ],
    }
    tasks.print_json(table)
