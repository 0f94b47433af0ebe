"""A stateful property test: the store and the engine against a simple in-memory model.

Hypothesis drives random sequences of submissions (with and without idempotency keys and
content dedup), claims, worker steps, failures, supervisor actions, cancellations, manual
retries, the passage of time, and stale workers replaying old writes. After every step the
database must agree with the model and with the invariants I1, I3, I5, I6 and I7.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kiln
from kiln import canonical
from kiln.config import Settings
from kiln.errors import AlreadyFinal, IdempotencyKeyReused, LeaseLost, NotRetryable
from kiln.models import JSON, Task, Timeouts
from kiln.retry import RetryPolicy
from kiln.states import ACTIVE, CLAIMABLE, FINAL, RUNNING, Event, Status, replay
from kiln.store import LeaderToken, Progress
from kiln.worker import release_fields

from .backends import Backend
from .factories import KIND, SettableClock
from .queue_counts import kept_and_recounted

T = TypeVar("T")
S = Status
START = 1_800_000_000.0
TENANT = "acme"
LEASE_TTL_S = 10.0
CANCEL_GRACE_S = 5.0
TIMEOUTS = Timeouts(waiting_s=20.0, generating_s=40.0, uploading_s=10.0)
RETRY = RetryPolicy(base_s=2.0, max_s=8.0)
NOT_LIVE = frozenset({S.FAILED, S.TIMEOUT, S.CANCELLED})
DEDUP_KEYS = {n: canonical.dedup_key(KIND, {"n": n}, []) for n in range(2)}
#: (created, replayed, deduplicated) of each submission outcome.
SUBMIT_FLAGS = {
    "created": (True, False, False),
    "replayed": (False, True, False),
    "deduplicated": (False, False, True),
}
#: Fenced worker writes a stale worker may replay, by the status it believed in.
WORKER_WRITES: dict[Status, list[tuple[Event, Status | None]]] = {
    S.WAITING_FOR_RESOURCE: [
        (Event.ACQUIRE, None), (Event.FAIL, None), (Event.STOPPED, None), (Event.RELEASE, None)
    ],
    S.GENERATING: [
        (Event.GENERATED, None), (Event.FAIL, None), (Event.STOPPED, None), (Event.RELEASE, None)
    ],
    S.UPLOADING: [
        (Event.UPLOADED, S.SUCCESS), (Event.FAIL, None), (Event.STOPPED, None),
        (Event.RELEASE, None),
    ],
}  # fmt: skip


@dataclass(frozen=True)
class Request:
    """Everything a submission's fingerprint covers, in this test."""

    n: int
    priority: int
    max_attempts: int
    dedup: bool
    deadline_s: float


@dataclass
class ModelTask:
    id: str
    request: Request
    ready_at: float
    deadline_at: float
    dedup: int | None
    max_attempts: int
    status: Status = S.PENDING
    attempt: int = 0
    epoch: int = 0
    lease_expires_at: float | None = None
    state_deadline_at: float | None = None
    cancel_requested_at: float | None = None

    def claim_key(self) -> tuple[int, float, str]:
        return -self.request.priority, self.ready_at, self.id

    def end_lease(self, status: Status) -> None:
        self.status = status
        self.lease_expires_at = self.state_deadline_at = None


async def _noop_handler(ctx: Any, params: Any) -> None:
    return None


