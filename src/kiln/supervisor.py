"""Supervisor: the periodic sweep that ends what nobody else will.

Each sweep reads only what is due (indexed on status and expiry), so its cost follows
the work due, not the size of the task table. Only the leader acts: leadership is a
leased record in the store with its own epoch, and every action carries the leader's
token, so a paused old leader's writes are refused. A supervisor that stops hands its
leadership over at once (:meth:`Supervisor.resign`), so another one leads at its next
sweep instead of after the leader row's lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kiln import canonical, counters, reconcile, retention, scheduler, webhooks
from kiln.contributions import Counts, Retry, failure
from kiln.engine import Engine, SupportsEngine, engine_of, ghost_after_s
from kiln.errors import Conflict, LeaseLost, NotLeader
from kiln.models import JSON, Task
from kiln.states import CLAIMABLE, MAY_HAVE_OUTPUTS, Event
from kiln.storage import read_complete_manifest
from kiln.store import LeaderToken
from kiln.store.records import Fence

log = logging.getLogger("kiln.supervisor")

LEADER = "supervisor"
#: The most a stopping supervisor waits to hand its leadership over (seconds).
RESIGN_TIMEOUT_S = 2.0


@dataclass(slots=True)
class SweepReport:
    leading: bool = False
    expired: int = 0
    recovered: int = 0
    deadlined: int = 0
    force_cancelled: int = 0
    conflicts: int = 0
    ghosts: int = 0
    purged: int = 0
    #: Running attempts asked to yield their slot (preemption, KILN_PREEMPT_AFTER_S).
    preempted: int = 0
    #: Schedule ticks handled: fired, skipped (overlap or missed).
    fired: int = 0
    skipped: int = 0
    duration_s: float = 0.0


Action = Callable[[Task, "SweepReport"], Awaitable[None]]


class Supervisor:
    """The periodic sweep (see the module docstring), the webhook outbox beside it, and
    the retention and reconciliation passes it starts. Takes the process's Engine (or an
    App, for its engine)."""

    def __init__(
        self,
        engine: Engine | SupportsEngine,
        *,
        interval_s: float | None = None,
        owner: str | None = None,
        batch: int = 500,
        leader_ttl_s: float | None = None,
        schedule_grace_s: float = scheduler.GRACE_S,
    ) -> None:
        self.engine = engine = engine_of(engine)
        self.interval_s = interval_s or engine.settings.supervisor_interval_s
        self.owner = (
            owner or f"{socket.gethostname()}:{os.getpid()}:" + (canonical.new_id("s")[-8:])
        )
        self.batch = batch
        self.leader_ttl_s = leader_ttl_s or max(3 * self.interval_s, 3.0)
        self.token: LeaderToken | None = None
        self.last: SweepReport = SweepReport()
        self.sweeps = 0
        self.retention = retention.RetentionPolicy.of(engine.settings)
        self._retention_due = 0.0
        self.reconciling: asyncio.Task[None] | None = None
        self.reconciles = ReconcileTotals()
        self._reconcile_due: float | None = None
        self.webhooks = webhooks.Dispatcher(engine, owner=self.owner, interval_s=self.interval_s)
        self.scheduler = scheduler.Scheduler(engine, grace_s=schedule_grace_s)

    @property
    def ghost_after_s(self) -> float:
        """A running task whose lease lapsed this long ago should have been swept."""
        return ghost_after_s(self.engine.settings.lease_ttl_s, self.interval_s)

    async def run(self) -> None:
        # The webhook outbox, beside the sweep: delivering never waits for a sweep.
        dispatching = asyncio.create_task(self.webhooks.run(), name="kiln-webhooks")
        try:
            while True:
                try:
                    self.last = await self.sweep()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("sweep_failed")
                await asyncio.sleep(self.interval_s)
        finally:
            await self.stop_reconciling()
            dispatching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dispatching
            await self.resign()

    async def resign(self) -> None:
        """Hand the leaderships over now (the sweep's and the webhook outbox's): each
        leader row is renewed as already expired (same owner and epoch), so this process's
        later writes are refused and another candidate takes the row, epoch+1, at its next
        round. Bounded by :data:`RESIGN_TIMEOUT_S`; a row the store does not update lapses
        by itself."""
        held = [(LEADER, self.token), (webhooks.LEADER, self.webhooks.token)]
        self.token = self.webhooks.token = None
        for name, token in held:
            if token is not None:
                await self._resign(name, token)

    async def _resign(self, name: str, token: LeaderToken) -> None:
        ids = {"leader": name, "owner": self.owner, "epoch": token.epoch}
        try:
            await asyncio.wait_for(
                self.engine.store.lead(name, self.owner, -self.leader_ttl_s), RESIGN_TIMEOUT_S
            )
        except Exception as exc:  # the lease runs out by itself
            log.warning("resign_failed", extra={**ids, "error": str(exc) or type(exc).__name__})
            return
        log.info("leadership_resigned", extra=ids)

    async def sweep(self) -> SweepReport:
        started = time.perf_counter()
        report = SweepReport()
        self.token = await self.engine.store.lead(LEADER, self.owner, self.leader_ttl_s)
        self.sweeps += 1
        if self.token is None:
            return report
        report.leading = True
        store = self.engine.store
        due = await store.due(limit=self.batch, cancel_grace_s=self.engine.settings.cancel_grace_s)
        seen: set[str] = set()
        with contextlib.suppress(NotLeader):
            for task in due.cancel_overdue:
                await self._act(task, seen, report, self._force_cancel)
            for task in due.deadline_passed:
                await self._act(task, seen, report, self._deadline)
            for task in due.lease_expired:
                await self._act(task, seen, report, self._lease_expired)
            for task in due.state_expired:
                await self._act(task, seen, report, self._state_expired)
            await self._schedules_pass(report)
            await self._preempt_pass(report)
        report.ghosts = await store.count_ghosts(older_than_s=self.ghost_after_s)
        await self._retention_pass(report)
        self._start_reconcile_pass()
        report.duration_s = time.perf_counter() - started
        return report

    async def _schedules_pass(self, report: SweepReport) -> None:
        """Fire the schedules' due ticks (kiln.scheduler); NotLeader stops the sweep."""
        if self.token is None:
            return
        try:
            done = await self.scheduler.run_pass(self.token)
        except NotLeader:
            raise
        except Exception:
            log.exception("schedules_failed")
            return
        report.fired = done.fired
        report.skipped = done.skipped_overlap + done.skipped_missed

    async def _preempt_pass(self, report: SweepReport) -> None:
        """Ask running attempts to yield to tasks of higher priority that waited in a full
        pool's line past KILN_PREEMPT_AFTER_S (kiln/store/preempt.py): at most one request
        per pool at a time. Off (no query at all) when the setting is unset; NotLeader stops
        the sweep."""
        after_s = self.engine.settings.preempt_after_s
        if after_s is None or self.token is None:
            return
        try:
            made = await self.engine.store.request_yields(waited_s=after_s, leader=self.token)
        except NotLeader:
            raise
        except Exception:
            log.exception("preempt_failed")
            return
        for asked in made:
            log.info(
                "preempt_requested",
                extra={
                    "task_id": asked.task_id,
                    "epoch": asked.epoch,
                    "pool": asked.pool,
                    "priority": asked.priority,
                    "waiter": asked.waiter,
                    "waiter_priority": asked.waiter_priority,
                },
            )
        report.preempted = len(made)

    async def _retention_pass(self, report: SweepReport) -> None:
        now = self.engine.now()
        if not self.retention.enabled or now < self._retention_due:
            return
        self._retention_due = now + retention.PASS_EVERY_S
        try:
            report.purged = (
                await retention.purge(self.engine.store, self.engine.storage, self.retention, now)
            ).tasks
        except Exception:
            log.exception("retention_failed")

    def _start_reconcile_pass(self) -> None:
        """Start a reconciliation pass when one is due, as its own task: it reads the whole
        bucket, so the sweep never waits for it, and one runs at a time."""
        every_s = self.engine.settings.reconcile_interval_s
        now = self.engine.now()
        if every_s <= 0 or (self.reconciling is not None and not self.reconciling.done()):
            return
        if self._reconcile_due is None:  # the first pass comes one interval after start
            self._reconcile_due = now + every_s
        if now < self._reconcile_due or self.token is None:
            return
        self._reconcile_due = now + every_s
        self.reconciling = asyncio.create_task(self._reconcile_pass(self.token))

    async def _reconcile_pass(self, token: LeaderToken) -> None:
        settings = self.engine.settings
        options = reconcile.Options(
            repair=settings.reconcile_repair,
            grace_s=settings.reconcile_grace_s,
            result_lost=reconcile.ResultLostPolicy(settings.result_lost_policy),
        )
        try:
            found = await reconcile.reconcile(self.engine, options, leader=token)
        except NotLeader:
            log.info("reconcile_stopped", extra={"reason": "no longer leading"})
            return
        except Exception:
            log.exception("reconcile_failed")
            return
        self.reconciles.add(found)

    async def stop_reconciling(self) -> None:
        """Cancel a pass in flight and wait for it to end."""
        if self.reconciling is not None and not self.reconciling.done():
            self.reconciling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reconciling

    async def _act(self, task: Task, seen: set[str], report: SweepReport, action: Action) -> None:
        if task.id in seen:
            return
        seen.add(task.id)
        try:
            await action(task, report)
        except (Conflict, LeaseLost):
            report.conflicts += 1  # a worker or an API call moved it first: nothing to do
        except NotLeader:
            raise
        except Exception:
            log.exception("sweep_action_failed", extra={"task_id": task.id})

    # actions

    @property
    def _fence(self) -> Fence:
        """A write of this leader that fences the worker out (epoch+1)."""
        return Fence(bump=True, leader=self.token)

    async def _force_cancel(self, task: Task, report: SweepReport) -> None:
        await self.engine.apply(task, Event.FORCE_CANCEL, fence=self._fence)
        report.force_cancelled += 1
        log.info("force_cancelled", extra={"task_id": task.id, "epoch": task.epoch})

    async def _deadline(self, task: Task, report: SweepReport) -> None:
        error = _error("deadline_exceeded", "the task's deadline passed", retryable=False)
        if task.status in CLAIMABLE:
            await self.engine.apply(
                task,
                Event.DEADLINE,
                fence=Fence(leader=self.token),
                fields={"error": error},
                error=error,
                facts=[Counts((failure(task, "deadline_exceeded"),))],
            )
            report.deadlined += 1
            return
        await self._recover_or_expire(task, report, error)

    async def _lease_expired(self, task: Task, report: SweepReport) -> None:
        error = _error("lease_expired", f"the worker's lease lapsed in {task.status}")
        await self._recover_or_expire(task, report, error)

    async def _state_expired(self, task: Task, report: SweepReport) -> None:
        code = f"{task.status.lower()}_timeout"
        error = _error(code, f"the task stayed in {task.status} past its timeout")
        await self._recover_or_expire(task, report, error)

    async def _recover_or_expire(self, task: Task, report: SweepReport, error: JSON) -> None:
        if task.status in MAY_HAVE_OUTPUTS and task.result_prefix:
            outputs = await read_complete_manifest(self.engine.storage, task.result_prefix)
            if outputs is not None:
                await self.engine.apply(
                    task,
                    Event.RECOVER,
                    fence=self._fence,
                    fields={
                        "result": {"outputs": [o.to_json() for o in outputs]},
                        "error": None,
                        "stage": None,
                    },
                    facts=[Counts(((counters.RECOVERED, ""),))],
                )
                report.recovered += 1
                log.info("recovered", extra={"task_id": task.id, "attempt": task.attempt})
                return
        await self.engine.apply(task, Event.EXPIRE, fence=self._fence, retry=Retry(error))
        report.expired += 1
        log.info("expired", extra={"task_id": task.id, "code": error["code"]})


@dataclass(slots=True)
class ReconcileTotals:
    """What this process's reconciliation passes did, for its metrics."""

    runs: int = 0
    objects_checked: int = 0
    deleted: int = 0
    rerun: int = 0
    failed: int = 0
    last: reconcile.Report | None = None

    def add(self, report: reconcile.Report) -> None:
        self.runs += 1
        self.objects_checked += report.objects_checked
        self.deleted += report.deleted_count
        self.rerun += report.rerun_count
        self.failed += report.failed_count
        self.last = report


def _error(code: str, message: str, *, retryable: bool = True) -> JSON:
    return {"code": code, "message": message, "retryable": retryable}
