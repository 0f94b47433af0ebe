"""Row mapping shared by the SQL stores: both keep the same ``tasks`` columns in the same
order, JSON documents as text, and times as seconds since the epoch."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from kiln.models import NewTask, Task, TaskEvent, Timeouts
from kiln.states import FINAL, Event, Status
from kiln.store.records import Due

JSON_COLUMNS = frozenset({"params", "metadata", "inputs", "timeouts", "error", "result", "webhook"})


def loads(raw: str | None) -> Any:
    return None if raw is None else json.loads(raw)


_DECODE = json.JSONDecoder().decode


def _document(raw: str) -> Any:
    """A JSON column that is never NULL: an empty object or list (most tasks' params,
    metadata and inputs) made without the parser, a new one each time (they are mutable)."""
    if raw == "{}":
        return {}
    if raw == "[]":
        return []
    return _DECODE(raw)


#: ``Timeouts`` by the column's text: tasks of a kind share one, and a Timeouts is frozen.
_TIMEOUTS: dict[str, Timeouts] = {}
_TIMEOUTS_KEPT = 256


def _timeouts(raw: str) -> Timeouts:
    found = _TIMEOUTS.get(raw)
    if found is None:
        found = Timeouts(**_DECODE(raw))
        if len(_TIMEOUTS) >= _TIMEOUTS_KEPT:
            _TIMEOUTS.clear()
        _TIMEOUTS[raw] = found
    return found


#: ``json.dumps(value, separators=(",", ":"), sort_keys=True)``, its encoder made once.
_DUMPS = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def dumps(value: Any) -> str | None:
    if value is None:
        return None
    return _DUMPS.encode(value)


#: The tasks table's columns in ``SELECT *`` order, after every migration; rows are read
#: by position, which is checked against the database when a store opens.
TASK_COLUMNS: tuple[str, ...] = (
    "id",
    "tenant",
    "kind",
    "status",
    "priority",
    "ready_at",
    "params",
    "metadata",
    "inputs",
    "fingerprint",
    "idempotency_key",
    "dedup_key",
    "attempt",
    "max_attempts",
    "epoch",
    "version",
    "lease_owner",
    "lease_expires_at",
    "state_deadline_at",
    "deadline_s",
    "deadline_at",
    "timeouts",
    "stage",
    "progress_step",
    "progress_total",
    "progress_at",
    "cancel_requested",
    "cancel_requested_at",
    "next_retry_at",
    "result_prefix",
    "error",
    "result",
    "created_at",
    "updated_at",
    "status_since",
    "started_at",
    "finished_at",
    "due_at",
    "webhook",
    "model",
    "batch_key",
    "yield_requested_at",
    "rerun_of",
    "pipeline_id",
    "step",
    "step_copy",
)
_WEBHOOK = TASK_COLUMNS.index("webhook")
STATUSES = {str(status): status for status in Status}


def task_from_row(row: Sequence[Any]) -> Task:
    """A task from a ``SELECT *`` row, read by position (see TASK_COLUMNS)."""
    return Task(
        id=row[0],
        tenant=row[1],
        kind=row[2],
        status=STATUSES[row[3]],
        priority=row[4],
        ready_at=row[5],
        params=_document(row[6]),
        metadata=_document(row[7]),
        inputs=_document(row[8]),
        fingerprint=row[9],
        idempotency_key=row[10],
        dedup_key=row[11],
        attempt=row[12],
        max_attempts=row[13],
        epoch=row[14],
        version=row[15],
        lease_owner=row[16],
        lease_expires_at=row[17],
        state_deadline_at=row[18],
        deadline_s=row[19],
        deadline_at=row[20],
        timeouts=_timeouts(row[21]),
        stage=row[22],
        progress_step=row[23],
        progress_total=row[24],
        progress_at=row[25],
        cancel_requested=bool(row[26]),
        cancel_requested_at=row[27],
        next_retry_at=row[28],
        result_prefix=row[29],
        error=loads(row[30]),
        result=loads(row[31]),
        created_at=row[32],
        updated_at=row[33],
        status_since=row[34],
        started_at=row[35],
        finished_at=row[36],
        webhook=loads(row[_WEBHOOK]),
        model=row[_WEBHOOK + 1],
        batch_key=row[_WEBHOOK + 2],
        yield_requested_at=row[_WEBHOOK + 3],
        rerun_of=row[_WEBHOOK + 4],
        pipeline_id=row[_WEBHOOK + 5],
        step=row[_WEBHOOK + 6],
        step_copy=row[_WEBHOOK + 7],
    )


def event_from_row(row: Sequence[Any]) -> TaskEvent:
    """An event from a row of (seq, id, task_id, tenant, event, from_status, to_status,
    attempt, epoch, error, at, dwell_s, final, loading_s), as the events queries read them."""
    return TaskEvent(
        seq=row[0],
        id=row[1],
        task_id=row[2],
        tenant=row[3],
        event=Event(row[4]),
        from_status=None if row[5] is None else STATUSES[row[5]],
        status=STATUSES[row[6]],
        attempt=row[7],
        epoch=row[8],
        error=loads(row[9]),
        at=row[10],
        dwell_s=row[11],
        final=bool(row[12]),
        loading_s=row[13],
    )


def dwell_percentiles(rows: Iterable[Sequence[Any]]) -> dict[str, dict[str, float]]:
    by_status: dict[str, list[float]] = {}
    final = {str(status) for status in FINAL}
    for source, dwell_s in rows:
        if source is not None and dwell_s is not None and source not in final:
            by_status.setdefault(source, []).append(dwell_s)
    found = {}
    for status, values in by_status.items():
        values.sort()
        found[status] = {"p50": _percentile(values, 0.5), "p95": _percentile(values, 0.95)}
    return found


def _percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return round(sorted_values[index], 4)


def classify_due(task: Task, now: float, due: Due) -> None:
    """File a task whose due_at passed under its reason: deadline, lease, state timeout."""
    if task.deadline_at < now:
        due.deadline_passed.append(task)
    elif task.lease_expires_at is not None and task.lease_expires_at < now:
        due.lease_expired.append(task)
    elif task.state_deadline_at is not None and task.state_deadline_at < now:
        due.state_expired.append(task)


# What a new task writes ------------------------------------------------------------------


#: The parameter names of the ``insert_task`` query, in order.
INSERT_NAMES: tuple[str, ...] = (
    "id",
    "tenant",
    "kind",
    "priority",
    "ready_at",
    "params",
    "metadata",
    "inputs",
    "fingerprint",
    "idempotency_key",
    "dedup_key",
    "max_attempts",
    "deadline_s",
    "deadline_at",
    "timeouts",
    "created_at",
    "updated_at",
    "status_since",
    "webhook",
    "model",
    "batch_key",
    "rerun_of",
    "pipeline_id",
    "step",
    "step_copy",
)
_READY_AT = INSERT_NAMES.index("ready_at")
_DEADLINE_AT = INSERT_NAMES.index("deadline_at")
_CREATED_AT = INSERT_NAMES.index("created_at")  # then updated_at, status_since


def insert_args(new: NewTask, now: float, prepared: Sequence[Any] | None = None) -> list[Any]:
    """The parameters of the ``insert_task`` query. A delayed task (``run_at``) is ready,
    and its deadline counts, from that moment. ``prepared``: what :func:`insert_parts`
    gave for ``new`` beforehand (a driver makes it before it takes its write lock)."""
    args = insert_parts(new) if prepared is None else list(prepared)
    ready = now if new.run_at is None else max(now, new.run_at)
    args[_READY_AT] = ready
    args[_DEADLINE_AT] = ready + new.deadline_s
    args[_CREATED_AT] = args[_CREATED_AT + 1] = args[_CREATED_AT + 2] = now
    return args


def insert_parts(new: NewTask) -> list[Any]:
    """The parameters of ``insert_task`` that do not depend on the time (its JSON
    documents above all), None in the places of the time's (:func:`insert_args`)."""
    timeouts = {
        "waiting_s": new.timeouts.waiting_s,
        "generating_s": new.timeouts.generating_s,
        "uploading_s": new.timeouts.uploading_s,
    }
    return [
        new.id,
        new.tenant,
        new.kind,
        new.priority,
        None,  # ready_at
        dumps(new.params),
        dumps(new.metadata),
        dumps(new.inputs),
        new.fingerprint,
        new.idempotency_key,
        new.dedup_key,
        new.max_attempts,
        new.deadline_s,
        None,  # deadline_at
        dumps(timeouts),
        None,  # created_at
        None,  # updated_at
        None,  # status_since
        dumps(new.webhook),
        new.model,
        new.batch_key,
        new.rerun_of,
        new.pipeline_id,
        new.step,
        new.step_copy,
    ]


