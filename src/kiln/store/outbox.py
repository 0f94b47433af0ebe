"""The webhook outbox's records, shared by the SQL stores (policy lives in kiln.webhooks).

The event log is the outbox's source: a dispatcher reads the events after a persisted
cursor, turns those of tasks with a matching webhook into ``webhook_deliveries`` rows (one
per event id, so doing it twice is a no-op) and moves the cursor, in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kiln.models import Task, TaskEvent

PENDING = "pending"
DELIVERED = "delivered"
FAILED = "failed"
#: The name of the outbox's row in ``webhook_cursor``.
CURSOR = "events"

#: The ``webhook_deliveries`` columns, in the order ``delivery_from_row`` reads them.
DELIVERY_COLUMNS = (
    "event_id, seq, task_id, tenant, event, url, payload, status, attempts,"
    " next_attempt_at, last_error, response_status, created_at, updated_at"
)


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
        """Values for an insert, in ``DELIVERY_COLUMNS`` order."""
        return (
            self.event_id, self.seq, self.task_id, self.tenant, self.event, self.url,
            self.payload, self.status, self.attempts, self.next_attempt_at, self.last_error,
            self.response_status, self.created_at, self.updated_at,
        )  # fmt: skip


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
