"""Bulk work from the command line: ``kiln submit --from-file`` and ``kiln rerun``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli import task_io as tasks
from kiln.cli.base import JSON, ApiKey, Server, cli, client_of, handled
from kiln.client import Client
from kiln.errors import InvalidRequest
from kiln.wire import MAX_BATCH_ITEMS


def read_submissions(path: Path) -> list[JSON]:
    """The submissions of a JSON Lines file (one object a line; blank lines skipped).
    A line that is not a JSON object is a usage error: nothing is sent."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequest(f"--from-file {path}: {exc.strerror or exc}") from None
    items: list[JSON] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise InvalidRequest(f"--from-file {path}, line {number}: {exc}") from None
        if not isinstance(item, dict):
            raise InvalidRequest(f"--from-file {path}, line {number}: expected a JSON object")
        items.append(item)
    if not items:
        raise InvalidRequest(f"--from-file {path}: no submissions in it")
    return items


def submit_all(client: Client, items: list[JSON]) -> Iterator[JSON]:
    """Each item's answer, in order: batches of at most 1,000 items (indexes across the
    whole file)."""
    for start in range(0, len(items), MAX_BATCH_ITEMS):
        for answer in client.submit_many(items[start : start + MAX_BATCH_ITEMS]):
            yield {**answer, "index": start + answer["index"]}


def answer_line(answer: JSON) -> str:
    """``3 created tsk_...`` or ``4 refused unknown_kind: no kind 'x' ...``."""
    if answer["status"] == "refused":
        error = answer["error"]
        return f"{answer['index']} refused {error['code']}: {error['message']}"
    return f"{answer['index']} {answer['status']} {answer['task']['id']}"


def submit_file(client: Client, path: Path, *, as_json: bool) -> int:
    """``kiln submit --from-file``: one line per item; 1 when any was refused."""
    refused = 0
    for answer in submit_all(client, read_submissions(path)):
        refused += answer["status"] == "refused"
        typer.echo(json.dumps(answer) if as_json else answer_line(answer))
    return 1 if refused else 0


@cli.command()
@handled
def rerun(
    task_id: Annotated[str, typer.Argument(metavar="ID")],
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-p", metavar="KEY=VALUE", help="a param to change"),
    ] = None,
    priority: Annotated[int | None, typer.Option(help="-100..100; default the original's")] = None,
    new_variation: Annotated[
        bool,
        typer.Option("--new-variation", help="a new task even when an identical one exists"),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the task as JSON")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Run a task again as a new task, with some params changed; print the new id.

    `kiln rerun tsk_... -p seed=8 -p steps=40`, or `kiln rerun tsk_... --new-variation`.
    """
    params = tasks.params_from(param or [], None)
    with client_of(server, api_key) as client:
        task = client.rerun(task_id, params, priority=priority, dedup=not new_variation)
    if task["deduplicated"]:
        typer.echo(f"kiln: {task['id']} already existed (an identical task)", err=True)
    if as_json:
        tasks.print_json(task)
    else:
        typer.echo(task["id"])


# bulk cancel and retry by filter

Statuses = Annotated[
    list[str] | None,
    typer.Option("--status", metavar="STATUS", help="by status (repeat, or a,b); by filter"),
]
Kinds = Annotated[list[str] | None, typer.Option("--kind", metavar="KIND", help="by kind")]
Codes = Annotated[
    list[str] | None, typer.Option("--code", metavar="CODE", help="by the latest error.code")
]
Tenant = Annotated[str | None, typer.Option("--tenant", help="one tenant's tasks (admin key)")]
Since = Annotated[
    str | None,
    typer.Option("--since", help="created since: 1h, 30m, 2d, an RFC 3339 time or unix seconds"),
]
Before = Annotated[str | None, typer.Option("--before", help="created before: as --since")]
AllTasks = Annotated[bool, typer.Option("--all", help="act with no filter: every task")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="only count the tasks that match")]
Limit = Annotated[int, typer.Option("--limit", min=1, max=1000, help="tasks a page")]


def _names(values: list[str] | None) -> list[str]:
    """``--status FAILED --status TIMEOUT`` or ``--status FAILED,TIMEOUT``."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def _moment(raw: str | None) -> float | str | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return raw


def bulk_filter(
    status: list[str] | None,
    kind: list[str] | None,
    code: list[str] | None,
    tenant: str | None,
    since: str | None,
    before: str | None,
) -> JSON:
    """The API's ``filter`` from the command's options (the server checks the values)."""
    found: JSON = {
        "status": _names(status),
        "kind": _names(kind),
        "code": _names(code),
        "tenant": tenant,
        "created_after": _moment(since),
        "created_before": _moment(before),
    }
    return {k: v for k, v in found.items() if v not in (None, [])}


def run_bulk(
    client: Client,
    action: str,
    found: JSON,
    *,
    everything: bool,
    dry_run: bool,
    limit: int,
    as_json: bool,
) -> None:
    """``kiln cancel|retry --status ...``: one line per page, then the totals."""
    done = "cancelled" if action == "cancel" else "retried"
    ask = client.cancel_many if action == "cancel" else client.retry_many
    totals = {"matched": 0, done: 0, "cancel_requested": 0, "skipped": 0}
    pages = ask(found, all_tasks=everything, dry_run=dry_run, limit=limit)
    for number, page in enumerate(pages, start=1):
        if as_json:
            typer.echo(json.dumps(page))
        for key in totals:
            totals[key] += int(page.get(key) or 0)
        if dry_run:
            typer.echo(f"dry run: {action} would act on {page['matched']} tasks", err=as_json)
            return
        if not as_json:
            asked = f", cancel requested {page['cancel_requested']}" if action == "cancel" else ""
            typer.echo(
                f"page {number}: matched {page['matched']}, {done} {page[done]}{asked}, "
                f"skipped {page['skipped']}"
            )
    asked = f", cancel requested {totals['cancel_requested']}" if action == "cancel" else ""
    typer.echo(
        f"total: matched {totals['matched']}, {done} {totals[done]}{asked}, "
        f"skipped {totals['skipped']}",
        err=as_json,
    )
