"""Recurring schedules, as the store keeps them, and the firing of one tick.

A schedule is a cron expression in a time zone and the submission it makes
(``submission``: kind, params and the task options, already checked when the schedule was
made). ``next_at`` is its next tick not yet handled. The leading supervisor handles a tick
with :meth:`Schedules.handle_tick`: in one transaction it checks its leadership, locks the
schedule row, checks that ``next_at`` is still the tick it read (a compare-and-set), submits
the tick's task through the ordinary insert-or-get with an idempotency key made of the
schedule id and the tick, and moves ``next_at`` on. A tick is therefore fired at most once,
whatever the number of supervisors and wherever one is killed: a second handler finds
``next_at`` moved (or, were it ever to get that far, the key taken).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kiln.counters import SCHEDULE_FIRES
from kiln.errors import NotLeader, TooManySchedules
from kiln.limits import Rate, rate_bucket
from kiln.models import JSON, NewTask, Task, iso
from kiln.pipelines import KIND as PIPELINE
from kiln.states import FINAL
from kiln.store import pipelines
from kiln.store.pools import Limits
from kiln.store.records import LeaderToken
from kiln.store.rows import dumps, task_from_row
from kiln.store.tx import Concern, Op, Refused, Row, Tx

#: What a tick may come to: a task, or skipped because the last one still runs, or
#: skipped because it was missed (kiln_schedule_fires_total{outcome}); or put off for now
#: because its tenant is over its rate (``rate_limited``: it stays due, counted each time).
OUTCOMES = ("fired", "skipped_overlap", "skipped_missed", "rate_limited")
OVERLAP_POLICIES = ("skip", "queue")
MISSED_POLICIES = ("fire_once", "skip")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ScheduleRecord:
    """A schedule as stored."""

    id: str
    tenant: str
    cron: str
    timezone: str
    #: The submission each tick makes: kind, params, priority, max_attempts, deadline_s,
    #: timeouts, metadata, webhook.
    submission: JSON
    overlap: str
    missed: str
    paused: bool
    next_at: float | None
    last_task_id: str | None = None
    last_fired_at: float | None = None
    fired: int = 0
    skipped: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0

    def to_json(self) -> JSON:
        """The wire form (``GET /v1/schedules/{id}``)."""
        return {
            "id": self.id,
            "cron": self.cron,
            "timezone": self.timezone,
            "kind": self.submission["kind"],
            "task": self.submission,
            "overlap": self.overlap,
            "missed": self.missed,
            "paused": self.paused,
            "next_run_at": None if self.paused else iso(self.next_at),
            "last_task_id": self.last_task_id,
            "last_fired_at": iso(self.last_fired_at),
            "fired": self.fired,
            "skipped": self.skipped,
            "created_at": iso(self.created_at),
            "updated_at": iso(self.updated_at),
        }


def schedule_from_row(row: Row) -> ScheduleRecord:
    return ScheduleRecord(
        id=row[0],
        tenant=row[1],
        cron=row[2],
        timezone=row[3],
        submission=json.loads(row[4]),
        overlap=row[5],
        missed=row[6],
        paused=bool(row[7]),
        next_at=None if row[8] is None else float(row[8]),
        last_task_id=row[9],
        last_fired_at=None if row[10] is None else float(row[10]),
        fired=int(row[11]),
        skipped=int(row[12]),
        created_at=float(row[13]),
        updated_at=float(row[14]),
    )


@dataclass(frozen=True, slots=True)
class Tick:
    """What the scheduler asks for one due tick of a schedule."""

    schedule_id: str
    #: The schedule's ``next_at`` as read: the tick is handled only if it is still so.
    expect_next_at: float
    #: The tick after the ones handled now.
    next_at: float | None
    #: The task to submit (its idempotency key names the schedule and the tick), or None
    #: when the tick is skipped as missed.
    task: NewTask | None
    #: The tick the task stands for.
    tick_at: float
    #: Missed ticks skipped on the way (counted ``skipped_missed``).
    missed: int = 0
    #: The tenant's rate (None: no limit) and the tasks the tick's task creates: it fires
    #: only with that many tokens taken from the tenant's bucket, in its transaction.
    rate: Rate | None = None
    tasks: int = 1


@dataclass(frozen=True, slots=True)
class TickResult:
    """What :meth:`Schedules.handle_tick` did: ``outcome`` of the tick (see
    :data:`OUTCOMES`), the task it fired (or found already fired) and the schedule after."""

    outcome: str
    task: Task | None
    schedule: ScheduleRecord


_COLUMNS = (
    "id, tenant, cron, timezone, submission, overlap, missed, paused, next_at, last_task_id, "
    "last_fired_at, fired, skipped, created_at, updated_at"
)


class Host(pipelines.Host, Protocol):
    """What schedules need of the store: a tick submits as a task's submission does
    (``TaskOps._submit``), guarded by the leadership (``TaskOps._holds``), and takes its
    tenant's tokens (``store.limits``) in its own transaction."""

    limits: Limits

    async def _write(self, op: Op[T]) -> T: ...

    async def _read(self, op: Callable[[Tx], Awaitable[T]]) -> T: ...

    async def _holds(self, tx: Tx, token: LeaderToken, now: float) -> bool: ...


