"""What the command line's task commands make of their arguments, and how they show
answers: params from ``--param`` and ``--params-file``, uploads from ``--input`` with a
byte progress bar, the API's errors line by line, the task table, and the follower that
``submit --wait`` and ``watch`` run (which says so when a task waits for review).

The commands themselves are in :mod:`kiln.cli`; nothing here reads the environment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from kiln.client import REFERENCE_PREFIX, Client
from kiln.errors import InvalidRequest, KilnError

JSON = dict[str, Any]

#: A task kind's name: dotted lowercase words (``image.generate``), never a sentence.
KIND_NAME = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z0-9_-]+)+$")
#: Exit code of ``watch``/``submit --wait`` given ``--no-review-wait``, on NEEDS_REVIEW.
IN_REVIEW = 1


def is_kind(word: str) -> bool:
    """Whether the first argument of ``kiln submit`` names a kind (else it is a prompt);
    ``pipeline`` is one (docs/pipelines.md)."""
    return word == "pipeline" or KIND_NAME.match(word) is not None


# errors


def error_lines(exc: KilnError) -> list[str]:
    """An error as the CLI prints it: the API's as ``code: message`` then one line per
    detail (``params.steps: Input should be less than or equal to 150 (less_than_equal)``);
    the CLI's own (a setting, a connection) as its message."""
    answered = getattr(exc, "status_code", None) is not None  # the server's own words
    lines = [f"kiln: {exc.code}: {exc.message}" if answered else f"kiln: {exc.message}"]
    for detail in exc.details:
        lines.append(f"  {_detail(detail)}")
    return lines


def _detail(detail: Any) -> str:
    if not isinstance(detail, dict):
        return str(detail)
    where = ".".join(str(part) for part in detail.get("loc", ()) if part != "body")
    message = str(detail.get("msg") or detail.get("message") or "")
    kind = detail.get("type")
    rest = {k: v for k, v in detail.items() if k not in ("loc", "msg", "message", "type")}
    text = f"{where}: {message}" if where else message
    if kind:
        text += f" ({kind})"
    if rest:
        text += " " + json.dumps(rest, sort_keys=True, default=str)
    return text.strip() or json.dumps(detail, sort_keys=True, default=str)


# params and inputs