class StoreMachine(RuleBasedStateMachine):
    """One fresh store and engine on a fake clock, with the model of what they must hold."""

    def __init__(self, backend: Backend, directory: Path, clock: SettableClock) -> None:
        super().__init__()
        clock.now = START
        self.clock = clock
        self.loop = asyncio.new_event_loop()
        self.store = backend.open(directory, clock)
        self.db = backend.connect(self.store)
        config = Settings(data_dir=directory, cancel_grace_s=CANCEL_GRACE_S)
        self.app = kiln.App(store=self.store, settings=config, rng=random.Random(0))
        self.app.task(KIND, timeouts=TIMEOUTS, retry=RETRY)(_noop_handler)
        self.tasks: dict[str, ModelTask] = {}
        self.keys: dict[str, tuple[Request, str]] = {}
        self.snapshots: list[Task] = []

    # plumbing

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.db.close()
            self.run(self.app.close())
        finally:
            self.loop.close()

    @property
    def now(self) -> float:
        return self.clock()

    def ids(
        self, statuses: Iterable[Status], where: Callable[[ModelTask], bool] = bool
    ) -> list[str]:
        wanted = set(statuses)
        return sorted(t.id for t in self.tasks.values() if t.status in wanted and where(t))

    def pick(self, data: st.DataObject, ids: list[str]) -> ModelTask:
        return self.tasks[data.draw(st.sampled_from(ids), label="task")]

    def current(self, task_id: str) -> Task:
        task = self.run(self.store.get(task_id))
        assert task is not None, f"task {task_id} disappeared"
        return task

    def leader(self) -> LeaderToken:
        token = self.run(self.store.lead("supervisor", "model", 1e9))
        assert token is not None
        return token

    def sql(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        return self.db.rows(query, args)

    def claimable_due(self) -> list[ModelTask]:
        ready = [
            t for t in self.tasks.values()
            if t.status in CLAIMABLE and t.ready_at <= self.now < t.deadline_at
        ]  # fmt: skip
        return sorted(ready, key=ModelTask.claim_key)

    def live_holder(self, dedup: int) -> str | None:
        holders = [
            t.id for t in self.tasks.values() if t.dedup == dedup and t.status not in NOT_LIVE
        ]
        assert len(holders) <= 1
        return holders[0] if holders else None

    # submission

    def predict_submit(self, request: Request, key: str | None) -> tuple[str, str | None]:
        if key is not None and key in self.keys:
            known, task_id = self.keys[key]
            return ("replayed", task_id) if known == request else ("refused", None)
        holder = self.live_holder(request.n) if request.dedup else None
        if holder is not None:
            return "deduplicated", holder
        return "created", None

    @initialize(
        requests=st.lists(
            st.tuples(st.integers(0, 1), st.sampled_from([None, "k0"]), st.booleans()),
            min_size=2, max_size=5,
        )
    )  # fmt: skip
    def some_tasks(self, requests: list[tuple[int, str | None, bool]]) -> None:
        for n, key, dedup in requests:
            self.submit(n, key, dedup, priority=0, max_attempts=2, deadline_s=3600.0)

    @rule(
        n=st.integers(0, 1),
        key=st.sampled_from([None, "k0", "k1", "k2"]),
        dedup=st.booleans(),
        priority=st.integers(0, 1),
        max_attempts=st.integers(1, 3),
        deadline_s=st.sampled_from([30.0, 3600.0]),
    )
    def submit(
        self, n: int, key: str | None, dedup: bool, priority: int, max_attempts: int,
        deadline_s: float,
    ) -> None:  # fmt: skip
        request = Request(n, priority, max_attempts, dedup, deadline_s)
        outcome, task_id = self.predict_submit(request, key)
        try:
            result = self.run(self.app.submit(
                KIND, {"n": n}, tenant=TENANT, idempotency_key=key, dedup=dedup,
                priority=priority, max_attempts=max_attempts, deadline_s=deadline_s,
            ))  # fmt: skip
        except IdempotencyKeyReused:
            assert outcome == "refused"
            return
        flags = (result.created, result.replayed, result.deduplicated)
        assert flags == SUBMIT_FLAGS[outcome], (outcome, flags)
        if outcome == "created":
            task_id = result.task.id
            self.tasks[task_id] = ModelTask(
                task_id, request, self.now, self.now + deadline_s, n if dedup else None,
                max_attempts,
            )  # fmt: skip
        assert result.task.id == task_id
        if key is not None and outcome != "replayed":
            self.keys[key] = (request, task_id)

    # worker steps

    @rule(limit=st.integers(1, 3))
    def claim(self, limit: int) -> None:
        expected = self.claimable_due()[:limit]
        claimed = self.run(
            self.store.claim(worker_id="w", kinds=[KIND], limit=limit, lease_ttl_s=LEASE_TTL_S)
        )
        assert [t.id for t in claimed] == [t.id for t in expected]
        for task, model in zip(claimed, expected, strict=True):
            model.status = S.WAITING_FOR_RESOURCE
            model.attempt += 1
            model.epoch += 1
            model.lease_expires_at = self.now + LEASE_TTL_S
            model.state_deadline_at = self.now + TIMEOUTS.waiting_s
            assert (task.attempt, task.epoch) == (model.attempt, model.epoch)
            assert task.result_prefix == f"tasks/{task.id}/{model.attempt}-{model.epoch}"
            self.snapshots.append(task)

    def worker_step(
        self, model: ModelTask, event: Event, target: Status | None = None, **fields: Any
    ) -> Task:
        before = self.current(model.id)
        task = self.run(self.app.apply(before, event, target, fields=fields, fenced=True))
        assert (task.version, task.epoch) == (before.version + 1, before.epoch)
        if task.status in RUNNING:
            self.snapshots.append(task)
        return task

    @precondition(lambda self: bool(self.ids([S.WAITING_FOR_RESOURCE])))
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        model = self.pick(data, self.ids([S.WAITING_FOR_RESOURCE]))
        deadline = self.now + TIMEOUTS.generating_s
        self.worker_step(model, Event.ACQUIRE, state_deadline_at=deadline)
        model.status, model.state_deadline_at = S.GENERATING, deadline

    @precondition(lambda self: bool(self.ids([S.GENERATING])))
    @rule(data=st.data())
    def generated(self, data: st.DataObject) -> None:
        model = self.pick(data, self.ids([S.GENERATING]))
        deadline = self.now + TIMEOUTS.uploading_s
        self.worker_step(model, Event.GENERATED, state_deadline_at=deadline)
        model.status, model.state_deadline_at = S.UPLOADING, deadline

    @precondition(lambda self: bool(self.ids([S.UPLOADING])))
    @rule(data=st.data(), flagged=st.booleans())
    def uploaded(self, data: st.DataObject, flagged: bool) -> None:
        model = self.pick(data, self.ids([S.UPLOADING]))
        target = S.NEEDS_REVIEW if flagged else S.SUCCESS
        self.worker_step(model, Event.UPLOADED, target, result={"outputs": []})
        if flagged:
            model.status = S.NEEDS_REVIEW  # its lease fields are left as they were
        else:
            model.end_lease(S.SUCCESS)

    @precondition(lambda self: bool(self.ids([S.NEEDS_REVIEW])))
    @rule(data=st.data(), approve=st.booleans())
    def review(self, data: st.DataObject, approve: bool) -> None:
        model = self.pick(data, self.ids([S.NEEDS_REVIEW]))
        before = self.current(model.id)
        if approve:
            task = self.run(self.app.apply(before, Event.APPROVE, fields={"error": None}))
        else:
            error: JSON = {"code": "content_rejected", "message": "no", "retryable": False}
            task = self.run(
                self.app.apply(before, Event.REJECT, error=error, fields={"error": error})
            )
        assert task.status is (S.SUCCESS if approve else S.FAILED)
        model.end_lease(task.status)

    @precondition(lambda self: bool(self.ids(RUNNING)))
    @rule(data=st.data(), with_progress=st.booleans(), step=st.integers(0, 10))
    def heartbeat(self, data: st.DataObject, with_progress: bool, step: int) -> None:
        model = self.pick(data, self.ids(RUNNING))
        before = self.current(model.id)
        progress = Progress("denoise", step, 10) if with_progress else None
        task = self.run(self.store.heartbeat(model.id, model.epoch, LEASE_TTL_S, progress))
        model.lease_expires_at = self.now + LEASE_TTL_S
        assert task == self.current(model.id)
        assert task.lease_expires_at == model.lease_expires_at
        assert (task.version, task.status) == (before.version, before.status)
        if progress is not None:
            assert (task.stage, task.progress_step, task.progress_total) == ("denoise", step, 10)
            assert task.progress_at == self.now
        else:
            assert (task.stage, task.progress_step) == (before.stage, before.progress_step)

    @precondition(lambda self: bool(self.ids(RUNNING, lambda t: not t.cancel_requested_at)))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A stopping worker gives its attempt back uncounted (I9): PENDING, the attempt
        number back by one, epoch+1, its place in the queue kept."""
        model = self.pick(data, self.ids(RUNNING, lambda t: not t.cancel_requested_at))
        before = self.current(model.id)
        task = self.run(self.app.apply(
            before, Event.RELEASE, fenced=True, bump_epoch=True, fields=release_fields(before),
        ))  # fmt: skip
        model.attempt -= 1
        model.epoch += 1
        model.end_lease(S.PENDING)
        assert (task.status, task.attempt, task.epoch) == (S.PENDING, model.attempt, model.epoch)
        assert (task.ready_at, task.error) == (before.ready_at, before.error)
        assert task.lease_owner is None

    # failures and the retry policy

    def retry_outcomes(self, model: ModelTask, first: Status, retryable: bool) -> set[Status]:
        """What a failure may lead to: a scheduled retry only when the policy allows one."""
        if (
            not retryable
            or model.cancel_requested_at is not None  # the user asked it to stop
            or model.attempt >= model.max_attempts
            or model.deadline_at <= self.now
        ):
            return {first}
        if model.deadline_at - self.now > self.ceiling(model):
            return {S.RETRYING}
        return {first, S.RETRYING}

    @staticmethod
    def ceiling(model: ModelTask) -> float:
        return min(RETRY.max_s, RETRY.base_s * 2.0 ** max(model.attempt - 1, 0))

    def settle_failure(self, model: ModelTask, task: Task, outcomes: set[Status]) -> None:
        assert task.status in outcomes, (task.status, outcomes)
        model.end_lease(task.status)
        if task.status is S.RETRYING:
            assert self.now <= task.ready_at <= self.now + self.ceiling(model)
            assert task.ready_at < model.deadline_at
            assert task.next_retry_at == task.ready_at
            model.ready_at = task.ready_at

    @precondition(lambda self: bool(self.ids(RUNNING)))
    @rule(data=st.data(), retryable=st.booleans())
    def fail(self, data: st.DataObject, retryable: bool) -> None:
        model = self.pick(data, self.ids(RUNNING))
        outcomes = self.retry_outcomes(model, S.FAILED, retryable)
        error = {"code": "boom", "message": "it broke", "retryable": retryable}
        before = self.current(model.id)
        task = self.run(self.app.apply(before, Event.FAIL, fenced=True, retry_error=error))
        assert task.error == error
        self.settle_failure(model, task, outcomes)

    # supervisor actions

    @precondition(lambda self: bool(self.ids(RUNNING)))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        model = self.pick(data, self.ids(RUNNING))
        outcomes = self.retry_outcomes(model, S.TIMEOUT, True)
        error = {"code": "lease_expired", "message": "lapsed", "retryable": True}
        task = self.run(self.app.apply(
            self.current(model.id), Event.EXPIRE, bump_epoch=True, leader=self.leader(),
            retry_error=error,
        ))  # fmt: skip
        model.epoch += 1
        assert task.epoch == model.epoch
        self.settle_failure(model, task, outcomes)

    @precondition(lambda self: bool(self.ids([S.GENERATING, S.UPLOADING])))
    @rule(data=st.data())
    def recover(self, data: st.DataObject) -> None:
        model = self.pick(data, self.ids([S.GENERATING, S.UPLOADING]))
        task = self.run(self.app.apply(
            self.current(model.id), Event.RECOVER, bump_epoch=True, leader=self.leader(),
            fields={"result": {"outputs": []}},
        ))  # fmt: skip
        model.epoch += 1
        model.end_lease(S.SUCCESS)
        assert (task.status, task.epoch) == (S.SUCCESS, model.epoch)

    @precondition(lambda self: bool(self.ids(CLAIMABLE, lambda t: t.deadline_at < self.now)))
    @rule(data=st.data())
    def deadline(self, data: st.DataObject) -> None:
        model = self.pick(data, self.ids(CLAIMABLE, lambda t: t.deadline_at < self.now))
        error: JSON = {"code": "deadline_exceeded", "message": "late", "retryable": False}
        task = self.run(self.app.apply(
            self.current(model.id), Event.DEADLINE, leader=self.leader(), error=error,
            fields={"error": error},
        ))  # fmt: skip
        model.end_lease(S.TIMEOUT)
        assert task.status is S.TIMEOUT

    @precondition(lambda self: bool(self.ids(RUNNING, lambda t: bool(t.cancel_requested_at))))
    @rule(data=st.data(), by_worker=st.booleans())
    def stop_cancelled(self, data: st.DataObject, by_worker: bool) -> None:
        model = self.pick(data, self.ids(RUNNING, lambda t: bool(t.cancel_requested_at)))
        if by_worker:
            task = self.worker_step(model, Event.STOPPED)
        else:
            task = self.run(self.app.apply(
                self.current(model.id), Event.FORCE_CANCEL, bump_epoch=True,
                leader=self.leader(),
            ))  # fmt: skip
            model.epoch += 1
        model.end_lease(S.CANCELLED)
        assert (task.status, task.epoch) == (S.CANCELLED, model.epoch)

    @invariant()
    def due_is_what_the_model_says(self) -> None:
        due = self.run(self.store.due(limit=1000, cancel_grace_s=CANCEL_GRACE_S))
        running = [t for t in self.tasks.values() if t.status in RUNNING]
        # Each task is filed under one reason, in this order: deadline, lease, state.
        deadline = {
            t.id
            for t in self.tasks.values()
            if t.status in ACTIVE - {S.NEEDS_REVIEW} and t.deadline_at < self.now
        }
        lease = {
            t.id
            for t in running
            if t.lease_expires_at is not None and t.lease_expires_at < self.now
        }
        expected = {
            "lease": lease - deadline,
            "state": {t.id for t in running if t.state_deadline_at is not None
                      and t.state_deadline_at < self.now} - deadline - lease,
            "deadline": deadline,
            "cancel": {t.id for t in running if t.cancel_requested_at is not None
                       and t.cancel_requested_at < self.now - CANCEL_GRACE_S},
        }  # fmt: skip
        found = {
            "lease": due.lease_expired, "state": due.state_expired,
            "deadline": due.deadline_passed, "cancel": due.cancel_overdue,
        }  # fmt: skip
        for reason, tasks in found.items():
            assert {t.id for t in tasks} == expected[reason], reason
        ghosts = self.run(self.store.count_ghosts(older_than_s=0))
        assert ghosts == len(lease)

    # user actions

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        model = self.pick(data, sorted(self.tasks))
        try:
            task = self.run(self.app.cancel(model.id))
        except AlreadyFinal:
            assert model.status in FINAL
            return
        if model.status in RUNNING:
            if model.cancel_requested_at is None:
                model.cancel_requested_at = self.now
            assert (task.status, task.cancel_requested) == (model.status, True)
            assert task.cancel_requested_at == model.cancel_requested_at
        else:
            model.end_lease(S.CANCELLED)
            assert task.status is S.CANCELLED

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def manual_retry(self, data: st.DataObject) -> None:
        model = self.pick(data, sorted(self.tasks))
        try:
            task = self.run(self.app.retry(model.id))
        except NotRetryable:
            assert model.status not in NOT_LIVE
            return
        assert model.status in NOT_LIVE
        if model.dedup is not None and self.live_holder(model.dedup) is not None:
            model.dedup = None  # another live task holds the content: I5
        model.status = S.RETRYING
        model.max_attempts = max(model.max_attempts, model.attempt) + 1
        model.ready_at = self.now
        model.deadline_at = max(model.deadline_at, self.now + model.request.deadline_s)
        model.cancel_requested_at = None
        assert (task.status, task.max_attempts, task.ready_at, task.deadline_at) == (
            S.RETRYING, model.max_attempts, model.ready_at, model.deadline_at,
        )  # fmt: skip

    @invariant()
    def queue_positions_follow_the_claim_order(self) -> None:
        order = {t.id: i for i, t in enumerate(self.claimable_due(), start=1)}
        tasks, _ = self.run(self.store.list_tasks(tenant=TENANT, limit=1000))
        assert len(tasks) == len(self.tasks)
        for task in tasks:
            position = self.run(self.store.queue_position(task))
            assert position == order.get(task.id), task.id

    @rule(seconds=st.sampled_from([1.0, 5.0, 12.0, 50.0]))
    def advance_time(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # stale workers (I3)

    def stale(self) -> list[Task]:
        return [
            s for s in self.snapshots[-40:]
            if (self.tasks[s.id].status, self.tasks[s.id].epoch) != (s.status, s.epoch)
        ]  # fmt: skip

    def unchanged_after(self, task_id: str, write: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """``write`` is refused with LeaseLost, changes nothing and is counted."""
        before = self.current(task_id), self.run(self.store.events(task_id=task_id))
        refused = self.run(self.store.counters()).get(("stale_writes", ""), 0)
        try:
            self.run(write())
        except LeaseLost:
            pass
        else:
            raise AssertionError("a stale write was applied")
        after = self.current(task_id), self.run(self.store.events(task_id=task_id))
        assert after == before
        assert self.run(self.store.counters())[("stale_writes", "")] == refused + 1

    @precondition(lambda self: bool(self.stale()))
    @rule(data=st.data())
    def stale_write(self, data: st.DataObject) -> None:
        snapshot = data.draw(st.sampled_from(self.stale()), label="stale snapshot")
        event, target = data.draw(st.sampled_from(WORKER_WRITES[snapshot.status]), label="event")
        self.unchanged_after(
            snapshot.id, lambda: self.app.apply(snapshot, event, target, fenced=True)
        )

    @precondition(
        lambda self: any(
            s.epoch != self.tasks[s.id].epoch or self.tasks[s.id].status not in RUNNING
            for s in self.stale()
        )
    )
    @rule(data=st.data())
    def stale_heartbeat(self, data: st.DataObject) -> None:
        fenced_out = [
            s for s in self.stale()
            if s.epoch != self.tasks[s.id].epoch or self.tasks[s.id].status not in RUNNING
        ]  # fmt: skip
        snapshot = data.draw(st.sampled_from(fenced_out), label="stale snapshot")
        self.unchanged_after(
            snapshot.id,
            lambda: self.store.heartbeat(snapshot.id, snapshot.epoch, LEASE_TTL_S, None),
        )

    # invariants

    @invariant()
    def tasks_match_the_model(self) -> None:
        rows = self.sql(
            "SELECT id, status, attempt, max_attempts, epoch, dedup_key, lease_owner,"
            " lease_expires_at, state_deadline_at, finished_at, cancel_requested, ready_at,"
            " deadline_at FROM tasks"
        )
        assert {row[0] for row in rows} == set(self.tasks)  # I1: nothing lost, nothing extra
        for task_id, status, attempt, max_attempts, epoch, dedup, owner, *rest in rows:
            model = self.tasks[task_id]
            assert Status(status) is model.status, task_id
            assert (attempt, max_attempts, epoch) == (model.attempt, model.max_attempts,
                                                      model.epoch)  # fmt: skip
            assert attempt <= max_attempts  # I7
            assert dedup == (None if model.dedup is None else DEDUP_KEYS[model.dedup])
            lease_expires_at, state_deadline_at, finished_at, cancel_requested, *times = rest
            assert times == [model.ready_at, model.deadline_at]
            assert bool(cancel_requested) == (model.cancel_requested_at is not None)
            assert (finished_at is not None) == (model.status in FINAL)  # I1
            if model.status in RUNNING:
                assert owner is not None
                assert (lease_expires_at, state_deadline_at) == (
                    model.lease_expires_at, model.state_deadline_at,
                )  # fmt: skip
            elif model.status is not S.NEEDS_REVIEW:
                assert (owner, lease_expires_at, state_deadline_at) == (None, None, None)

    @invariant()
    def keys_and_content_are_unique(self) -> None:
        assert not self.sql(  # I5
            "SELECT tenant, idempotency_key FROM tasks WHERE idempotency_key IS NOT NULL"
            " GROUP BY tenant, idempotency_key HAVING COUNT(*) > 1"
        )
        assert not self.sql(  # I5
            "SELECT tenant, dedup_key FROM tasks WHERE dedup_key IS NOT NULL"
            " AND status NOT IN ('FAILED', 'TIMEOUT', 'CANCELLED')"
            " GROUP BY tenant, dedup_key HAVING COUNT(*) > 1"
        )
        keys = dict(self.sql("SELECT key, task_id FROM idempotency_keys WHERE tenant = ?",
                             TENANT))  # fmt: skip
        assert keys == {key: task_id for key, (_, task_id) in self.keys.items()}

    @invariant()
    def the_log_is_the_truth(self) -> None:
        events = self.sql(
            "SELECT task_id, id, event, from_status, to_status, final FROM events ORDER BY seq"
        )
        assert len({row[1] for row in events}) == len(events)  # I6: unique event ids
        logs: dict[str, list[tuple[Event, Status | None, Status]]] = defaultdict(list)
        finals: dict[str, bool] = {}
        for task_id, _, event, source, target, final in events:
            logs[task_id].append((Event(event), source and Status(source), Status(target)))
            finals[task_id] = bool(final)
        versions = dict(self.sql("SELECT id, version FROM tasks"))
        for task_id, model in self.tasks.items():
            assert replay(logs[task_id]) is model.status, task_id  # I6
            assert len(logs[task_id]) == versions[task_id]  # one event per status change
            assert finals[task_id] == (model.status in FINAL)

    @invariant()
    def queue_counts_agree_with_the_table(self) -> None:
        kept, recounted = kept_and_recounted(self.db)
        assert kept == recounted

    @invariant()
    def stats_agree_with_the_table(self) -> None:
        stats = self.run(self.store.stats(tenant=None, ghost_after_s=0))
        counted = Counter(t.status for t in self.tasks.values())
        assert stats.counts == {str(s): counted.get(s, 0) for s in Status}
        assert self.app.engine.illegal_transitions == 0


def test_store_and_engine_follow_the_model(
    backend: Backend, tmp_path_factory: pytest.TempPathFactory, clock: SettableClock
) -> None:
    class OnFreshStore(StoreMachine):
        def __init__(self) -> None:
            super().__init__(backend, tmp_path_factory.mktemp("model"), clock)

    run_state_machine_as_test(
        OnFreshStore,
        settings=settings(max_examples=50, stateful_step_count=40, deadline=None, database=None),
    )
