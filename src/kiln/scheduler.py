"""The scheduler: the leading supervisor fires the due ticks of recurring schedules.

Every sweep of the leader reads the schedules whose next tick has come
(``store.schedules.due``) and hands each tick to the store
(``store.schedules.handle_tick``), which submits its task and moves the schedule on in one
transaction, under the leader's token (see :mod:`kiln.store.schedules`). The policy lives
here:

- A tick no more than ``grace_s`` old is on time: it fires (unless the schedule's overlap
  policy is ``skip`` and the task of its last tick is not final: ``skipped_overlap``).
- Ticks older than that were missed (no supervisor led, or the leader was stopped). With
  ``missed: fire_once`` the latest of them fires once and the others are counted
  ``skipped_missed``; with ``missed: skip`` they are all counted ``skipped_missed``.

A fired task is an ordinary submission of the schedule's ``submission`` with the
idempotency key ``schedule:<schedule id>:<tick, unix seconds>`` and no content dedup (each
tick is its own run, even when its params equal an earlier tick's).

A tick takes its tasks' tokens from its tenant's rate (``KILN_TENANT_RATE_PER_S``,
``KILN_TENANT_LIMITS``; the bucket the tenant's requests take from), in the transaction
that fires it. Over the rate it is put off (``rate_limited``): the schedule is not moved
on, and a later sweep fires the tick once the tokens are there. A tick put off past the
grace is a missed tick like any other, so the missed policy decides: ``fire_once`` fires
the latest missed tick (when the tokens are there), ``skip`` skips them all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from kiln import canonical
from kiln.engine import Engine
from kiln.limits import tasks_in
from kiln.models import NewTask, Timeouts
from kiln.store import LeaderToken, ScheduleRecord, Tick
from kiln.timing import Cron

log = logging.getLogger("kiln.scheduler")

#: How late a tick may fire and still count as on time (seconds).
GRACE_S = 60.0
#: The most ticks of one schedule handled in one pass (the rest wait for the next sweep).
TICKS_PER_PASS = 100
#: The most missed ticks counted one by one when a stretch of them is skipped.
MISSED_COUNTED = 100_000


def tick_key(schedule_id: str, tick_at: float) -> str:
    """The idempotency key of the task a schedule's tick fires."""
    return f"schedule:{schedule_id}:{int(tick_at)}"


def tick_task(schedule: ScheduleRecord, tick_at: float) -> NewTask:
    """The task a tick of ``schedule`` submits (see the module docstring)."""
    sub = schedule.submission
    timeouts = sub.get("timeouts") or {}
    return NewTask(
        id=canonical.new_task_id(),
        tenant=schedule.tenant,
        kind=sub["kind"],
        params=sub["params"],
        fingerprint=canonical.digest(
            {"schedule": schedule.id, "tick": int(tick_at), "submission": sub}
        ),
        idempotency_key=tick_key(schedule.id, tick_at),
        dedup_key=None,
        priority=int(sub.get("priority", 0)),
        max_attempts=int(sub.get("max_attempts", 3)),
        deadline_s=float(sub.get("deadline_s", 86_400)),
        timeouts=Timeouts(**timeouts),
        metadata=sub.get("metadata") or {},
        webhook=sub.get("webhook"),
    )


def plan(schedule: ScheduleRecord, now: float, grace_s: float) -> Tick | None:
    """What to do with the schedule's next tick at ``now``: None when it is not due."""
    due = schedule.next_at
    if due is None or due > now or schedule.paused:
        return None
    cron = Cron(schedule.cron, schedule.timezone)
    if now - due <= grace_s:
        return Tick(schedule.id, due, cron.next_after(due), tick_task(schedule, due), due)
    latest = cron.last_at_or_before(now - grace_s)
    if latest is None or latest < due:
        latest = due
    missed = cron.count_between(due, latest, MISSED_COUNTED)
    task = tick_task(schedule, latest) if schedule.missed == "fire_once" else None
    return Tick(schedule.id, due, cron.next_after(latest), task, latest, missed=missed)


@dataclass(slots=True)
class PassReport:
    """What one pass over the due schedules did, by outcome."""

    fired: int = 0
    skipped_overlap: int = 0
    skipped_missed: int = 0
    rate_limited: int = 0

    def add(self, other: PassReport) -> None:
        self.fired += other.fired
        self.skipped_overlap += other.skipped_overlap
        self.skipped_missed += other.skipped_missed
        self.rate_limited += other.rate_limited


class Scheduler:
    """Fires due ticks for the leader; :meth:`run_pass` once per sweep."""

    def __init__(self, engine: Engine, *, grace_s: float = GRACE_S, batch: int = 100) -> None:
        self.engine = engine
        self.grace_s = grace_s
        self.batch = batch
        #: What this process's passes did, for its own metrics.
        self.totals = PassReport()

    async def run_pass(self, token: LeaderToken) -> PassReport:
        """Handle every due tick of every due schedule (up to :data:`TICKS_PER_PASS` per
        schedule). A lost leadership raises NotLeader and stops the pass."""
        report = PassReport()
        try:
            for schedule in await self.engine.store.schedules.due(limit=self.batch):
                await self._schedule_pass(schedule, token, report)
        finally:
            self.totals.add(report)
        return report

    async def _schedule_pass(
        self, schedule: ScheduleRecord, token: LeaderToken, report: PassReport
    ) -> None:
        rate = self.engine.settings.tenant_limit(schedule.tenant).rate
        tasks = tasks_in(schedule.submission["kind"], schedule.submission["params"])
        for _ in range(TICKS_PER_PASS):
            tick = plan(schedule, self.engine.now(), self.grace_s)
            if tick is None:
                return
            tick = replace(tick, rate=rate, tasks=tasks)
            done = await self.engine.store.schedules.handle_tick(tick, token)
            if done is None:  # moved on meanwhile (paused, deleted, handled elsewhere)
                return
            if done.outcome != "rate_limited":  # put off: nothing was counted yet
                report.skipped_missed += tick.missed
            setattr(report, done.outcome, getattr(report, done.outcome) + 1)
            ids = {
                "schedule_id": schedule.id,
                "tick_at": tick.tick_at,
                "outcome": done.outcome,
                "missed": tick.missed,
                "task_id": None if done.task is None else done.task.id,
            }
            log.info("schedule_tick", extra=ids)
            if done.task is not None and done.outcome == "fired":
                self.engine.submitted()
            if done.outcome == "rate_limited":  # still due: a later sweep fires it
                return
            schedule = done.schedule
