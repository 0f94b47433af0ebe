"""The Store written once over SQL; SQLite and PostgreSQL are thin drivers below it.

Every operation is an ``async`` function of a :class:`~kiln.store.tx.Tx` (one
transaction) that reads and writes through the named queries of
:mod:`kiln.store.queries`; a driver runs it (see :mod:`kiln.store.tx`). The task
lifecycle is here, and claims in ``claims.py``; each other concern is an object of its
own module that :class:`Store` holds (``store.schedules``, ``store.outbox``, ...).

What differs lives in the drivers (``sqlite.py``, ``postgres.py``): threads, group commit
and migrations; the pool, reconnects, LISTEN/NOTIFY, the gap-safe tail, the claim lock and
the one-statement paths of PostgreSQL; how event rows and counter deltas are written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kiln import counters as names
from kiln.errors import (
    Conflict,
    IdempotencyKeyReused,
    LeaseLost,
    NotFound,
    NotLeader,
    StaleDecision,
)
from kiln.models import NewTask, SubmitResult, Task, TaskEvent, TraceContext
from kiln.pipelines import KIND as PIPELINE
from kiln.states import ENDED_UNSUCCESSFULLY, FINAL, Event, Status
from kiln.store import pipelines
from kiln.store.bulk import Bulk
from kiln.store.claims import ClaimOps, ClaimPolicy
from kiln.store.effects import effects_of
from kiln.store.inputs import Inputs, Keys
from kiln.store.load import Load
from kiln.store.outbox import Outbox
from kiln.store.pools import Limits, Pools
from kiln.store.preempt import PreemptOps
from kiln.store.queries import Queries
from kiln.store.records import Applied, Change, Clock, Due, LeaderToken, Progress, Stats
from kiln.store.rows import (
    JSON_COLUMNS,
    TASK_COLUMNS,
    classify_due,
    dumps,
    dwell_percentiles,
    event_from_row,
    input_rows,
    insert_args,
    insert_parts,
    task_from_row,
)
from kiln.store.schedules import Schedules
from kiln.store.tx import EventRow, IntegrityViolation, Op, Ops, Refused, Row, Tx, UniqueViolation
from kiln.store.usage import Usage
from kiln.store.workers import Workers

log = logging.getLogger("kiln.store")

T = TypeVar("T")

#: The steps of pipelines a purge selected, locked in id order: ([pipeline ids]).
LOCK_PIPELINE_STEPS = "SELECT * FROM tasks WHERE pipeline_id {IN_LIST} ORDER BY id {FOR_UPDATE}"
#: Transitions read for the dwell percentiles of ``stats``.
DWELL_WINDOW = 10_000


#: The queries a purge runs, in order: the rows that hang off the tasks, then the tasks.
PURGE_QUERIES = (
    "purge_events",
    "purge_keys",
    "purge_deliveries",
    "drop_task_inputs",
    "purge_traces",
    "purge_tasks",
)


def event_rows(
    change: Change, task: Task, version: int, dwell: float, now: float
) -> list[EventRow]:
    """The event rows of ``change``'s steps, numbered on from the row's ``version``: the
    first step leaves the status the row held for ``dwell`` seconds, each next one leaves
    a status it held for none (the change's effects may amend them)."""
    rows: list[EventRow] = []
    source: Status = change.expect_status
    for offset, (event, target) in enumerate(change.steps, start=1):
        rows.append(
            EventRow(
                task=task,
                version=version + offset,
                event=event,
                source=source,
                target=target,
                error=change.error,
                at=now,
                dwell_s=dwell,
                final=offset == len(change.steps) and target in FINAL,
            )
        )
        source, dwell = target, 0.0
    return rows


#: A column a change sets: ``(column, value, added)``; ``added``: ``column + value``.
Set = tuple[str, Any, bool]


def update_sets(change: Change, target: Status, now: float) -> list[Set]:
    """What the UPDATE of a change whose row is locked and checked sets, in order: one
    description for the row path (:func:`update_sql`) and PostgreSQL's one-statement path
    (:mod:`kiln.store.pgstep`)."""
    sets: list[Set] = [
        ("status", str(target), False),
        ("version", len(change.steps), True),
        ("updated_at", now, False),
        ("status_since", now, False),
    ]
    if change.fence.bump:
        sets.append(("epoch", 1, True))
    if target in FINAL and "finished_at" not in change.fields:
        sets.append(("finished_at", now, False))
    for column, value in change.fields.items():
        if column not in TASK_COLUMNS:
            raise ValueError(f"unknown task column {column!r}")
        sets.append((column, dumps(value) if column in JSON_COLUMNS else value, False))
    return sets


#: Each column's clause in an UPDATE: set to a value, or a value added to it.
_SET = {column: f"{column} = ?" for column in TASK_COLUMNS}
_ADD = {column: f"{column} = {column} + ?" for column in TASK_COLUMNS}


def update_sql(change: Change, target: Status, now: float) -> tuple[str, list[Any]]:
    """The UPDATE of a change whose row is locked and checked (``?`` placeholders)."""
    clauses: list[str] = []
    args: list[Any] = []
    for column, value, added in update_sets(change, target, now):
        clauses.append(_ADD[column] if added else _SET[column])
        args.append(value)
    args.append(change.task_id)
    return f"UPDATE tasks SET {', '.join(clauses)} WHERE id = ? RETURNING *", args


def refusal(tx: Tx, change: Change, current: Row | None) -> Refused | None:
    """Why ``change`` may not apply to the row as read, or None."""
    if current is None:
        return Refused(NotFound(f"task {change.task_id} does not exist"))
    status, epoch = current[0], current[1]
    if status == change.expect_status and (
        change.expect_epoch is None or epoch == change.expect_epoch
    ):
        if current[6] and change.steps[-1][0] is Event.SCHEDULE_RETRY:
            # The retry was planned on a read from before a cancel was asked (the engine
            # plans none for a task whose cancel is asked): not now.
            return Refused(StaleDecision(f"task {change.task_id}: a cancel was asked since"))
        if not current[6] and change.steps[0][0] is Event.FORCE_CANCEL:
            # Forced on a read from when a cancel was asked, taken back since (a retry of
            # its pipeline): the attempt goes on.
            return Refused(StaleDecision(f"task {change.task_id}: its cancel was taken back"))
        return None
    if change.fence.fenced:
        tx.bump(names.STALE_WRITES)
        return Refused(LeaseLost(f"task {change.task_id} moved on (now {status}, epoch {epoch})"))
    return Refused(Conflict(f"task {change.task_id} is {status}, not {change.expect_status}"))


class TaskOps(Ops):
    """The task lifecycle over a driver: submit, claim, apply, leases, reads, supervisor."""

    # submission

    async def submit(self, new: NewTask) -> SubmitResult:
        prepared = insert_parts(new)  # before the transaction: it depends on no row
        return await self._write(lambda tx: self._submit(tx, new, prepared))

    async def _submit(
        self, tx: Tx, new: NewTask, prepared: Sequence[Any] | None = None
    ) -> SubmitResult | Refused:
        now = self.clock()
        if new.idempotency_key is not None:
            key_args = (new.tenant, new.idempotency_key, new.fingerprint, new.id, now)
            if await tx.one(self.q.claim_key, key_args) is None:  # the key exists
                replay = await self._replay(tx, new, now)
                if replay is not None:
                    return replay
        for _ in range(8):
            if new.dedup_key is not None:
                row = await tx.one(self.q.dedup_lookup, (new.tenant, new.dedup_key))
                if row is not None:
                    existing = task_from_row(row)
                    await self._point_key(tx, new, existing.id, now)
                    tx.bump(names.DEDUP_HITS, "content")
                    return SubmitResult(existing, created=False, deduplicated=True)
            task = await self._insert(tx, new, now, prepared)
            if task is not None:
                return SubmitResult(task, created=True)
            # Another transaction inserted the same content meanwhile: answer with it.
        raise Conflict("the same content was submitted and ended repeatedly; try again")

    async def _replay(self, tx: Tx, new: NewTask, now: float) -> SubmitResult | Refused | None:
        row = await tx.one(self.q.read_key, (new.tenant, new.idempotency_key))
        assert row is not None
        if row[0] != new.fingerprint and row[0] not in new.older_fingerprints:
            return Refused(
                IdempotencyKeyReused("this Idempotency-Key was used with a different request body")
            )
        found = await tx.one(self.q.get_task, (row[1],))
        if found is not None:
            tx.bump(names.DEDUP_HITS, "idempotency")
            return SubmitResult(task_from_row(found), created=False, replayed=True)
        await self._point_key(tx, new, new.id, now)  # its task is gone: the key is free
        return None

    async def _point_key(self, tx: Tx, new: NewTask, task_id: str, now: float) -> None:
        if new.idempotency_key is not None:
            args = (new.fingerprint, task_id, now, new.tenant, new.idempotency_key)
            await tx.run(self.q.point_key, args)

    async def _insert(
        self, tx: Tx, new: NewTask, now: float, prepared: Sequence[Any] | None = None
    ) -> Task | None:
        row = await self._insert_row(tx, insert_args(new, now, prepared))
        if row is None:
            return None
        task = task_from_row(row)
        await tx.insert_events(
            [EventRow(task, 1, Event.SUBMIT, None, Status.PENDING, None, now, None)]
        )
        if new.inputs:
            await tx.many(self.q.add_task_input, input_rows(new))
        if new.trace is not None:  # only when tracing is on: no statement otherwise
            trace = (task.id, new.trace.traceparent, new.trace.tracestate)
            await tx.run(self.q.insert_trace, trace)
        tx.count_status(new.tenant, Status.PENDING, 1)
        await tx.notify_ready()
        return task

    async def _insert_row(self, tx: Tx, args: list[Any]) -> Row | None:
        """The new task's row (None: its content is taken); SQLite builds it instead."""
        return await tx.one(self.q.insert_task, args)

    # reads

    async def get(self, task_id: str) -> Task | None:
        found = await self._rows(self.q.get_task, (task_id,), task_from_row)
        return found[0] if found else None

    async def get_many(self, task_ids: Sequence[str]) -> dict[str, Task]:
        """The tasks of ``task_ids`` that exist, by id, read in one query (the reconciler
        looks up the tasks of a page of objects at once)."""

        ids = sorted(set(task_ids))

        if not ids:
            return {}
        return {t.id: t for t in await self._rows(self.q.get_tasks, (ids,), task_from_row)}

    async def list_tasks(
        self,
        *,
        tenant: str | None,
        status: Status | None = None,
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Task], str | None]:
        where: list[str] = []
        args: list[Any] = []
        for column, value in (("tenant", tenant), ("status", status), ("kind", kind)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(str(value))
        if cursor is not None:
            where.append("id < ?")
            args.append(cursor)
        sql = "SELECT * FROM tasks"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql = self.q.sql(sql + " ORDER BY id DESC LIMIT ?")
        args.append(limit + 1)

        tasks = await self._rows(sql, args, task_from_row)
        next_cursor = tasks[limit - 1].id if len(tasks) > limit else None
        return tasks[:limit], next_cursor

    async def events(
        self,
        *,
        task_id: str | None = None,
        tenant: str | None = None,
        after: int = 0,
        limit: int = 500,
    ) -> list[TaskEvent]:
        args: tuple[Any, ...]
        if task_id is not None:
            sql, args = self.q.events_of_task, (task_id, after, limit)
        elif tenant is not None:
            sql, args = self.q.events_of_tenant, (tenant, after, limit)
        else:
            sql, args = self.q.events_after, (after, limit)

        return await self._rows(sql, args, event_from_row)

    async def trace(self, task_id: str) -> TraceContext | None:
        """The trace context ``task_id`` was submitted in (None: none was stored)."""
        found = await self._rows(self.q.get_trace, (task_id,), tuple)
        return TraceContext(found[0][0], found[0][1]) if found else None

    async def last_seq(self) -> int:
        """Where a tail of the log may start (see ``tail``)."""

        return await self._count(self.q.last_seq)

    async def progressed(self, *, since: float, limit: int = 500) -> list[Task]:
        return await self._rows(self.q.progressed, (since, limit), task_from_row)

    # worker writes

    async def heartbeat(
        self, task_id: str, epoch: int, lease_ttl_s: float, progress: Progress | None
    ) -> Task:
        now = self.clock()
        args: tuple[Any, ...]
        if progress is None:
            sql, args = self.q.heartbeat, (now + lease_ttl_s, now, task_id, epoch)
        else:
            sql = self.q.heartbeat_progress
            shown = (progress.stage, progress.step, progress.total)
            args = (now + lease_ttl_s, now, *shown, now, task_id, epoch)

        async def write(tx: Tx) -> Task | Refused:
            row = await tx.one(sql, args)
            if row is None:
                tx.bump(names.STALE_WRITES)
                return Refused(LeaseLost(f"task {task_id} is no longer held at epoch {epoch}"))
            tx.bump(names.LEASE_RENEWALS)
            return task_from_row(row)

        return await self._write(write)

    async def request_cancel(self, task_id: str) -> Task:
        now = self.clock()

        async def write(tx: Tx) -> Task | Refused:
            row = await tx.one(self.q.request_cancel, (now, now, task_id))
            if row is None:
                return Refused(Conflict(f"task {task_id} is not running"))
            return task_from_row(row)

        return await self._write(write)

    # the fenced compare-and-set

    async def apply(self, change: Change) -> tuple[Task, list[TaskEvent]]:
        try:
            return await self._apply_change(change)
        except IntegrityViolation as exc:
            # The change rolled back as a whole: never a status without its event (I6).
            raise Conflict(f"task {change.task_id} changed concurrently: {exc}") from None

    async def _apply_change(self, change: Change) -> tuple[Task, list[TaskEvent]]:
        return await self._write(lambda tx: self._apply(tx, change))

    async def _apply(self, tx: Tx, change: Change) -> tuple[Task, list[TaskEvent]] | Refused:
        now = self.clock()
        leader = change.fence.leader
        if leader is not None and not await self._holds(tx, leader, now):
            return Refused(NotLeader(f"{leader.owner} no longer leads"))
        effects = effects_of(change)
        for effect in effects:
            await effect.lock(self, tx, change)
        current = await tx.one(self.q.lock_task, (change.task_id,))
        refused = refusal(tx, change, current)
        if refused is not None:
            return refused
        assert current is not None
        target = change.target
        sql, args = update_sql(change, target, now)
        if change.expect_status in ENDED_UNSUCCESSFULLY and target not in ENDED_UNSUCCESSFULLY:
            row = await self._revive(tx, self.q.sql(sql), args)
        else:
            row = await tx.one(self.q.sql(sql), args)
        assert row is not None
        task = task_from_row(row)
        dwell: float = now - current[3]
        applied = Applied(change, task, current[5], current[1], dwell, now)
        rows = event_rows(change, task, current[2], dwell, now)
        for effect in effects:
            await effect.before_events(self, tx, applied)
            effect.amend(rows)
        for step in rows:
            tx.bump(names.TRANSITIONS, f"{step.source}>{step.target}")
        events = await tx.insert_events(rows)
        tx.count_status(task.tenant, change.expect_status, -1)
        tx.count_status(task.tenant, target, 1)
        for effect in effects:
            await effect.after(self, tx, applied)
        return task, events

    # pipelines (kiln.store.pipelines)

    async def submit_pipeline(self, new: NewTask) -> SubmitResult:
        """Insert-or-get a pipeline; a new one is GENERATING with its first steps."""
        return await self._write(lambda tx: pipelines.submit(self, tx, new))

    async def cancel_pipeline(self, pipeline_id: str) -> Task:
        """Cancel a running pipeline and its waiting steps; ask its running ones to stop."""
        return await self._write(lambda tx: pipelines.cancel(self, tx, pipeline_id))

    async def retry_pipeline(self, pipeline_id: str, fields: dict[str, Any]) -> Task:
        """Run a final FAILED, TIMEOUT or CANCELLED pipeline's unfinished steps again."""
        return await self._write(lambda tx: pipelines.retry(self, tx, pipeline_id, fields))

    async def pipeline_steps(self, pipeline: Task) -> dict[str, Task]:
        """A pipeline's steps made so far, by ``name/copy``."""
        return await self._read(lambda tx: pipelines.steps_of(self, tx, pipeline))

    @staticmethod
    async def _revive(tx: Tx, sql: str, args: list[Any]) -> Row | None:
        """A task leaving FAILED/TIMEOUT/CANCELLED re-enters the dedup index: when another
        live task holds its content by now, it gives up its dedup key (I5)."""
        try:
            async with tx.savepoint():
                return await tx.one(sql, args)
        except UniqueViolation:
            return await tx.one(sql.replace(" WHERE id", ", dedup_key = NULL WHERE id"), args)

    # supervisor

    async def due(self, *, limit: int, cancel_grace_s: float) -> Due:
        now = self.clock()

        async def read(tx: Tx) -> Due:
            cancels = await tx.all(self.q.due_cancel, (now - cancel_grace_s, limit))
            due = Due([], [], [], [task_from_row(row) for row in cancels])
            for row in await tx.all(self.q.due, (now, limit)):
                classify_due(task_from_row(row), now, due)
            return due

        return await self._read(read)

    async def count_ghosts(self, *, older_than_s: float) -> int:
        before = self.clock() - older_than_s
        return await self._count(self.q.ghosts, (before, before))

    async def lead(self, name: str, owner: str, ttl_s: float) -> LeaderToken | None:
        now = self.clock()

        async def write(tx: Tx) -> LeaderToken | None:
            row = await tx.one(self.q.lead, (name, owner, now + ttl_s, now, now))
            return None if row is None else LeaderToken(name, owner, row[0], row[1])

        return await self._write(write)

    async def _holds(self, tx: Tx, token: LeaderToken, now: float) -> bool:
        args = (token.name, token.owner, token.epoch, now)
        return await tx.one(self.q.holds, args) is not None

    # stats and counters

    async def stats(self, *, tenant: str | None, ghost_after_s: float) -> Stats:
        now = self.clock()
        return await self._read(lambda tx: self._stats(tx, tenant, now, now - ghost_after_s))

    async def _stats(self, tx: Tx, tenant: str | None, now: float, ghost_before: float) -> Stats:
        q = self.q
        counts = {str(s): 0 for s in Status}
        rows = await (
            tx.all(q.status_counts)
            if tenant is None
            else tx.all(q.status_counts_of_tenant, (tenant,))
        )
        for status, n in rows:
            counts[status] = int(n)
        failures = await self._counted(tx, names.FAILURES, "", tenant, parts=2)
        dwell = dwell_percentiles(
            await tx.all(q.dwell, (DWELL_WINDOW,))
            if tenant is None
            else await tx.all(q.dwell_of_tenant, (tenant, DWELL_WINDOW))
        )
        ghost_row = await (
            tx.one(q.ghosts, (ghost_before, ghost_before))
            if tenant is None
            else tx.one(q.ghosts_of_tenant, (ghost_before, ghost_before, tenant))
        )
        oldest = await tx.one(q.oldest_ready)
        since = f"{int(now // 60) - 59:010d}:"
        return Stats(
            counts,
            failures,
            dwell,
            int(ghost_row[0]) if ghost_row else 0,
            None if oldest is None else oldest[0],
            await self._counted(tx, names.FAILURES_BY_MINUTE, since, tenant, parts=3),
        )

    async def _counted(
        self, tx: Tx, name: str, since: str, tenant: str | None, *, parts: int
    ) -> dict[str, int]:
        """A ``[minute:]tenant:code`` counter summed by code, for one tenant or all."""
        found: dict[str, int] = {}
        for labels, n in await tx.all(self.q.counter_rows, (name, since)):
            *_, row_tenant, code = str(labels).split(":", parts - 1)
            if tenant is None or row_tenant == tenant:
                found[code] = found.get(code, 0) + int(n)
        return found

    async def counters(self) -> dict[tuple[str, str], int]:
        rows = await self._rows(self.q.all_counters, (), tuple)
        return {(name, labels): int(n) for name, labels, n in rows}

    async def bump(self, name: str, labels: str = "", delta: int = 1) -> None:
        async def write(tx: Tx) -> None:
            tx.bump(name, labels, delta)

        await self._write(write)

    # retention

    async def purge(
        self,
        *,
        finished_before: float,
        tenant: str | None = None,
        exclude: Sequence[str] = (),
        limit: int = 500,
    ) -> list[Task]:
        """Delete up to ``limit`` final tasks that finished before ``finished_before`` (of
        ``tenant``, or of every tenant but ``exclude``), oldest first, with their events and
        idempotency keys, in one transaction; return them (their objects are the caller's)."""

        sql, args = purge_candidates(finished_before, tenant, exclude, limit)
        sql = self.q.sql(sql + " {SKIP_LOCKED}")  # a manual retry in flight keeps its task

        async def write(tx: Tx) -> list[Task]:
            tasks = [task_from_row(row) for row in await tx.all(sql, args)]
            if not tasks:
                return []
            pipelines_ = [task.id for task in tasks if task.kind == PIPELINE]
            if pipelines_:  # a pipeline goes with its steps, never a step alone
                tasks = await self._with_steps(tx, tasks, pipelines_)
            ids = [task.id for task in tasks]
            if not ids:
                return []
            for query in PURGE_QUERIES:
                await tx.run(getattr(self.q, query), (ids,))
            for task in tasks:
                tx.count_status(task.tenant, task.status, -1)
            tx.bump(names.PURGED, "", len(tasks))
            return tasks

        return await self._write(write)

    async def _with_steps(self, tx: Tx, tasks: list[Task], pipeline_ids: list[str]) -> list[Task]:
        """``tasks`` with the steps of its pipelines, read locked (the pipelines' rows are
        locked already: the one lock order), less each pipeline that has a step not final
        (still running, or retried by a user meanwhile): it is kept, with its steps, for a
        later purge."""
        rows = await tx.all(
            self.q.sql(LOCK_PIPELINE_STEPS), (pipelines.id_list(self.q, pipeline_ids),)
        )
        steps = [task_from_row(row) for row in rows]
        live = {step.pipeline_id for step in steps if step.status not in FINAL}
        return [t for t in tasks if t.id not in live] + [
            step for step in steps if step.pipeline_id not in live
        ]


def purge_candidates(
    finished_before: float, tenant: str | None, exclude: Sequence[str], limit: int
) -> tuple[str, list[Any]]:
    """The oldest final tasks a purge may delete (``?`` placeholders); reads through the
    ``tasks_finished`` index."""
    # A step is kept while its pipeline is (a later step may read its outputs by key).
    sql = "SELECT * FROM tasks WHERE status IN {FINAL} AND finished_at < ? AND pipeline_id IS NULL"
    args: list[Any] = [finished_before]
    if tenant is not None:
        sql += " AND tenant = ?"
        args.append(tenant)
    if exclude:
        sql += f" AND tenant NOT IN ({', '.join('?' * len(exclude))})"
        args += list(exclude)
    sql += " ORDER BY finished_at LIMIT ?"
    args.append(limit)
    return sql, args


class Store(TaskOps, ClaimOps, PreemptOps):
    """A durable home for tasks, their event log, idempotency records and leaders.

    The task lifecycle and its claims are the store's own methods; every other concern is
    an object of its own on the store, written once over the same driver: ``schedules``,
    ``outbox``, ``inputs``, ``keys``, ``workers``, ``load``, ``pools``, ``limits``,
    ``usage``, ``bulk`` (docs/design.md, "The store written once").

    :class:`~kiln.store.sqlite.SqliteStore` and :class:`~kiln.store.postgres.PostgresStore`
    say how an operation runs (``_write``, ``_read``, ``_write_many``), how the log is
    followed (``_log_after``), what follows a bulk action's page (``_after_bulk_page``)
    and ``close``.
    """

    #: Whether events become visible in seq order (one writer at a time: SQLite). Without
    #: it a seq can show after a higher one (PostgreSQL): only a gap-safe read of the log
    #: (``_log_after``) may pass events unseen.
    commits_in_seq_order = True

    def __init__(self, queries: Queries, clock: Clock) -> None:
        self.q = queries
        self.clock = clock
        self._claim_turn = 0
        self._tail_gaps: dict[int, int] = {}
        self.schedules = Schedules(self)
        self.outbox = Outbox(self)
        self.inputs = Inputs(self)
        self.keys = Keys(self)
        self.workers = Workers(self)
        self.load = Load(self)
        self.pools = Pools(self)
        self.limits = Limits(self)
        self.usage = Usage(self)
        self.bulk = Bulk(self)

    async def submit(
        self, new: NewTask, *, place: bool = False, policy: ClaimPolicy | None = None
    ) -> SubmitResult:
        """Insert-or-get a submission's task; ``place``: with its queue position under
        ``policy`` read in the same transaction (``SubmitResult.placed``)."""
        if not place:
            return await super().submit(new)
        return await self._write(self._submit_op(new, insert_parts(new), place, policy))

    def _submit_op(
        self,
        new: NewTask,
        prepared: Sequence[Any],
        place: bool,
        policy: ClaimPolicy | None,
    ) -> Op[SubmitResult | Refused]:
        """The operation of :meth:`submit` (``prepared``: :func:`insert_parts` of ``new``)."""
        if place:
            return lambda tx: self._placed(tx, self._submit(tx, new, prepared), policy)
        return lambda tx: self._submit(tx, new, prepared)

    async def _write_many(self, ops: Sequence[Op[T]]) -> list[T | Exception]:
        """Run several operations in one call, each its own unit: one that refuses or
        breaks a constraint comes back as its error, the others commit."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def _log_after(self, after: int, limit: int, gaps: dict[int, int]) -> list[TaskEvent]:
        """Events after ``after`` such that no event with a smaller seq can still appear;
        ``gaps`` is the follower's memory of gaps (drivers that commit in seq order have
        none)."""
        return await self.events(after=after, limit=limit)

    async def tail(self, *, after: int, limit: int = 1000) -> list[TaskEvent]:
        """Events after ``after`` in seq order, such that no event with a smaller seq can
        still appear: what a follower of the whole log reads (one per process)."""

        return await self._log_after(after, limit, self._tail_gaps)

    async def _after_bulk_page(self, took_s: float) -> None:
        """What follows a bulk action's page that took ``took_s`` (:mod:`kiln.store.bulk`):
        nothing, unless the driver says otherwise."""

    def watch_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when another process made work claimable. Backends without
        a notification channel do nothing: their workers find such work by polling."""

    async def apply_many(
        self, changes: Sequence[Change]
    ) -> list[tuple[Task, list[TaskEvent]] | Exception]:
        """Apply several tasks' changes in one call, each its own compare-and-set: a
        refused change rolls back alone and comes back as its error, the others commit
        (I11)."""

        def op(change: Change) -> Op[tuple[Task, list[TaskEvent]]]:
            return lambda tx: self._apply(tx, change)

        done = await self._write_many([op(change) for change in changes])
        return [
            Conflict(f"task {change.task_id} changed concurrently: {result}")
            if isinstance(result, IntegrityViolation)
            else result
            for change, result in zip(changes, done, strict=True)
        ]
