"""Queue positions from kept counts: a few index probes however long the line is.

API.md's ``queue_position`` is exact: 1 for the next task a worker of its kind would
claim, while the task is PENDING or RETRYING and due. Counting the tasks ahead of a task
costs as much as its line is long, and a new task is at the end of its line. So the
database keeps, per kind and priority (and per tenant), how many tasks are queued
(``queue_counts``, written by triggers in the statement that changes a task), and a
position is made of:

- each level above the task's: its kept count, less the queued tasks not yet ready (an
  index range from now on) and those ready but past their deadline that the sweep has
  not ended yet (an index range of the due index up to now);
- the task's own level: the tasks before it, counted from whichever end of the level is
  nearer to it (``queue_place``: the count of those after it up to a limit, then, only
  if that limit was reached, the count of those before it up to a limit), so a new task
  (the end of its line) and the next to be claimed (its head) both cost little. A task
  deep inside a long level is counted from the front, the limit growing each try.

Under aging each level's tasks before the task's bound on that level are counted the same
way; under fair turns, the task's place in its tenant's line and each other tenant's line
depth come from the per-tenant counts.
"""

from __future__ import annotations

import functools
from typing import Any

from kiln.models import Task
from kiln.store.queries import Queries
from kiln.store.tx import Tx

#: Below every priority: a line's every level.
BELOW_ALL = -(2**62)
#: The first limit of a count from either end of a level; each further try counts 16 times
#: as far, from the front.
FIRST_LIMIT = 32


def place_args(
    key: tuple[Any, ...], ready_at: float, task_id: str, now: float, limit: int
) -> tuple[Any, ...]:
    """The parameters of ``queue_place`` (``key``: kind, priority) or
    ``queue_place_of_tenant`` (kind, tenant, priority)."""
    ahead = (*key, ready_at, task_id, now, now, limit)
    due = (*key, *key, now, now, *key, now)
    return (limit, *ahead, *due, *ahead)


def due_above_args(kind: str, tenant: str | None, priority: int, now: float) -> tuple[Any, ...]:
    """The parameters of ``queue_due_above`` or ``queue_due_above_of_tenant``."""
    key = (kind, priority) if tenant is None else (kind, tenant, priority)
    return (now, now, *key, now, *key)


@functools.lru_cache(maxsize=8)
def _above_and_place(above: str, place: str) -> str:
    """One statement: the due tasks of the levels above (``above``), then the task's own
    level's columns (``place``), so a position in the default order is one read."""
    return f"SELECT ({above}), own.* FROM ({place}) AS own"


class Places:
    """Positions in the lines of one read transaction, at ``now``."""

    __slots__ = ("now", "q", "tx")

    def __init__(self, tx: Tx, q: Queries, now: float) -> None:
        self.tx = tx
        self.q = q
        self.now = now

    async def _number(self, sql: str, args: tuple[Any, ...]) -> int:
        row = await self.tx.one(sql, args)
        return 0 if row is None or row[0] is None else int(row[0])

    async def due_above(self, kind: str, tenant: str | None, priority: int) -> int:
        """Due tasks of the line's levels above ``priority`` (of one tenant, or all)."""
        sql = self.q.queue_due_above if tenant is None else self.q.queue_due_above_of_tenant
        return await self._number(sql, due_above_args(kind, tenant, priority, self.now))

    async def before(
        self,
        kind: str,
        tenant: str | None,
        level: int,
        ready_at: float,
        task_id: str,
        limit: int = FIRST_LIMIT,
    ) -> int:
        """Due tasks of one level of the line before the key (ready_at, task_id), counted
        from either end up to ``limit`` first."""
        now = self.now
        key: tuple[Any, ...] = (kind, level) if tenant is None else (kind, tenant, level)
        sql = self.q.queue_place if tenant is None else self.q.queue_place_of_tenant
        while True:
            row = await self.tx.one(sql, place_args(key, ready_at, task_id, now, limit))
            assert row is not None
            total, after, before = int(row[0] or 0), int(row[1]), int(row[2])
            if after < limit:
                return max(total - after, 0)
            if before < limit:
                return before
            limit *= 16

    async def levels(self, kind: str, tenant: str | None) -> list[int]:
        """The priorities of the line's queued tasks, highest first."""
        if tenant is None:
            rows = await self.tx.all(self.q.queue_levels, (kind,))
        else:
            rows = await self.tx.all(self.q.queue_levels_of_tenant, (kind, tenant))
        return [int(row[0]) for row in rows]

    async def ahead(self, task: Task, tenant: str | None, aging_s: float | None) -> int:
        """Due tasks of the task's line (of one tenant, or all) claimed before it: in the
        default order, every level above its own and those before it in its own (one
        statement, unless its level must be counted further); under aging, on each level
        those before the ready time at which the level ties with it."""
        kind = task.kind
        if aging_s is None:
            return await self._ahead_in_order(task, tenant)
        found = 0
        for level in await self.levels(kind, tenant):
            bound = task.ready_at + (level - task.priority) * aging_s
            found += await self.before(kind, tenant, level, bound, task.id)
        return found

    async def _ahead_in_order(self, task: Task, tenant: str | None) -> int:
        kind, priority, q = task.kind, task.priority, self.q
        if tenant is None:
            sql = _above_and_place(q.queue_due_above, q.queue_place)
            key: tuple[Any, ...] = (kind, priority)
        else:
            sql = _above_and_place(q.queue_due_above_of_tenant, q.queue_place_of_tenant)
            key = (kind, tenant, priority)
        above_args = due_above_args(kind, tenant, priority, self.now)
        place = place_args(key, task.ready_at, task.id, self.now, FIRST_LIMIT)
        row = await self.tx.one(sql, (*above_args, *place))
        assert row is not None
        above, due, after, before = int(row[0] or 0), int(row[1] or 0), int(row[2]), int(row[3])
        if after < FIRST_LIMIT:
            return above + max(due - after, 0)
        if before < FIRST_LIMIT:
            return above + before
        further = FIRST_LIMIT * 16  # both ends were further than the first limit
        return above + await self.before(kind, tenant, priority, task.ready_at, task.id, further)

    async def depth(self, kind: str, tenant: str) -> int:
        """How many due tasks a tenant's line holds."""
        return await self.due_above(kind, tenant, BELOW_ALL)