#: How SQLite stores the ``insert_task`` parameters, by the affinity of their columns.
_TEXT, _INTEGER, _REAL = "text", "integer", "real"
_INTEGERS = frozenset({"priority", "max_attempts", "step_copy"})
_REALS = frozenset(
    {"ready_at", "deadline_s", "deadline_at", "created_at", "updated_at", "status_since"}
)
_INSERT_AFFINITY = tuple(
    _INTEGER if name in _INTEGERS else _REAL if name in _REALS else _TEXT for name in INSERT_NAMES
)


#: The places of the ``insert_task`` parameters by their columns' affinity.
_TEXT_AT = tuple(i for i, affinity in enumerate(_INSERT_AFFINITY) if affinity is _TEXT)
_INTEGER_AT = tuple(i for i, affinity in enumerate(_INSERT_AFFINITY) if affinity is _INTEGER)
_REAL_AT = tuple(i for i, affinity in enumerate(_INSERT_AFFINITY) if affinity is _REAL)


def inserted_row(args: Sequence[Any]) -> tuple[Any, ...] | None:
    """The ``SELECT *`` row that ``insert_task`` with ``args`` writes, as SQLite reads it
    back (TASK_COLUMNS order; the columns it does not set hold their defaults), or None
    when a parameter would read back as another value (then the caller reads the row): a
    TEXT column keeps a str, an INTEGER column an int, a REAL column an int or a float as
    a float (not NaN), each of them NULL; anything else SQLite converts its own way."""
    if len(args) != len(_INSERT_AFFINITY):
        raise ValueError(f"insert_task takes {len(_INSERT_AFFINITY)} parameters")
    stored = list(args)
    for i in _TEXT_AT:
        value = stored[i]
        if value is not None and type(value) is not str:
            return None
    for i in _INTEGER_AT:
        value = stored[i]
        if value is not None and type(value) is not int:
            return None
    for i in _REAL_AT:
        value = stored[i]
        if value is None:
            continue
        kind = type(value)
        if (kind is not float and kind is not int) or value != value:
            return None
        stored[i] = float(value)
    (id_, tenant, kind, priority, ready_at, params, metadata, inputs, fingerprint) = stored[:9]
    (idempotency_key, dedup_key, max_attempts, deadline_s, deadline_at, timeouts) = stored[9:15]
    (created_at, updated_at, status_since, webhook, *rest) = stored[15:]
    return (
        *(id_, tenant, kind, "PENDING", priority, ready_at, params, metadata, inputs),
        *(fingerprint, idempotency_key, dedup_key, 0, max_attempts, 0, 1, None, None, None),
        *(deadline_s, deadline_at, timeouts, None, None, None, None, 0, None, None, None),
        *(None, None, created_at, updated_at, status_since, None, None, deadline_at, webhook),
        *(rest[0], rest[1], None, *rest[2:]),
    )


def input_rows(new: NewTask) -> list[tuple[str, str]]:
    """The ``task_inputs`` rows of a new task: its uploaded inputs by sha256 (an input with
    a ``key`` is another task's object, read where it is, not an upload under ``inputs/``)."""
    return sorted(
        {
            (str(item["sha256"]), new.id)
            for item in new.inputs
            if "sha256" in item and "key" not in item
        }
    )
