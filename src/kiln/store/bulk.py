"""Bulk actions' pages: select the tasks a filter names after a key, act on each, one
transaction a page.

A page is selected by keyset on the task id, oldest first: ids are time-ordered (the
creating process's clock, then a counter: :func:`kiln.canonical.new_id`), so this is
creation order, and the primary key's index can walk it from the cursor (no index added
to the submit path for it). The next page resumes after the last id of this one, whatever
changed meanwhile. In the same transaction each selected task gets what the policy above
(:mod:`kiln.bulk_actions`) plans for it: a :class:`~kiln.store.records.Change` (the very
compare-and-set with its event rows that a single action makes, in a savepoint of its
own), :data:`ASK_TO_STOP` (a running task's ``cancel_requested``), or for a pipeline
:data:`CANCEL_PIPELINE` / :data:`RETRY_PIPELINE` (what ``POST /v1/tasks/{id}/cancel`` or
``/retry`` does to one: :mod:`kiln.store.pipelines`, its steps with it). A task that
changed between the select and its own compare-and-set, or is gone (a pipeline purged
meanwhile: its action raises NotFound in its savepoint), is refused alone and counted as
skipped; the others commit.

A page is cut by the rows it changes, not only by its ``limit``: once its transaction has
changed ``rows`` rows (task rows and their event rows, steps created, running tasks asked
to stop: every row an INSERT, UPDATE or DELETE wrote, :class:`RowCount`), it takes no
further task, and its cursor is the last task it took. The task that reached the budget is
finished in the same transaction with everything its action moves, so a pipeline is never
split between pages (at most 200 steps and itself: a page writes at most ``rows`` plus
one pipeline's rows). Short transactions leave the writer to everyone else between pages:
other tenants' submissions, workers' lease renewals.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from kiln.errors import Conflict
from kiln.models import Task, TaskEvent
from kiln.states import ENDED_UNSUCCESSFULLY, Status
from kiln.store import pipelines
from kiln.store.records import Change
from kiln.store.rows import task_from_row
from kiln.store.tx import Args, Concern, EventRow, Op, Refused, Row, Tally, Tx, alone

#: What the policy plans for a running task that a cancel names: ask its worker to stop.
ASK_TO_STOP: Literal["ask_to_stop"] = "ask_to_stop"
#: What it plans for a pipeline (kiln.store.pipelines): cancel it with its steps, or run
#: the steps that did not succeed again.
CANCEL_PIPELINE: Literal["cancel_pipeline"] = "cancel_pipeline"
RETRY_PIPELINE: Literal["retry_pipeline"] = "retry_pipeline"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepRetry:
    """A retry of a pipeline's step: with its pipeline when that one ended (what
    ``POST /v1/tasks/{step}/retry`` does), else the step's own ``change``."""

    change: Change


Plan = Change | StepRetry | Literal["ask_to_stop", "cancel_pipeline", "retry_pipeline"] | None


@dataclass(frozen=True, slots=True)
class BulkFilter:
    """Which tasks a bulk action names. ``statuses`` is never empty (the policy fills in
    the statuses its action applies to); the other fields narrow when given."""

    statuses: tuple[Status, ...]
    kinds: tuple[str, ...] = ()
    codes: tuple[str, ...] = ()
    tenant: str | None = None
    created_after: float | None = None
    created_before: float | None = None
    #: Leave out tasks whose cancel was asked already (a cancel would not change them).
    not_cancel_requested: bool = False


@dataclass(slots=True)
class BulkPage:
    """What one page did: the tasks it took, those changed, those asked to stop, those
    that had changed first (skipped), the event rows written, the rows its transaction
    changed, and the id it ended at (None: no task after it matched when it was read)."""

    matched: int = 0
    rows: int = 0
    changed: list[Task] = field(default_factory=list)
    asked: list[Task] = field(default_factory=list)
    skipped: int = 0
    events: list[TaskEvent] = field(default_factory=list)
    last: str | None = None


