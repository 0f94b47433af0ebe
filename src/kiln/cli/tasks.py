"""The task commands against a server: submit, watch, status, cancel, retry, review, list."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from kiln.cli import bulk
from kiln.cli import task_io as tasks
from kiln.client import Client
from kiln.errors import InvalidRequest

if TYPE_CHECKING:
    pass

from kiln.cli.base import JSON, ApiKey, Server, cli, client_of, handled

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


def _given(options: JSON) -> JSON:
    """``options`` without those left unset (None)."""
    return {k: v for k, v in options.items() if v is not None}


def _alone_or_file(
    what: str | None,
    from_file: Path | None,
    *,
    server: str | None,
    api_key: str | None,
    as_json: bool,
) -> str:
    """``what`` when it is given alone; with ``--from-file`` instead, submits the file's
    tasks and exits."""
    if (what is None) == (from_file is None):
        raise InvalidRequest("give a PROMPT or KIND, or --from-file FILE (not both)")
    if from_file is not None:
        with client_of(server, api_key) as client:
            raise typer.Exit(bulk.submit_file(client, from_file, as_json=as_json))
    assert what is not None
    return what


What = Annotated[
    str | None,
    typer.Argument(
        metavar="PROMPT|KIND",
        help="a prompt for image.generate, or a kind (image.transform); not with --from-file",
    ),
]
FromFile = Annotated[
    Path | None,
    typer.Option(
        "--from-file",
        metavar="FILE",
        help="submit every line of a JSON Lines file (a POST /v1/tasks body each, plus an "
        "optional idempotency_key); prints one line per item, exit 1 if any was refused",
    ),
]
Params = Annotated[
    list[str] | None,
    typer.Option(
        "--param", "-p", metavar="KEY=VALUE", help="a param (JSON when it parses: 20, true, [1,2])"
    ),
]
ParamsFile = Annotated[
    Path | None, typer.Option("--params-file", metavar="FILE", help="params as a JSON object")
]
Inputs = Annotated[
    list[str] | None,
    typer.Option(
        "--input",
        "-i",
        metavar="NAME=@PATH",
        help="upload an input file, or name one by content, not sent again: "
        "NAME=sha256:<hex> (an earlier upload or output; sha256sum FILE gives the hex)",
    ),
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
RunAt = Annotated[
    str | None,
    typer.Option(help="run no earlier than this: unix seconds or RFC 3339 (2027-01-01T09:00Z)"),
]
Delay = Annotated[
    float | None, typer.Option("--delay", help="run no earlier than this many seconds from now")
]
AsJson = Annotated[bool, typer.Option("--json", help="print the task as JSON")]
TaskId = Annotated[str, typer.Argument(metavar="ID")]


@cli.command(context_settings={"help_option_names": ["-h", "--help"]})
@handled
def submit(
    what: What = None,
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
    run_at: RunAt = None,
    delay: Delay = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the task until it ends")] = False,
    review_wait: ReviewWait = True,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
    from_file: FromFile = None,
) -> None:
    """Submit a task (a prompt, or any kind with its params and inputs) and print its id.

    `kiln submit "a red fox" --steps 20`, or
    `kiln submit image.transform -p op=thumbnail -p width=256 -p height=256 -i image=@in.png`,
    or many at once: `kiln submit --from-file tasks.jsonl`.
    """
    what = _alone_or_file(what, from_file, server=server, api_key=api_key, as_json=as_json)
    kind = what if tasks.is_kind(what) else "image.generate"
    params = tasks.params_from(param or [], params_file)
    if kind == "image.generate":
        shaped = {
            "prompt": what,
            "width": width,
            "height": height,
            "steps": steps,
            "seed": seed,
            "negative_prompt": negative_prompt,
            "format": image_format,
            "simulate": _simulate(step_ms, simulate),
        }
        params = {**_given(shaped), **params}
    files = [tasks.InputFile.parse(spec) for spec in input_file or []]
    fields = {
        "idempotency_key": idempotency_key,
        "priority": priority,
        "max_attempts": max_attempts,
        "run_at": tasks.moment_of(run_at),
        "delay_s": delay,
    }
    with client_of(server, api_key) as client:
        task = tasks.submit_with_progress(client, kind, params, files, **_given(fields))
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
@handled
def watch(
    task_id: TaskId,
    review_wait: ReviewWait = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="print each event, then the task, as JSON")
    ] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Follow a task with a live progress bar; exit 0 when it ends SUCCESS."""
    with client_of(server, api_key) as client:
        found = client.get(task_id)
        raise typer.Exit(tasks.follow(client, found, review_wait=review_wait, as_json=as_json))


