"""What the App gives the faces besides tasks, grouped by concern, and the records they
name: the faces (``kiln.api``, ``kiln.cli``) never reach the store themselves.

``app.schedules`` is the recurring schedules' book (docs/schedules.md), ``app.operations``
what an operator reads of the deployment (the worker registry, the autoscaling signals,
the GPU-second ledger); the records and
names below are the store's, re-exported so that a face imports none of ``kiln.store``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.autoscaling import Autoscaling
from kiln.engine import Engine
from kiln.errors import NotFound
from kiln.store import ScheduleRecord, WorkerRecord
from kiln.store.pools import PoolUsage, PoolWait
from kiln.store.schedules import OUTCOMES as SCHEDULE_OUTCOMES
from kiln.store.usage import GROUPS as USAGE_GROUPS
from kiln.store.usage import MAX_GROUPS as MAX_USAGE_GROUPS
from kiln.store.usage import UsageSum
from kiln.timing import Cron

__all__ = [
    "MAX_USAGE_GROUPS",
    "SCHEDULE_OUTCOMES",
    "USAGE_GROUPS",
    "Operations",
    "PoolUsage",
    "PoolWait",
    "ScheduleRecord",
    "Schedules",
    "WorkerRecord",
]


class Schedules:
    """The recurring schedules, as a tenant sees them (``scope`` None: every tenant's)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def get(self, schedule_id: str, scope: str | None = None) -> ScheduleRecord:
        """The schedule, or NotFound, also when it belongs to another tenant."""
        found = await self.engine.store.schedules.get(schedule_id)
        if found is None or (scope is not None and found.tenant != scope):
            raise NotFound(f"no schedule {schedule_id!r}")
        return found

    async def create(self, schedule: ScheduleRecord, *, most: int | None = None) -> ScheduleRecord:
        """Store a new schedule; with ``most``, TooManySchedules past that many a tenant."""
        return await self.engine.store.schedules.create(schedule, most=most)

    async def list(
        self, *, scope: str | None, limit: int = 50, after: str | None = None
    ) -> list[ScheduleRecord]:
        """Up to ``limit`` schedules, oldest first, after the schedule id ``after``."""
        return await self.engine.store.schedules.page(tenant=scope, limit=limit, after=after)

    async def set_paused(
        self, schedule_id: str, *, paused: bool, scope: str | None = None
    ) -> ScheduleRecord:
        """Pause a schedule, or resume it from its next tick after now (the ticks it
        missed while paused are not fired); NotFound as :meth:`get`."""
        found = await self.get(schedule_id, scope)
        if found.paused == paused:
            return found
        next_at = found.next_at
        if not paused:
            next_at = Cron(found.cron, found.timezone).next_after(self.engine.now())
        store = self.engine.store
        changed = await store.schedules.set_paused(schedule_id, paused=paused, next_at=next_at)
        if changed is None:
            raise NotFound(f"no schedule {schedule_id!r}")
        return changed

    async def delete(self, schedule_id: str, scope: str | None = None) -> None:
        """Delete a schedule (the tasks it made stay); NotFound as :meth:`get`."""
        await self.get(schedule_id, scope)
        if not await self.engine.store.schedules.delete(schedule_id):
            raise NotFound(f"no schedule {schedule_id!r}")


class Operations:
    """What an operator reads of the whole deployment."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def workers(self) -> list[WorkerRecord]:
        """The worker processes whose beat has not lapsed (the worker registry)."""
        return await self.engine.workers()

    async def autoscaling(
        self,
        *,
        workers: Sequence[WorkerRecord] | None = None,
        pools: Sequence[PoolUsage] | None = None,
    ) -> Autoscaling:
        """The autoscaling signals of every kind and pool (docs/autoscaling.md)."""
        return await self.engine.autoscaling(workers=workers, pools=pools)

    async def usage(
        self, *, since: float, until: float, group_by: Sequence[str] = (), tenant: str | None
    ) -> list[UsageSum]:
        """The GPU-second ledger's sums of the attempts that ended in ``[since, until)``."""
        store = self.engine.store
        return await store.usage.report(since=since, until=until, group_by=group_by, tenant=tenant)