def _code_of(dialect: str) -> str:
    if dialect == "postgres":
        return "(error::jsonb->>'code')"
    return "json_extract(error, '$.code')"


def where_of(dialect: str, found: BulkFilter, after: str | None) -> tuple[str, list[Any]]:
    """The WHERE clause (``?`` parameters) of ``found`` after the task id ``after``."""
    clauses = ["status {IN_LIST}"]
    args: list[Any] = [[str(s) for s in found.statuses]]
    for column, values in (("kind", found.kinds), (_code_of(dialect), found.codes)):
        if values:
            clauses.append(f"{column} {{IN_LIST}}")
            args.append(list(values))
    if found.tenant is not None:
        clauses.append("tenant = ?")
        args.append(found.tenant)
    if found.created_after is not None:
        clauses.append("created_at >= ?")
        args.append(found.created_after)
    if found.created_before is not None:
        clauses.append("created_at < ?")
        args.append(found.created_before)
    if found.not_cancel_requested:
        clauses.append("cancel_requested = {FALSE}")
    if after is not None:
        clauses.append("id > ?")
        args.append(after)
    if dialect == "sqlite":  # json_each takes the list as JSON text
        args = [json.dumps(a) if isinstance(a, list) else a for a in args]
    return " AND ".join(clauses), args


_WRITES = ("INSERT", "UPDATE", "DELETE")


def _writes(sql: str) -> bool:
    return sql.lstrip()[:6].upper() in _WRITES