def params_from(pairs: list[str], params_file: Path | None) -> JSON:
    """The params of ``--params-file`` (a JSON object), then each ``--param key=value`` on
    top. A value is read as JSON when it is JSON (``20``, ``true``, ``[1, 2]``, ``"20"``),
    else taken as text; a dotted key sets a nested field (``simulate.step_ms=20``)."""
    params: JSON = {}
    if params_file is not None:
        try:
            loaded = json.loads(params_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"--params-file {params_file}: {exc}") from None
        if not isinstance(loaded, dict):
            raise InvalidRequest(f"--params-file {params_file}: expected a JSON object")
        params.update(loaded)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest(f"--param {pair!r}: expected key=value")
        _set(params, key.strip().split("."), _value(raw))
    return params


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _set(params: JSON, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        nested = params.setdefault(part, {})
        if not isinstance(nested, dict):
            raise InvalidRequest(f"--param {'.'.join(path)}: {part} is not an object")
        params = nested
    params[path[-1]] = value


@dataclass(frozen=True, slots=True)
class InputFile:
    """One ``--input name=@path``, or ``name=sha256:<hex>``: an input named by its content
    (an earlier upload or output of the tenant), not sent again (``path`` is then None)."""

    name: str
    path: Path | None
    reference: str | None = None

    @classmethod
    def parse(cls, spec: str) -> InputFile:
        name, sep, where = spec.partition("=")
        if sep and name and where.lower().startswith(REFERENCE_PREFIX):
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", where.lower()):
                raise InvalidRequest(f"--input {spec!r}: expected sha256: and 64 hex digits")
            return cls(name, None, where.lower())
        if not sep or not name or not where.startswith("@"):
            raise InvalidRequest(
                f"--input {spec!r}: expected name=@path (image=@photo.png) or name=sha256:<hex>"
            )
        path = Path(where[1:]).expanduser()
        if not path.is_file():
            raise InvalidRequest(f"--input {spec!r}: no file {path}")
        return cls(name, path)


class _Counted:
    """A file that moves a progress bar as the upload reads it."""

    def __init__(self, file: IO[bytes], advance: Callable[[int], None]) -> None:
        self.file = file
        self.advance = advance

    def read(self, size: int = -1) -> bytes:
        chunk = self.file.read(size)
        self.advance(len(chunk))
        return chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def submit_with_progress(
    client: Client, kind: str, params: JSON, files: list[InputFile], **fields: Any
) -> JSON:
    """Submit, uploading ``files`` as multipart with a byte progress bar on stderr (those
    given by reference go in the body's ``inputs``)."""
    refs = {f.name: f.reference for f in files if f.reference is not None}
    if refs:
        fields = {**fields, "inputs": refs}
    paths = {f.name: f.path for f in files if f.path is not None}
    if not paths:
        return client.submit(kind, params, **fields)
    total = sum(path.stat().st_size for path in paths.values())
    columns = (TextColumn("uploading"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with ExitStack() as stack:
        progress = stack.enter_context(Progress(*columns, console=_stderr(), transient=True))
        bar = progress.add_task("upload", total=total)

        def advance(n: int) -> None:
            progress.update(bar, advance=n)

        uploads = {
            name: (path.name, _Counted(stack.enter_context(path.open("rb")), advance))
            for name, path in paths.items()
        }
        return client.submit(kind, params, files=uploads, **fields)


# showing tasks


def task_table(tasks: list[JSON]) -> Table:
    """Tasks as rows that fit 80 columns (id, status with its step or queue position,
    kind, attempt, age): the id and the status are never cut, a long kind folds rather
    than losing its end."""
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    table.add_column("ID", no_wrap=True, min_width=max((len(t["id"]) for t in tasks), default=2))
    table.add_column("STATUS", no_wrap=True)
    table.add_column("KIND", overflow="fold")
    table.add_column("TRY", no_wrap=True)
    table.add_column("AGE", no_wrap=True, justify="right")
    now = datetime.now(UTC)
    for task in tasks:
        table.add_row(
            task["id"],
            _status(task),
            task["kind"],
            f"{task['attempt']}/{task['max_attempts']}",
            age(str(task["created_at"]), now),
        )
    return table


def _status(task: JSON) -> str:
    progress = task.get("progress")
    if progress and not task.get("final"):
        return f"{task['status']} {progress['step']}/{progress['total']}"
    if task.get("queue_position"):
        return f"{task['status']} #{task['queue_position']}"
    if task.get("scheduled_for"):
        return f"{task['status']} @{task['scheduled_for']}"
    return str(task["status"])


def moment_of(raw: str | None) -> float | str | None:
    """``--run-at`` as the API takes it: unix seconds when it is a number, else the text
    (an RFC 3339 time, which the server checks)."""
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return raw


def age(stamp: str, now: datetime) -> str:
    """How long ago an API time was, in its largest unit: ``45s``, ``12m``, ``3h``, ``9d``."""
    try:
        seconds = max((now - datetime.fromisoformat(stamp)).total_seconds(), 0.0)
    except ValueError:
        return stamp
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def print_json(value: Any) -> None:
    Console(highlight=False, soft_wrap=True).print_json(json.dumps(value))


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


# following a task


class _View:
    """One task's live bar: status, stage, step n/m and attempt n/m."""

    def __init__(self, progress: Progress, task: JSON) -> None:
        self.progress = progress
        self.task_id = task["id"]
        self.max_attempts = int(task["max_attempts"])
        self.bar: TaskID = progress.add_task(
            task["id"], total=None, status=task["status"], stage="", steps="", attempt=""
        )
        self.status(task["status"], int(task["attempt"]))
        if task.get("progress"):
            self.step(task.get("stage"), task["progress"])

    def show(self, message: JSON, refresh: Callable[[], JSON]) -> None:
        if message.get("task_id", self.task_id) != self.task_id:  # a pipeline's step
            if message.get("type") == "status":
                line = f"  step {message['task_id']}: {message.get('from') or '-'} → "
                self.progress.console.print(f"{line}{message['status']}", highlight=False)
            return
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


def review_hint(task_id: str) -> str:
    return (
        f"task {task_id} waits for review: kiln review {task_id} approve"
        f" (or: kiln review {task_id} reject --reason ...)"
    )


def follow(client: Client, task: JSON, *, review_wait: bool = True, as_json: bool = False) -> int:
    """Show the task's events until it ends; the exit code its final status means. A task
    that enters NEEDS_REVIEW is said so, with the command that approves it; then the
    follower keeps waiting, or (``review_wait`` off) exits ``IN_REVIEW``."""
    try:
        if as_json:
            ended = _follow_json(client, task, review_wait)
        else:
            ended = _follow_bar(client, task, review_wait)
    except KeyboardInterrupt:
        _stderr().print(f"kiln: stopped watching; task {task['id']} goes on")
        return 130
    if ended is not None:
        return ended
    return finish(client, client.get(task["id"]), as_json=as_json)


def _follow_bar(client: Client, task: JSON, review_wait: bool) -> int | None:
    columns = (
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[status]}"),
        TextColumn("{task.fields[stage]}"),
        BarColumn(),
        TextColumn("{task.fields[steps]}"),
        TextColumn("{task.fields[attempt]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=_stderr()) as progress:
        view = _View(progress, task)
        for message in _events(client, task):
            view.show(message, lambda: client.get(task["id"]))
            if _in_review(message):
                progress.console.print(review_hint(task["id"]), soft_wrap=True, markup=False)
                if not review_wait:
                    return IN_REVIEW
    return None


def _follow_json(client: Client, task: JSON, review_wait: bool) -> int | None:
    out = Console(highlight=False, soft_wrap=True)
    for message in _events(client, task):
        out.print(json.dumps(message, sort_keys=True), markup=False)
        if _in_review(message):
            _stderr().print(review_hint(task["id"]), soft_wrap=True, markup=False)
            if not review_wait:
                return IN_REVIEW
    return None


def _events(client: Client, task: JSON) -> Iterator[JSON]:
    """The task's events from its first (a task already in review replays the event that
    put it there), until it is final."""
    return client.stream(task["id"])


def _in_review(message: JSON) -> bool:
    return message.get("type") == "status" and message.get("status") == "NEEDS_REVIEW"


def finish(client: Client, task: JSON, *, as_json: bool = False) -> int:
    """Print how the task ended (its outputs, or why not); 0 for SUCCESS."""
    if as_json:
        print_json(task)
    elif task["status"] == "SUCCESS":
        for output in (task.get("result") or {}).get("outputs", []):
            typer.echo(client.output_url(output))
        for step in task.get("steps") or []:  # a pipeline: each step and its outputs
            urls = " ".join(client.output_url(o) for o in step["outputs"])
            typer.echo(f"{step['name']}/{step['copy']} {step['status']} {urls}".rstrip())
    if task["status"] == "SUCCESS":
        return 0
    error = task.get("error") or {}
    reason = f": {error.get('code')}: {error.get('message')}" if error else ""
    _stderr().print(f"kiln: task {task['id']} ended {task['status']}{reason}", markup=False)
    return 1
