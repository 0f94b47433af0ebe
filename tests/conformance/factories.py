"""Small factories for the store conformance suite: submissions and status changes."""

from __future__ import annotations

from typing import Any, Protocol

from kiln import canonical
from kiln.models import JSON, NewTask, Task, Timeouts
from kiln.states import FINAL, Event, Status, check
from kiln.store import Change, Store
from kiln.store.effects import Counted
from kiln.store.records import Fence

KIND = "conformance.job"


class SettableClock(Protocol):
    """The fake clock of tests/conftest.py: callable, with a settable ``now``."""

    now: float

    def __call__(self) -> float: ...

    def advance(self, seconds: float) -> None: ...


def make_new_task(
    params: JSON | None = None,
    *,
    kind: str = KIND,
    tenant: str = "acme",
    idempotency_key: str | None = None,
    dedup: bool = True,
    priority: int = 0,
    max_attempts: int = 3,
    deadline_s: float = 3600.0,
    timeouts: Timeouts | None = None,
) -> NewTask:
    """A submission with the canonical fingerprint and dedup key of its body."""
    params = {"prompt": "a red fox"} if params is None else params
    timeouts = timeouts or Timeouts()
    body = {
        "kind": kind,
        "params": params,
        "priority": priority,
        "max_attempts": max_attempts,
        "deadline_s": deadline_s,
        "dedup": dedup,
        "timeouts": [timeouts.waiting_s, timeouts.generating_s, timeouts.uploading_s],
    }
    return NewTask(
        id=canonical.new_task_id(),
        tenant=tenant,
        kind=kind,
        params=params,
        fingerprint=canonical.digest(body),
        idempotency_key=idempotency_key,
        dedup_key=canonical.dedup_key(kind, params, []) if dedup else None,
        priority=priority,
        max_attempts=max_attempts,
        deadline_s=deadline_s,
        timeouts=timeouts,
    )


def step_change(
    task: Task,
    *events: Event | tuple[Event, Status],
    fenced: bool = True,
    bump_epoch: bool = False,
    fields: dict[str, Any] | None = None,
    error: JSON | None = None,
    counters: tuple[tuple[str, str], ...] = (),
) -> Change:
    """A Change applying ``events`` in a chain from the task as read.

    An event is given alone when it has a single target, or as ``(event, target)``.
    Leases are dropped when the chain ends in a final or claimable status, as the engine
    does.
    """
    steps: list[tuple[Event, Status]] = []
    status = task.status
    for item in events:
        event, target = item if isinstance(item, tuple) else (item, None)
        status = check(status, event, target)
        steps.append((event, status))
    changes = dict(fields or {})
    if status in FINAL or status in (Status.PENDING, Status.RETRYING):
        changes.update(lease_owner=None, lease_expires_at=None, state_deadline_at=None)
    return Change(
        task_id=task.id,
        expect_status=task.status,
        expect_epoch=task.epoch if fenced else None,
        steps=tuple(steps),
        fields=changes,
        error=error,
        fence=Fence(fenced=fenced, bump=bump_epoch),
        effects=(Counted(counters),) if counters else (),
    )


async def claim_one(store: Store, kind: str = KIND, lease_ttl_s: float = 30.0) -> Task:
    claimed = await store.claim(worker_id="w-1", kinds=[kind], limit=1, lease_ttl_s=lease_ttl_s)
    assert len(claimed) == 1, f"expected one claimable task of kind {kind}, got {claimed}"
    return claimed[0]


async def drive(store: Store, new: NewTask, status: Status, lease_ttl_s: float = 30.0) -> Task:
    """Submit ``new`` and move it to ``status`` the way a worker and the engine would.

    The task must be the only claimable one of its kind.
    """
    task = (await store.submit(new)).task
    if status is Status.PENDING:
        return task
    if status is Status.CANCELLED:
        return (await store.apply(step_change(task, Event.CANCEL, fenced=False)))[0]
    task = await claim_one(store, new.kind, lease_ttl_s)
    assert task.id == new.id, "another task of this kind was claimed first"
    route: dict[Status, list[Any]] = {
        Status.WAITING_FOR_RESOURCE: [],
        Status.GENERATING: [Event.ACQUIRE],
        Status.UPLOADING: [Event.ACQUIRE, Event.GENERATED],
        Status.SUCCESS: [Event.ACQUIRE, Event.GENERATED, (Event.UPLOADED, Status.SUCCESS)],
        Status.NEEDS_REVIEW: [
            Event.ACQUIRE,
            Event.GENERATED,
            (Event.UPLOADED, Status.NEEDS_REVIEW),
        ],
        Status.FAILED: [Event.FAIL],
        Status.TIMEOUT: [Event.EXPIRE],
        Status.RETRYING: [[Event.FAIL, Event.SCHEDULE_RETRY]],
    }
    for step in route[status]:
        chain = step if isinstance(step, list) else [step]
        fields = {"ready_at": store.clock(), "next_retry_at": store.clock()}
        change = step_change(
            task,
            *chain,
            bump_epoch=step is Event.EXPIRE,
            fields=fields if Event.SCHEDULE_RETRY in chain else None,
        )
        task = (await store.apply(change))[0]
    assert task.status is status
    return task