class RowCount:
    """A transaction that counts the rows its statements change (what a page's budget
    measures); everything else is the driver's transaction underneath."""

    __slots__ = ("rows", "tx")

    def __init__(self, tx: Tx) -> None:
        self.tx = tx
        self.rows = 0

    @property
    def tally(self) -> Tally:
        return self.tx.tally

    @tally.setter
    def tally(self, value: Tally) -> None:
        self.tx.tally = value

    async def one(self, sql: str, args: Args = ()) -> Row | None:
        row = await self.tx.one(sql, args)
        if row is not None and _writes(sql):
            self.rows += 1
        return row

    async def all(self, sql: str, args: Args = ()) -> list[Row]:
        rows = await self.tx.all(sql, args)
        if _writes(sql):
            self.rows += len(rows)
        return rows

    async def run(self, sql: str, args: Args = ()) -> int:
        changed = await self.tx.run(sql, args)
        self.rows += max(changed, 0) if _writes(sql) else 0
        return changed

    async def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        changed = await self.tx.many(sql, rows)
        self.rows += max(changed, 0) if _writes(sql) else 0
        return changed

    def savepoint(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.tx.savepoint()

    async def insert_events(self, rows: Sequence[EventRow]) -> list[TaskEvent]:
        self.rows += len(rows)
        return await self.tx.insert_events(rows)

    async def lock_tenant(self, tenant: str) -> bool:
        return await self.tx.lock_tenant(tenant)

    async def notify_ready(self) -> None:
        await self.tx.notify_ready()

    def count_status(self, tenant: str, status: Status, delta: int) -> None:
        self.tx.count_status(tenant, status, delta)

    def bump(self, name: str, labels: str = "", delta: int = 1) -> None:
        self.tx.bump(name, labels, delta)


class Host(pipelines.Host, Protocol):
    """What bulk actions need of the store: the single action's compare-and-set
    (``TaskOps._apply``), a pipeline's cancel and retry (:mod:`kiln.store.pipelines`), and
    what its driver does once a page committed (``_after_bulk_page``)."""

    async def _write(self, op: Op[T]) -> T: ...

    async def _read(self, op: Callable[[Tx], Awaitable[T]]) -> T: ...

    async def _after_bulk_page(self, took_s: float) -> None:
        """Called after each page, with the seconds it took (SQLite pauses as long)."""
        ...


class Bulk(Concern[Host]):
    """Bulk actions' counts and pages (``store.bulk``)."""

    async def count(self, found: BulkFilter, after: str | None = None) -> int:
        """How many tasks ``found`` names after ``after``: what a dry run answers."""
        where, args = where_of(self.q.dialect, found, after)
        return await self._count(self.q.sql(f"SELECT count(*) FROM tasks WHERE {where}"), args)

    async def page(
        self,
        found: BulkFilter,
        after: str | None,
        limit: int,
        plan: Callable[[Task], Plan],
        rows: int,
    ) -> BulkPage:
        """Select up to ``limit`` tasks ``found`` names after ``after`` and act on each as
        ``plan`` says, all in one transaction (each task in a savepoint of its own), until
        the transaction has changed ``rows`` rows: the tasks after that one are the next
        page's."""
        where, args = where_of(self.q.dialect, found, after)
        sql = self.q.sql(f"SELECT * FROM tasks WHERE {where} ORDER BY id LIMIT ?")

        async def write(tx: Tx) -> BulkPage:
            page = BulkPage()
            selected = await tx.all(sql, [*args, limit + 1])
            tasks = [task_from_row(row) for row in selected[:limit]]
            counted = RowCount(tx)
            for task in tasks:
                if counted.rows >= rows:  # the budget is spent: the rest is the next page's
                    break
                await self._act(counted, page, task, plan(task))
                page.matched += 1
                page.last = task.id
            page.rows = counted.rows
            if page.matched == len(selected):  # took every task that matched: none after
                page.last = None
            return page

        started = time.monotonic()
        done = await self._write(write)
        await self._store._after_bulk_page(time.monotonic() - started)
        return done

    async def _act(self, tx: Tx, page: BulkPage, task: Task, planned: Plan) -> None:
        if planned is None:
            page.skipped += 1
            return
        op: Callable[[Tx], Awaitable[Any]]
        if planned == ASK_TO_STOP:
            op = self._ask_to_stop(task)
        elif isinstance(planned, StepRetry):
            op = self._step_retry(task, planned.change)
        elif not isinstance(planned, Change):  # a pipeline's own action
            op = self._pipeline_op(task, planned)
        else:
            change = planned

            def op(tx: Tx) -> Awaitable[Any]:
                return self._store._apply(tx, change)

        done = await alone(tx, op)
        if isinstance(done, Exception):
            page.skipped += 1
        elif isinstance(done, Task) and planned != ASK_TO_STOP:
            page.changed.append(done)  # a pipeline: its events reach streams by the tail
        elif isinstance(done, Task):
            page.asked.append(done)
        else:
            page.changed.append(done[0])
            page.events.extend(done[1])

    def _pipeline_op(self, task: Task, planned: str) -> Callable[[Tx], Awaitable[Any]]:
        if planned == CANCEL_PIPELINE:
            return lambda tx: pipelines.cancel(self._store, tx, task.id)
        return lambda tx: pipelines.retry(self._store, tx, task.id, {})

    def _step_retry(self, task: Task, change: Change) -> Callable[[Tx], Awaitable[Any]]:
        async def op(tx: Tx) -> Any:
            assert task.pipeline_id is not None
            pipeline = await pipelines._locked(self._store, tx, task.pipeline_id)
            if pipeline.status in ENDED_UNSUCCESSFULLY:  # alone the step would lead nowhere
                return await pipelines.retry(self._store, tx, pipeline.id, {})
            return await self._store._apply(tx, change)

        return op

    def _ask_to_stop(self, task: Task) -> Callable[[Tx], Awaitable[Task | Refused]]:
        now = self.clock()

        async def write(tx: Tx) -> Task | Refused:
            row = await tx.one(self.q.request_cancel, (now, now, task.id))
            if row is None:
                return Refused(Conflict(f"task {task.id} is not running"))
            return task_from_row(row)

        return write
