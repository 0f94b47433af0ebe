"""The schedule commands against a server: ``kiln schedules`` lists them, ``kiln schedule
add|pause|resume|delete`` changes them (docs/schedules.md)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kiln.cli import task_io as tasks
from kiln.cli.base import JSON, ApiKey, Server, cli, client_of, handled

schedule_cli = typer.Typer(
    name="schedule",
    help="Add, pause, resume or delete a recurring schedule (`kiln schedules` lists them).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
cli.add_typer(schedule_cli)

ScheduleId = Annotated[str, typer.Argument(metavar="ID")]
AsJson = Annotated[bool, typer.Option("--json", help="print the schedule as JSON")]


def schedule_table(items: list[JSON]) -> Table:
    """Schedules as rows: id, cron and zone, kind, state with the next run, fired/skipped."""
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for name in ("ID", "CRON", "ZONE", "KIND", "NEXT", "FIRED", "SKIPPED"):
        table.add_column(name, no_wrap=name in ("ID", "NEXT"))
    for s in items:
        nxt = "paused" if s["paused"] else str(s["next_run_at"])
        table.add_row(
            s["id"], s["cron"], s["timezone"], s["kind"], nxt, str(s["fired"]), str(s["skipped"])
        )
    return table


@cli.command("schedules")
@handled
def list_schedules(
    limit: Annotated[int, typer.Option(min=1, max=200)] = 50,
    cursor: Annotated[str | None, typer.Option(help="next_cursor of a previous page")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the page as JSON")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """List the recurring schedules, oldest first."""
    with client_of(server, api_key) as client:
        page = client.schedules(limit=limit, cursor=cursor)
    if as_json:
        tasks.print_json(page)
        return
    Console(highlight=False).print(schedule_table(page["items"]))
    if page.get("next_cursor"):
        typer.echo(f"more: --cursor {page['next_cursor']}", err=True)


@schedule_cli.command("add")
@handled
def add(
    cron: Annotated[str, typer.Argument(help='e.g. "0 9 * * 1-5"; six fields: seconds first')],
    what: Annotated[
        str, typer.Argument(metavar="PROMPT|KIND", help="a prompt for image.generate, or a kind")
    ],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", metavar="KEY=VALUE", help="a param")
    ] = None,
    timezone: Annotated[str, typer.Option("--timezone", "--tz", help="an IANA zone")] = "UTC",
    overlap: Annotated[
        str, typer.Option(help="skip (while the last tick's task runs) or queue")
    ] = "skip",
    missed: Annotated[str, typer.Option(help="fire_once or skip")] = "fire_once",
    paused: Annotated[bool, typer.Option("--paused", help="create it paused")] = False,
    priority: Annotated[int | None, typer.Option(help="-100..100")] = None,
    max_attempts: Annotated[int | None, typer.Option(help="1..20")] = None,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Add a schedule that submits a task at every tick; prints its id."""
    kind = what if tasks.is_kind(what) else "image.generate"
    params = tasks.params_from(param or [], None)
    if kind == "image.generate":
        params = {"prompt": what, **params}
    options = {"priority": priority, "max_attempts": max_attempts}
    task: dict[str, Any] = {"kind": kind, "params": params}
    task.update({k: v for k, v in options.items() if v is not None})
    with client_of(server, api_key) as client:
        made = client.create_schedule(
            cron, task, timezone=timezone, overlap=overlap, missed=missed, paused=paused
        )
    _answer(made, as_json, f"{made['id']} next run {made['next_run_at'] or 'paused'}")


@schedule_cli.command("pause")
@handled
def pause(
    schedule_id: ScheduleId,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Pause a schedule: no tick fires until it is resumed."""
    with client_of(server, api_key) as client:
        found = client.pause_schedule(schedule_id)
    _answer(found, as_json, f"{found['id']} paused")


@schedule_cli.command("resume")
@handled
def resume(
    schedule_id: ScheduleId,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Resume a schedule from its next tick after now."""
    with client_of(server, api_key) as client:
        found = client.resume_schedule(schedule_id)
    _answer(found, as_json, f"{found['id']} next run {found['next_run_at']}")


@schedule_cli.command("delete")
@handled
def delete(schedule_id: ScheduleId, server: Server = None, api_key: ApiKey = None) -> None:
    """Delete a schedule (the tasks it made stay)."""
    with client_of(server, api_key) as client:
        client.delete_schedule(schedule_id)
    typer.echo(f"{schedule_id} deleted")


def _answer(schedule: JSON, as_json: bool, line: str) -> None:
    if as_json:
        tasks.print_json(schedule)
    else:
        typer.echo(line)
