"""The webhook outbox's records, shared by the SQL stores (policy lives in kiln.webhooks).

The event log is the outbox's source: a dispatcher reads the events after a persisted
cursor, turns those of tasks with a matching webhook into ``webhook_deliveries`` rows (one
per event id, so doing it twice is a no-op) and moves the cursor, in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kiln import counters as names
from kiln.models import Task, TaskEvent
from kiln.store.rows import task_from_row
from kiln.store.tx import Concern, Driver, Tx

T = TypeVar("T")

PENDING = "pending"
DELIVERED = "delivered"
FAILED = "failed"
#: The name of the outbox's row in ``webhook_cursor``.
CURSOR = "events"


@dataclass(frozen=True, slots=True)
class WebhookDelivery:
    """One event of a task to POST to the task's webhook, and how that went so far."""

    event_id: str
    seq: int
    task_id: str
    tenant: str
    event: str
    url: str
    #: The exact JSON body sent on every attempt (the signature covers these bytes).
    payload: str
    #: pending, delivered or failed.
    status: str = PENDING
    attempts: int = 0
    next_attempt_at: float = 0.0
    last_error: str | None = None
    response_status: int | None = None
    created_at: float = 0.0
    updated_at: float = 0.0

    def insert_args(self) -> tuple[Any, ...]:
        """Values for an insert, in the order of ``delivery_from_row``."""
        return (
            self.event_id,
            self.seq,
            self.task_id,
            self.tenant,
            self.event,
            self.url,
            self.payload,
            self.status,
            self.attempts,
            self.next_attempt_at,
            self.last_error,
            self.response_status,
            self.created_at,
            self.updated_at,
        )


@dataclass(frozen=True, slots=True)
class WebhookScan:
    """Events after the outbox cursor: ``read`` of them, up to seq ``last``; ``events``
    holds those whose task has a webhook, each with that task."""

    cursor: int
    last: int
    read: int
    events: list[tuple[TaskEvent, Task]]


@dataclass(frozen=True, slots=True)
class WebhookAttempt:
    """What one delivery attempt came to.

    ``status`` is the row's new status: pending (tried again at ``next_attempt_at``),
    delivered or failed. ``outcome`` labels ``kiln_webhook_deliveries_total``.
    """

    event_id: str
    status: str
    outcome: str
    next_attempt_at: float | None = None
    error: str | None = None
    response_status: int | None = None


def delivery_from_row(row: Sequence[Any]) -> WebhookDelivery:
    return WebhookDelivery(
        event_id=row[0],
        seq=int(row[1]),
        task_id=row[2],
        tenant=row[3],
        event=row[4],
        url=row[5],
        payload=row[6],
        status=row[7],
        attempts=int(row[8]),
        next_attempt_at=float(row[9]),
        last_error=row[10],
        response_status=row[11],
        created_at=float(row[12]),
        updated_at=float(row[13]),
    )


class Host(Driver, Protocol):
    """What the outbox needs of the store: its driver's read of the log past the gaps a
    follower remembers (``Store._log_after``: PostgreSQL's is gap-safe)."""

    async def _log_after(self, after: int, limit: int, gaps: dict[int, int]) -> list[TaskEvent]: ...

    commits_in_seq_order: bool

    async def last_seq(self) -> int: ...


class Outbox(Concern[Host]):
    """The webhook outbox (``store.outbox``): deliveries made from the event log, each
    tried until delivered or failed."""

    def __init__(self, store: Host) -> None:
        super().__init__(store)
        self._gaps: dict[int, int] = {}  # the outbox follows the log on its own

    async def scan(self, *, limit: int) -> WebhookScan:
        """Up to ``limit`` events after the outbox cursor, read like ``tail`` (no event
        with a smaller seq can still appear), with the tasks among them that have a webhook."""

        async def cursor_of(tx: Tx) -> int:
            row = await tx.one(self.q.outbox_cursor, (CURSOR,))
            return 0 if row is None else int(row[0])

        cursor = await self._read(cursor_of)
        if self._store.commits_in_seq_order:
            # The log's end first, then whether any task has a webhook: every event up to
            # that end was committed before the second read, so with no task hooked none
            # of them is a hooked task's, and the cursor passes them unread.
            end = await self._store.last_seq()
            if end > cursor and not await self._count(self.q.any_hooked_task):
                return WebhookScan(cursor, end, 0, [])
        events = await self._store._log_after(cursor, limit, self._gaps)
        ids = sorted({e.task_id for e in events})

        async def hooked_tasks(tx: Tx) -> dict[str, Task]:
            return {r[0]: task_from_row(r) for r in await tx.all(self.q.hooked_tasks, (ids,))}

        hooked = await self._read(hooked_tasks) if ids else {}
        last = events[-1].seq if events else cursor
        found = [(e, hooked[e.task_id]) for e in events if e.task_id in hooked]
        return WebhookScan(cursor, last, len(events), found)

    async def enqueue(self, deliveries: Sequence[WebhookDelivery], *, cursor: int) -> int:
        """Add the deliveries of tasks that still exist (an event id already there is
        skipped) and move the cursor up to ``cursor``, in one transaction; how many were added."""

        rows = [(*d.insert_args(), d.task_id) for d in deliveries]

        async def write(tx: Tx) -> int:
            added = await tx.many(self.q.enqueue_delivery, rows) if rows else 0
            await tx.run(self.q.move_outbox_cursor, (CURSOR, cursor))
            return added

        return await self._write(write)

    async def due(self, *, limit: int) -> list[WebhookDelivery]:
        """Pending deliveries due now, soonest first; only the first pending delivery of
        each task (in seq order), so a task's deliveries go out one after the other."""

        args = (PENDING, self.clock(), PENDING, limit)

        return await self._rows(self.q.deliveries_due, args, delivery_from_row)

    async def record(self, attempt: WebhookAttempt) -> None:
        """Write what a delivery attempt came to (a row no longer pending is left as it
        is) and count it in ``counters`` as ``("webhook_deliveries", outcome)``."""

        args = (
            attempt.status,
            attempt.next_attempt_at,
            attempt.error,
            attempt.response_status,
            self.clock(),
            attempt.event_id,
            PENDING,
        )

        async def write(tx: Tx) -> None:
            await tx.run(self.q.record_delivery, args)
            tx.bump(names.WEBHOOK_DELIVERIES, attempt.outcome)

        await self._write(write)

    async def deliveries(
        self, *, task_id: str | None = None, limit: int = 100
    ) -> list[WebhookDelivery]:
        """Deliveries in seq order, of one task or of all, whatever their status."""

        args: tuple[Any, ...]
        if task_id is None:
            sql, args = self.q.deliveries, (limit,)
        else:
            sql, args = self.q.deliveries_of_task, (task_id, limit)

        return await self._rows(sql, args, delivery_from_row)

    async def redeliver(self, event_id: str, *, task_id: str) -> WebhookDelivery | None:
        """Put one delivery of a task back in line, due now (pending again, whatever its
        status), as it is after; None when the task has no such delivery. The next attempt
        sends the same event id and body."""

        now = self.clock()

        async def write(tx: Tx) -> WebhookDelivery | None:
            await tx.run(self.q.redeliver, (PENDING, now, now, event_id, task_id))
            row = await tx.one(self.q.delivery_of_task, (event_id, task_id))
            return None if row is None else delivery_from_row(row)

        return await self._write(write)

    async def pending(self) -> int:
        return await self._count(self.q.pending_deliveries, (PENDING,))
