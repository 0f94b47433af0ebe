"""The App's reads of tasks: one task, a page of them, where they stand in the queue or a
pool, a pipeline's steps, a task's webhook deliveries, and what the deployment counts.
:class:`kiln.App` has them all (``app.get``, ``app.list_tasks``, ...)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence

from kiln.engine import Engine
from kiln.errors import InvalidCursor, NotFound
from kiln.models import Task
from kiln.states import Status
from kiln.store import BreakerRecord, Stats
from kiln.store.outbox import WebhookDelivery
from kiln.store.pools import PoolUsage, PoolWait

__all__ = ["CURSOR_PATTERN", "MAX_DELIVERIES_SHOWN", "TaskReads", "check_cursor"]

log = logging.getLogger("kiln")

#: The most webhook deliveries one task's listing shows (a task has one per event it sent).
MAX_DELIVERIES_SHOWN = 1000
#: A list cursor is the id of the last task of the page before (kiln.canonical.new_task_id).
CURSOR_PATTERN = re.compile(r"tsk_[0-9a-hjkmnp-tv-z]{26}")


def check_cursor(cursor: str | None) -> None:
    """Refuse (InvalidCursor) a cursor that is not a ``next_cursor`` kiln gave."""
    if cursor is not None and CURSOR_PATTERN.fullmatch(cursor) is None:
        raise InvalidCursor(
            "the cursor is not one a page gave: pass next_cursor of the previous page as is",
            details=[{"loc": ["query", "cursor"], "msg": "malformed cursor", "type": "cursor"}],
        )


class TaskReads:
    """The reads of :class:`kiln.App`, on its :attr:`engine`."""

    engine: Engine

    async def get(self, task_id: str, tenant: str | None = None) -> Task:
        """The task, or NotFound, also when it belongs to another tenant."""
        return await self.engine.get(task_id, tenant)

    async def pipeline_steps(self, pipeline: Task) -> dict[str, Task]:
        """The steps a pipeline made so far, by ``name/copy`` (docs/pipelines.md)."""
        return await self.engine.store.pipeline_steps(pipeline)

    async def queue_position(self, task: Task) -> int | None:
        """1 for the next task a worker of its kind would claim, while it is ready."""
        return await self.engine.store.queue_position(task, self.engine.claim_policy)

    async def standing(self, task_id: str, tenant: str | None = None) -> tuple[Task, int | None]:
        """The task (NotFound as :meth:`get`) and its queue position, read together."""
        return await self.engine.standing(task_id, tenant)

    async def webhook_deliveries(
        self, task_id: str, tenant: str | None = None
    ) -> list[WebhookDelivery]:
        """The task's webhook deliveries in event order (at most ``MAX_DELIVERIES_SHOWN``);
        NotFound as :meth:`get`."""
        task = await self.get(task_id, tenant)
        return await self.engine.store.outbox.deliveries(
            task_id=task.id, limit=MAX_DELIVERIES_SHOWN
        )

    async def redeliver(
        self, task_id: str, delivery_id: str, tenant: str | None = None
    ) -> WebhookDelivery:
        """Send one of the task's deliveries again (the same event id and body), due now,
        whatever its status; NotFound for an unknown task or delivery. A delivery that had
        used up its attempts gets one more; one that had attempts left keeps its backoff."""
        task = await self.get(task_id, tenant)
        found = await self.engine.store.outbox.redeliver(delivery_id, task_id=task.id)
        if found is None:
            raise NotFound(f"task {task.id} has no webhook delivery {delivery_id!r}")
        log.info(
            "webhook_redelivery_asked",
            extra={"task_id": task.id, "event_id": found.event_id, "attempts": found.attempts},
        )
        return found

    async def queue_positions(self, tasks: Sequence[Task]) -> dict[str, int]:
        """The positions of many tasks by id (one count per priority level, not per task)."""
        return await self.engine.store.queue_positions(tasks, self.engine.claim_policy)

    async def pool_wait(self, task: Task) -> PoolWait | None:
        """Where a WAITING_FOR_RESOURCE task stands in a shared pool's line, or None."""
        return await self.engine.pool_wait(task)

    async def list_tasks(
        self,
        *,
        tenant: str | None,
        status: Status | None = None,
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Task], str | None]:
        """A page of tasks, newest first, and the cursor of the next page (None: the last).

        A ``cursor`` that no page gave is refused (InvalidCursor) before the store is read."""
        check_cursor(cursor)
        return await self.engine.store.list_tasks(
            tenant=tenant, status=status, kind=kind, limit=limit, cursor=cursor
        )

    async def stats(self, tenant: str | None = None) -> Stats:
        """Counts, dwell times, failures and ghosts of a tenant's tasks (None: all)."""
        return await self.engine.stats(tenant)

    async def pools(self) -> list[PoolUsage]:
        """The shared resource pools (KILN_POOLS): capacity, units held, tasks waiting."""
        return await self.engine.pools()

    async def shared_breakers(self) -> list[BreakerRecord]:
        """The circuit breakers' states as every process shares them through the store."""
        return await self.engine.shared_breakers()

    async def ready(self) -> None:
        """Raise unless the store answers and the storage takes a write and a delete."""
        await self.engine.probe(f"_kiln/readyz-{uuid.uuid4().hex}")