class Schedules(Concern[Host]):
    """The recurring schedules (``store.schedules``)."""

    async def create(self, schedule: ScheduleRecord, *, most: int | None = None) -> ScheduleRecord:
        """Store a new schedule; with ``most``, refused (TooManySchedules) when its tenant
        holds that many already (counted under the tenant's lock, so concurrent creations
        cannot pass it together)."""
        now = self.clock()
        made = ScheduleRecord(
            id=schedule.id,
            tenant=schedule.tenant,
            cron=schedule.cron,
            timezone=schedule.timezone,
            submission=schedule.submission,
            overlap=schedule.overlap,
            missed=schedule.missed,
            paused=schedule.paused,
            next_at=schedule.next_at,
            created_at=now,
            updated_at=now,
        )
        args = (
            made.id,
            made.tenant,
            made.cron,
            made.timezone,
            dumps(made.submission),
            made.overlap,
            made.missed,
            made.paused,
            made.next_at,
            now,
            now,
        )

        async def write(tx: Tx) -> ScheduleRecord | Refused:
            if most is not None:
                await tx.lock_tenant(f"schedules:{made.tenant}")
                row = await tx.one(self.q.count_schedules, (made.tenant,))
                held = 0 if row is None else int(row[0])
                if held >= most:
                    return Refused(too_many_schedules(made.tenant, held, most))
            await tx.run(self.q.insert_schedule, args)
            return made

        return await self._write(write)

    async def get(self, schedule_id: str) -> ScheduleRecord | None:
        found = await self._rows(self.q.get_schedule, (schedule_id,), schedule_from_row)
        return found[0] if found else None

    async def page(
        self, *, tenant: str | None, limit: int = 50, after: str | None = None
    ) -> list[ScheduleRecord]:
        """A tenant's schedules (every tenant's with None), oldest first, after id ``after``."""
        sql = f"SELECT {_COLUMNS} FROM schedules WHERE 1 = 1"
        args: list[Any] = []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if after is not None:
            sql += " AND id > ?"
            args.append(after)
        sql += " ORDER BY id LIMIT ?"
        args.append(limit)
        return await self._rows(self.q.sql(sql), args, schedule_from_row)

    async def due(self, *, limit: int = 100) -> list[ScheduleRecord]:
        """The running schedules whose next tick has come, earliest first."""
        return await self._rows(self.q.due_schedules, (self.clock(), limit), schedule_from_row)

    async def set_paused(
        self, schedule_id: str, *, paused: bool, next_at: float | None
    ) -> ScheduleRecord | None:
        """Pause a schedule, or resume it with its next tick; None when it is gone."""
        now = self.clock()

        async def write(tx: Tx) -> ScheduleRecord | None:
            await tx.run(self.q.pause_schedule, (paused, next_at, now, schedule_id))
            row = await tx.one(self.q.get_schedule, (schedule_id,))
            return None if row is None else schedule_from_row(row)

        return await self._write(write)

    async def delete(self, schedule_id: str) -> bool:
        """Delete a schedule (the tasks it made stay); False when it was not there."""

        async def write(tx: Tx) -> bool:
            return await tx.run(self.q.delete_schedule, (schedule_id,)) > 0

        return await self._write(write)

    async def handle_tick(self, tick: Tick, leader: LeaderToken) -> TickResult | None:
        """Fire or skip one due tick (see the module docstring). None when the schedule
        moved on meanwhile (another handler, a pause, a delete): nothing was done."""
        return await self._write(lambda tx: self._handle_tick(tx, tick, leader))

    async def _handle_tick(
        self, tx: Tx, tick: Tick, leader: LeaderToken
    ) -> TickResult | Refused | None:
        now = self.clock()
        if not await self._store._holds(tx, leader, now):
            return Refused(NotLeader(f"{leader.owner} no longer leads"))
        row = await tx.one(self.q.lock_schedule, (tick.schedule_id,))
        if row is None:
            return None
        schedule = schedule_from_row(row)
        if schedule.paused or schedule.next_at != tick.expect_next_at:
            return None
        outcome, task = "skipped_missed", None
        if tick.task is not None:
            if schedule.overlap == "skip" and await self._still_running(tx, schedule):
                outcome = "skipped_overlap"
            elif not await self._rate_allows(tx, schedule, tick):
                tx.bump(SCHEDULE_FIRES, "rate_limited")  # stays due: not advanced
                return TickResult("rate_limited", None, schedule)
            else:
                outcome, task = await self._fire(tx, tick.task)
        fired = 1 if outcome == "fired" else 0
        skipped = tick.missed + 1 - fired
        if tick.missed:
            tx.bump(SCHEDULE_FIRES, "skipped_missed", tick.missed)
        tx.bump(SCHEDULE_FIRES, outcome)
        last_id = schedule.last_task_id if task is None else task.id
        last_at = schedule.last_fired_at if task is None else tick.tick_at
        args = (tick.next_at, last_id, last_at, fired, skipped, now, schedule.id)
        await tx.run(self.q.advance_schedule, args)
        after = await tx.one(self.q.get_schedule, (schedule.id,))
        assert after is not None
        return TickResult(outcome, task, schedule_from_row(after))

    async def _rate_allows(self, tx: Tx, schedule: ScheduleRecord, tick: Tick) -> bool:
        """Take the tick's tokens from its tenant's bucket (the one its requests take
        from); False, nothing taken, when the bucket has too few."""
        if tick.rate is None:
            return True
        bucket = rate_bucket(schedule.tenant)
        return await self._store.limits.take_in(tx, bucket, tick.rate, tick.tasks) == 0.0

    async def _still_running(self, tx: Tx, schedule: ScheduleRecord) -> bool:
        if schedule.last_task_id is None:
            return False
        row = await tx.one(self.q.get_task, (schedule.last_task_id,))
        return row is not None and task_from_row(row).status not in FINAL

    async def _fire(self, tx: Tx, new: NewTask) -> tuple[str, Task | None]:
        """Submit a tick's task. Its key already taken by this very tick (a replay) is not a
        second fire; taken by another request (refused) leaves the tick unfired."""
        if new.kind == PIPELINE:  # it starts with its first steps, as a submission does
            result = await pipelines.submit(self._store, tx, new)
        else:
            result = await self._store._submit(tx, new)
        if isinstance(result, Refused):
            return "skipped_missed", None
        return ("fired" if result.created else "skipped_missed"), result.task


def too_many_schedules(tenant: str, held: int, most: int) -> TooManySchedules:
    """The refusal of one schedule more than KILN_MAX_SCHEDULES_PER_TENANT allows."""
    return TooManySchedules(
        f"tenant {tenant!r} holds {held} schedules, the most it may "
        "(KILN_MAX_SCHEDULES_PER_TENANT allows more); delete one first",
        details=[
            {
                "loc": ["body"],
                "msg": "too many schedules",
                "type": "too_many_schedules",
                "count": held,
                "limit": most,
                "setting": "KILN_MAX_SCHEDULES_PER_TENANT",
            }
        ],
    )