@cli.command()
@handled
def status(
    task_id: TaskId,
    as_json: Annotated[bool, typer.Option("--json", help="print the task as JSON")] = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Show a task."""
    with client_of(server, api_key) as client:
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
    if task.get("scheduled_for"):
        yield f"scheduled for: {task['scheduled_for']}"
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


def _answer(task: JSON, as_json: bool, line: str) -> None:
    """What a command that changed a task prints: the task as JSON, or one line."""
    if as_json:
        tasks.print_json(task)
    else:
        typer.echo(line)


BulkId = Annotated[
    str | None, typer.Argument(metavar="ID", help="one task; leave it out to act by filter")
]


def _by_filter(task_id: str | None, found: JSON, everything: bool) -> bool:
    """Whether the command acts by filter (else on ``task_id``); a usage error for both
    or neither."""
    if task_id is not None and (found or everything):
        raise InvalidRequest("give a task ID or filter options (--status, --code, ...), not both")
    if task_id is None and not (found or everything):
        raise InvalidRequest("give a task ID, or filter options (--status, --code, ...; --all)")
    return task_id is None


@cli.command()
@handled
def cancel(
    task_id: BulkId = None,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
    status: bulk.Statuses = None,
    kind: bulk.Kinds = None,
    code: bulk.Codes = None,
    tenant: bulk.Tenant = None,
    since: bulk.Since = None,
    before: bulk.Before = None,
    everything: bulk.AllTasks = False,
    dry_run: bulk.DryRun = False,
    limit: bulk.Limit = 100,
) -> None:
    """Cancel a task (running tasks stop at their worker's next heartbeat), or every task
    a filter names, a page at a time: `kiln cancel --status PENDING --kind image.generate`."""
    found = bulk.bulk_filter(status, kind, code, tenant, since, before)
    with client_of(server, api_key) as client:
        if _by_filter(task_id, found, everything):
            bulk.run_bulk(
                client,
                "cancel",
                found,
                everything=everything,
                dry_run=dry_run,
                limit=limit,
                as_json=as_json,
            )
            return
        assert task_id is not None
        task = client.cancel(task_id)
    done = "CANCELLED" if task["status"] == "CANCELLED" else f"cancel requested ({task['status']})"
    _answer(task, as_json, f"{task['id']} {done}")


@cli.command()
@handled
def retry(
    task_id: BulkId = None,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
    status: bulk.Statuses = None,
    kind: bulk.Kinds = None,
    code: bulk.Codes = None,
    tenant: bulk.Tenant = None,
    since: bulk.Since = None,
    before: bulk.Before = None,
    everything: bulk.AllTasks = False,
    dry_run: bulk.DryRun = False,
    limit: bulk.Limit = 100,
) -> None:
    """Retry a final FAILED, TIMEOUT or CANCELLED task now, or every one a filter names, a
    page at a time: `kiln retry --status FAILED --code upstream_unavailable --since 1h`."""
    found = bulk.bulk_filter(status, kind, code, tenant, since, before)
    with client_of(server, api_key) as client:
        if _by_filter(task_id, found, everything):
            bulk.run_bulk(
                client,
                "retry",
                found,
                everything=everything,
                dry_run=dry_run,
                limit=limit,
                as_json=as_json,
            )
            return
        assert task_id is not None
        task = client.retry(task_id)
    _answer(
        task, as_json, f"{task['id']} {task['status']} (attempts allowed: {task['max_attempts']})"
    )


@cli.command()
@handled
def review(
    task_id: TaskId,
    decision: Annotated[str, typer.Argument(help="approve or reject")],
    reason: Annotated[str | None, typer.Option(help="why (shown on a reject)")] = None,
    as_json: AsJson = False,
    server: Server = None,
    api_key: ApiKey = None,
) -> None:
    """Approve or reject a task in NEEDS_REVIEW (admin key)."""
    with client_of(server, api_key) as client:
        task = client.review(task_id, decision, reason)
    _answer(task, as_json, f"{task['id']} {task['status']}")


@cli.command("list")
@handled
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
    with client_of(server, api_key) as client:
        page = client.list(status=task_status, kind=kind, limit=limit, cursor=cursor)
    if as_json:
        tasks.print_json(page)
        return
    Console(highlight=False).print(tasks.task_table(page["items"]))
    if page.get("next_cursor"):
        typer.echo(f"more: --cursor {page['next_cursor']}", err=True)
