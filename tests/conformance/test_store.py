"""The Store's guarantees, run against every backend (conftest.py's ``store``).

Submission is insert-or-get (I5), every write is a compare-and-set fenced by the lease
epoch (I3) that appends one event row per status change in the same transaction (I6),
claims follow priority then ready time, and the supervisor's ``due`` finds exactly what
is due.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

import kiln
from kiln.errors import Conflict, IdempotencyKeyReused, LeaseLost
from kiln.models import Task, TaskEvent, Timeouts
from kiln.states import Event, Status, replay
from kiln.store import Progress, Store

from .backends import Backend, Row
from .factories import KIND, SettableClock, claim_one, drive, make_new_task, step_change

pytestmark = [pytest.mark.usefixtures("queue_counts_checked"), pytest.mark.submit_process]

Truth = Callable[..., list[Row]]
S = Status
LIVE_OR_SUCCESSFUL = [
    S.PENDING,
    S.WAITING_FOR_RESOURCE,
    S.GENERATING,
    S.UPLOADING,
    S.NEEDS_REVIEW,
    S.RETRYING,
    S.SUCCESS,
]


async def state_of(store: Store, task_id: str) -> tuple[Task | None, list[TaskEvent]]:
    return await store.get(task_id), await store.events(task_id=task_id)


async def counter(store: Store, name: str, labels: str = "") -> int:
    return (await store.counters()).get((name, labels), 0)


# submit: insert-or-get ---------------------------------------------------------------------


async def test_same_idempotency_key_and_body_replays_the_same_task(
    store: Store, truth: Truth
) -> None:
    # Given a task submitted with an idempotency key
    first = await store.submit(make_new_task(idempotency_key="key-1"))
    # When the same request comes again (a new id is proposed, the body is the same)
    again = await store.submit(make_new_task(idempotency_key="key-1"))
    # Then the first task is answered and nothing new is stored
    assert (first.created, first.replayed) == (True, False)
    assert (again.created, again.replayed, again.deduplicated) == (False, True, False)
    assert again.task.id == first.task.id
    assert truth("SELECT COUNT(*) FROM tasks") == [(1,)]
    assert truth("SELECT COUNT(*) FROM events") == [(1,)]
    assert await counter(store, "dedup_hits", "idempotency") == 1


async def test_idempotency_key_with_a_different_body_is_refused_and_stores_nothing(
    store: Store, truth: Truth
) -> None:
    # Given a task submitted with an idempotency key
    first = await store.submit(make_new_task({"prompt": "a"}, idempotency_key="key-1"))
    # When the key comes back with another body (with or without dedup)
    for dedup in (True, False):
        with pytest.raises(IdempotencyKeyReused):
            await store.submit(make_new_task({"prompt": "b"}, idempotency_key="key-1", dedup=dedup))
    # Then nothing was stored and the key still names the first task with its body
    assert truth("SELECT id FROM tasks") == [(first.task.id,)]
    assert truth("SELECT COUNT(*) FROM events") == [(1,)]
    assert truth("SELECT fingerprint, task_id FROM idempotency_keys") == [
        (first.task.fingerprint, first.task.id)
    ]


@pytest.mark.parametrize("status", LIVE_OR_SUCCESSFUL)
async def test_dedup_hit_on_a_live_or_successful_task_returns_it(
    store: Store, truth: Truth, status: Status
) -> None:
    # Given a task with the same content that is live or successful
    existing = await drive(store, make_new_task(), status)
    # When the same content is submitted again without a key
    result = await store.submit(make_new_task())
    # Then the existing task is answered
    assert (result.created, result.deduplicated, result.replayed) == (False, True, False)
    assert result.task.id == existing.id
    assert result.task.status is status
    assert truth("SELECT COUNT(*) FROM tasks") == [(1,)]
    assert await counter(store, "dedup_hits", "content") == 1


@pytest.mark.parametrize("status", [S.FAILED, S.TIMEOUT, S.CANCELLED])
async def test_submission_after_an_unsuccessful_end_creates_a_new_task(
    store: Store, truth: Truth, status: Status
) -> None:
    # Given a task with the same content that ended without success
    old = await drive(store, make_new_task(), status)
    # When the content is submitted again
    fresh = await store.submit(make_new_task())
    # Then a new task is created, and it is the one later submissions meet
    assert fresh.created
    assert fresh.task.id != old.id
    assert fresh.task.dedup_key == old.dedup_key
    later = await store.submit(make_new_task())
    assert (later.deduplicated, later.task.id) == (True, fresh.task.id)
    assert truth("SELECT COUNT(*) FROM tasks") == [(2,)]


async def test_new_idempotency_key_on_a_dedup_hit_points_at_that_task(
    store: Store, truth: Truth
) -> None:
    # Given a task submitted without a key
    original = (await store.submit(make_new_task())).task
    # When the same content comes with a new key
    hit = await store.submit(make_new_task(idempotency_key="key-2"))
    # Then the key is recorded as pointing at the existing task
    assert (hit.deduplicated, hit.task.id) == (True, original.id)
    assert truth("SELECT task_id FROM idempotency_keys WHERE tenant = ? AND key = ?",
                 "acme", "key-2") == [(original.id,)]  # fmt: skip
    # And the key keeps answering with that task, even once it failed
    claimed = await claim_one(store)
    await store.apply(step_change(claimed, Event.FAIL))
    replayed = await store.submit(make_new_task(idempotency_key="key-2"))
    assert (replayed.replayed, replayed.task.id) == (True, original.id)
    assert replayed.task.status is S.FAILED
    # And the key is bound to the new request's body
    with pytest.raises(IdempotencyKeyReused):
        await store.submit(make_new_task({"prompt": "other"}, idempotency_key="key-2"))


async def test_keys_and_content_are_scoped_to_the_tenant(store: Store, truth: Truth) -> None:
    a = await store.submit(make_new_task(tenant="acme", idempotency_key="k"))
    b = await store.submit(make_new_task(tenant="globex", idempotency_key="k"))
    assert a.created and b.created
    assert a.task.id != b.task.id
    assert truth("SELECT COUNT(*) FROM idempotency_keys") == [(2,)]


async def test_submission_without_dedup_creates_a_second_task(engine: kiln.App) -> None:
    first = await engine.submit(KIND, {"prompt": "x"})
    second = await engine.submit(KIND, {"prompt": "x"}, dedup=False)
    same = await engine.submit(KIND, {"prompt": "x"})
    assert first.created and second.created
    assert second.task.id != first.task.id
    assert second.task.dedup_key is None
    assert (same.deduplicated, same.task.id) == (True, first.task.id)


async def test_manual_retry_gives_up_a_dedup_key_another_live_task_holds(
    store: Store, engine: kiln.App, truth: Truth
) -> None:
    # Given a failed task and a live task with the same content submitted after it
    failed = await drive(store, make_new_task(), S.FAILED)
    live = (await store.submit(make_new_task())).task
    assert live.id != failed.id
    # When the failed task is retried by hand
    revived = await engine.retry(failed.id)
    # Then it runs again without the dedup key, which stays with the live task
    assert revived.status is S.RETRYING
    assert revived.dedup_key is None
    assert (await store.submit(make_new_task())).task.id == live.id
    assert truth(
        "SELECT COUNT(*) FROM tasks WHERE dedup_key IS NOT NULL"
        " AND status NOT IN ('FAILED', 'TIMEOUT', 'CANCELLED')"
    ) == [(1,)]


async def test_manual_retry_keeps_the_dedup_key_when_nobody_else_holds_it(
    store: Store, engine: kiln.App
) -> None:
    failed = await drive(store, make_new_task(), S.FAILED)
    revived = await engine.retry(failed.id)
    assert revived.dedup_key == failed.dedup_key
    assert (await store.submit(make_new_task())).task.id == failed.id


# fenced compare-and-set ----------------------------------------------------------------------


async def _moved_on(store: Store, clock: SettableClock) -> tuple[Task, Task]:
    """A task claimed at epoch 1, expired by the supervisor and claimed again (epoch 3)."""
    first = await drive(store, make_new_task(), S.WAITING_FOR_RESOURCE)
    expired = step_change(
        first, Event.EXPIRE, Event.SCHEDULE_RETRY, fenced=False, bump_epoch=True,
        fields={"ready_at": clock(), "next_retry_at": clock()},
    )  # fmt: skip
    await store.apply(expired)
    current = await claim_one(store)
    assert (current.status, current.epoch) == (S.WAITING_FOR_RESOURCE, 3)
    return first, current


@pytest.mark.parametrize("event", [Event.ACQUIRE, Event.FAIL, Event.STOPPED])
async def test_stale_epoch_write_is_refused_and_changes_nothing(
    store: Store, clock: SettableClock, event: Event
) -> None:
    # Given a worker holding epoch 1 while the task runs again at epoch 3, same status
    stale, current = await _moved_on(store, clock)
    before = await state_of(store, current.id)
    stale_writes = await counter(store, "stale_writes")
    # When the old worker writes
    with pytest.raises(LeaseLost):
        await store.apply(step_change(stale, event))
    # Then the row and its events are unchanged, and the refusal is counted
    assert await state_of(store, current.id) == before
    assert await counter(store, "stale_writes") == stale_writes + 1


async def test_fenced_write_on_a_finished_task_is_refused(store: Store) -> None:
    held = await drive(store, make_new_task(), S.GENERATING)
    await store.apply(step_change(held, Event.EXPIRE, fenced=False, bump_epoch=True))
    before = await state_of(store, held.id)
    with pytest.raises(LeaseLost):
        await store.apply(step_change(held, Event.GENERATED))
    assert await state_of(store, held.id) == before


async def test_unfenced_change_on_a_moved_task_raises_conflict(store: Store) -> None:
    # Given a cancel prepared from a PENDING read, and a worker claiming the task first
    pending = (await store.submit(make_new_task())).task
    cancel = step_change(pending, Event.CANCEL, fenced=False)
    await claim_one(store)
    before = await state_of(store, pending.id)
    # When the cancel is applied
    with pytest.raises(Conflict):
        await store.apply(cancel)
    # Then nothing changed, and it is not counted as a stale worker write
    assert await state_of(store, pending.id) == before
    assert await counter(store, "stale_writes") == 0


async def test_every_applied_step_appends_one_event_row(store: Store) -> None:
    # Given a task taken through its whole happy path
    task = await drive(store, make_new_task(), S.SUCCESS)
    events = await store.events(task_id=task.id)
    # Then there is one event per status change, in order, unique, the last one final
    assert [e.event for e in events] == [
        Event.SUBMIT, Event.CLAIM, Event.ACQUIRE, Event.GENERATED, Event.UPLOADED,
    ]  # fmt: skip
    assert len(events) == task.version
    assert len({e.id for e in events}) == len(events)
    assert [e.seq for e in events] == sorted({e.seq for e in events})
    assert replay((e.event, e.from_status, e.status) for e in events) is S.SUCCESS
    assert [e.final for e in events] == [False] * 4 + [True]


async def test_fail_and_schedule_retry_in_one_change_write_two_events(store: Store) -> None:
    # Given a claimed task
    claimed = await drive(store, make_new_task(), S.WAITING_FOR_RESOURCE)
    # When it fails and its retry is scheduled in one change
    change = step_change(
        claimed, Event.FAIL, Event.SCHEDULE_RETRY,
        fields={"ready_at": 1.0, "next_retry_at": 1.0}, error={"code": "boom"},
    )  # fmt: skip
    task, events = await store.apply(change)
    # Then two events are written, one after the other, and neither is final
    assert [(e.event, e.from_status, e.status, e.final) for e in events] == [
        (Event.FAIL, S.WAITING_FOR_RESOURCE, S.FAILED, False),
        (Event.SCHEDULE_RETRY, S.FAILED, S.RETRYING, False),
    ]
    assert events[1].seq > events[0].seq
    assert task.version == claimed.version + 2
    assert (await store.events(task_id=task.id))[-2:] == events


async def test_fail_without_retry_writes_one_final_event(store: Store) -> None:
    claimed = await drive(store, make_new_task(), S.GENERATING)
    task, events = await store.apply(step_change(claimed, Event.FAIL))
    assert [(e.event, e.status, e.final) for e in events] == [(Event.FAIL, S.FAILED, True)]
    assert task.finished_at is not None


async def test_change_and_its_event_rows_commit_together(
    store: Store, backend: Backend, truth: Truth
) -> None:
    # Given a claimed task whose next event id is already taken in the log
    claimed = await drive(store, make_new_task(), S.WAITING_FOR_RESOURCE)
    taken = f"{claimed.id}:{claimed.version + 1}"
    backend.execute(
        store,
        "INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
        " attempt, epoch, error, at, dwell_s) VALUES (?, 'other', 'acme', 'claim', NULL,"
        " 'PENDING', false, 0, 0, NULL, 0, NULL)",
        [taken],
    )
    before = await store.get(claimed.id)
    # When a change needs that event id
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        await store.apply(step_change(claimed, Event.ACQUIRE))
    # Then the task row did not change either
    assert await store.get(claimed.id) == before
    assert truth("SELECT COUNT(*) FROM events WHERE task_id = ?", claimed.id) == [(2,)]
    # And once the log is clear the same change applies
    backend.execute(store, "DELETE FROM events WHERE id = ? AND task_id = 'other'", [taken])
    task, _ = await store.apply(step_change(claimed, Event.ACQUIRE))
    assert task.status is S.GENERATING


# claim -------------------------------------------------------------------------------------


async def test_claim_order_is_priority_then_ready_time(store: Store, clock: SettableClock) -> None:
    # Given tasks of two priorities submitted one second apart
    ids: dict[str, str] = {}
    for name, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 5)]:
        ids[name] = (await store.submit(make_new_task({"n": name}, priority=priority))).task.id
        clock.advance(1)
    # Then their queue positions follow the claim order
    expected = [ids[n] for n in "bdac"]
    for position, task_id in enumerate(expected, start=1):
        task = await store.get(task_id)
        assert task is not None
        assert await store.queue_position(task) == position
    # And claims one at a time come in that order
    claimed = [(await claim_one(store)).id for _ in expected]
    assert claimed == expected
    assert await store.claim(worker_id="w", kinds=[KIND], limit=5, lease_ttl_s=30) == []


async def test_retrying_task_is_claimed_only_when_due(store: Store, clock: SettableClock) -> None:
    # Given a task whose retry is due in 10 s
    claimed = await drive(store, make_new_task(), S.WAITING_FOR_RESOURCE)
    due = clock() + 10
    retrying, _ = await store.apply(
        step_change(claimed, Event.FAIL, Event.SCHEDULE_RETRY,
                    fields={"ready_at": due, "next_retry_at": due})
    )  # fmt: skip
    # Then it is neither claimed nor queued before then
    clock.advance(9.9)
    assert await store.claim(worker_id="w", kinds=[KIND], limit=5, lease_ttl_s=30) == []
    assert await store.queue_position(retrying) is None
    # And it is claimed once due, for its second attempt
    clock.advance(0.1)
    assert await store.queue_position(retrying) == 1
    again = await claim_one(store)
    assert (again.id, again.attempt, again.next_retry_at) == (claimed.id, 2, None)


async def test_due_retry_is_claimed_before_a_later_submission(
    store: Store, clock: SettableClock
) -> None:
    retried = await drive(store, make_new_task({"n": 1}), S.RETRYING)
    clock.advance(1)
    later = (await store.submit(make_new_task({"n": 2}))).task
    assert [(await claim_one(store)).id for _ in range(2)] == [retried.id, later.id]


async def test_batch_claim_returns_distinct_tasks(store: Store) -> None:
    submitted = {(await store.submit(make_new_task({"n": i}))).task.id for i in range(10)}
    first = await store.claim(worker_id="w-1", kinds=[KIND], limit=4, lease_ttl_s=30)
    rest = await store.claim(worker_id="w-2", kinds=[KIND], limit=10, lease_ttl_s=30)
    assert len(first) == 4
    assert len(rest) == 6
    assert {t.id for t in first} | {t.id for t in rest} == submitted
    assert {t.status for t in [*first, *rest]} == {S.WAITING_FOR_RESOURCE}
    assert await store.claim(worker_id="w-3", kinds=[KIND], limit=10, lease_ttl_s=30) == []


async def test_claimed_task_gets_attempt_epoch_lease_and_result_location(
    store: Store, clock: SettableClock
) -> None:
    # Given a submitted task
    new = make_new_task(timeouts=Timeouts(waiting_s=15))
    await store.submit(new)
    clock.advance(2)
    # When a worker claims it
    task = await claim_one(store, lease_ttl_s=30)
    # Then it holds a lease for its first attempt, and its result location is reserved
    now = clock()
    assert (task.status, task.attempt, task.epoch) == (S.WAITING_FOR_RESOURCE, 1, 1)
    assert (task.lease_owner, task.lease_expires_at) == ("w-1", now + 30)
    assert task.state_deadline_at == now + 15
    assert task.result_prefix == f"tasks/{task.id}/1-1"
    assert task.started_at == now
    # And after the supervisor expired it and it was claimed again, both numbers moved on
    await store.apply(
        step_change(task, Event.EXPIRE, Event.SCHEDULE_RETRY, fenced=False, bump_epoch=True,
                    fields={"ready_at": now, "next_retry_at": now})
    )  # fmt: skip
    again = await claim_one(store)
    assert (again.attempt, again.epoch) == (2, 3)
    assert again.result_prefix == f"tasks/{task.id}/2-3"
    assert again.started_at == now


async def test_claim_acquires_at_once_the_kinds_that_wait_for_nothing(
    store: Store, clock: SettableClock
) -> None:
    # Given a task of a kind that takes no resource and one of a kind that waits for one
    plain = await store.submit(make_new_task(kind="kind.a", timeouts=Timeouts(generating_s=40)))
    pooled = await store.submit(make_new_task(kind="kind.b", timeouts=Timeouts(waiting_s=15)))
    before = await store.stats(tenant=None, ghost_after_s=60)
    clock.advance(2)
    # When one claim takes both, acquiring the first kind's tasks at once
    claimed = await store.claim(worker_id="w-1", kinds=["kind.a", "kind.b"], limit=5,
                                lease_ttl_s=30, acquire=["kind.a", "kind.c"])  # fmt: skip
    now = clock()
    by_id = {t.id: t for t in claimed}
    acquired, waiting = by_id[plain.task.id], by_id[pooled.task.id]
    # Then the first is GENERATING with its state deadline, two versions on, both events
    # written (the wait recorded as zero); the second waits for its resource as before
    assert (acquired.status, acquired.attempt, acquired.epoch) == (S.GENERATING, 1, 1)
    assert acquired.version == plain.task.version + 2
    assert acquired.state_deadline_at == now + 40 and acquired.status_since == now
    assert (acquired.lease_owner, acquired.lease_expires_at) == ("w-1", now + 30)
    assert acquired.result_prefix == f"tasks/{acquired.id}/1-1"
    task, events = await state_of(store, acquired.id)
    assert task == acquired
    assert [(e.event, e.from_status, e.status, e.dwell_s) for e in events] == [
        (Event.SUBMIT, None, S.PENDING, None),
        (Event.CLAIM, S.PENDING, S.WAITING_FOR_RESOURCE, 2.0),
        (Event.ACQUIRE, S.WAITING_FOR_RESOURCE, S.GENERATING, 0.0),
    ]
    assert [e.id for e in events[1:]] == [
        f"{task.id}:{v}" for v in (task.version - 1, task.version)
    ]
    assert replay((e.event, e.from_status, e.status) for e in events) is S.GENERATING
    assert (waiting.status, waiting.state_deadline_at) == (S.WAITING_FOR_RESOURCE, now + 15)
    assert waiting.version == pooled.task.version + 1
    # And counts and counters say the same
    after = await store.stats(tenant=None, ghost_after_s=60)
    assert after.counts["PENDING"] == before.counts["PENDING"] - 2
    assert after.counts["GENERATING"] == before.counts["GENERATING"] + 1
    assert after.counts["WAITING_FOR_RESOURCE"] == before.counts["WAITING_FOR_RESOURCE"] + 1
    assert await counter(store, "transitions", "PENDING>WAITING_FOR_RESOURCE") == 2
    assert await counter(store, "transitions", "WAITING_FOR_RESOURCE>GENERATING") == 1
    # And the acquired task goes on as any other: its worker's next step is fenced as usual
    moved, _ = await store.apply(step_change(acquired, Event.GENERATED))
    assert moved.status is S.UPLOADING


async def test_task_past_its_deadline_is_not_claimed(store: Store, clock: SettableClock) -> None:
    late = (await store.submit(make_new_task({"n": 1}, deadline_s=10))).task
    clock.advance(10)
    assert await store.claim(worker_id="w", kinds=[KIND], limit=5, lease_ttl_s=30) == []
    assert await store.queue_position(late) is None
    fresh = (await store.submit(make_new_task({"n": 2}))).task
    assert await store.queue_position(fresh) == 1
    assert (await claim_one(store)).id == fresh.id


async def test_claim_serves_only_the_requested_kinds(store: Store) -> None:
    await store.submit(make_new_task(kind="kind.a", priority=0))
    wanted = (await store.submit(make_new_task(kind="kind.b"))).task
    claimed = await store.claim(worker_id="w", kinds=["kind.b", "kind.c"], limit=5,
                                lease_ttl_s=30)  # fmt: skip
    assert [t.id for t in claimed] == [wanted.id]


# heartbeat -----------------------------------------------------------------------------------


async def test_heartbeat_extends_the_lease_and_persists_progress(
    store: Store, clock: SettableClock
) -> None:
    # Given a generating task
    task = await drive(store, make_new_task(), S.GENERATING, lease_ttl_s=30)
    events = await store.events(task_id=task.id)
    clock.advance(20)
    # When its worker beats with progress
    beat = await store.heartbeat(task.id, task.epoch, 30, Progress("denoise", 3, 10))
    # Then the lease runs from now and the progress is saved, with no status change
    stored = await store.get(task.id)
    assert stored == beat
    assert beat.lease_expires_at == clock() + 30
    assert (beat.stage, beat.progress_step, beat.progress_total) == ("denoise", 3, 10)
    assert beat.progress_at == clock()
    assert (beat.status, beat.version) == (S.GENERATING, task.version)
    assert await store.events(task_id=task.id) == events
    # And a beat without progress keeps the saved progress
    clock.advance(1)
    plain = await store.heartbeat(task.id, task.epoch, 30, None)
    assert (plain.progress_step, plain.lease_expires_at) == (3, clock() + 30)
    # And both renewals are counted, for kiln_lease_renewals_total
    assert await counter(store, "lease_renewals") == 2


async def test_heartbeat_with_a_stale_epoch_is_refused(store: Store, clock: SettableClock) -> None:
    stale, current = await _moved_on(store, clock)
    before = await state_of(store, current.id)
    with pytest.raises(LeaseLost):
        await store.heartbeat(stale.id, stale.epoch, 30, Progress("x", 1, 2))
    assert await state_of(store, current.id) == before
    assert await counter(store, "stale_writes") == 1
    assert await counter(store, "lease_renewals") == 0


async def test_heartbeat_on_a_task_that_left_running_is_refused(store: Store) -> None:
    task = await drive(store, make_new_task(), S.GENERATING)
    await store.apply(step_change(task, Event.FAIL))
    with pytest.raises(LeaseLost):
        await store.heartbeat(task.id, task.epoch, 30, None)


# supervisor: what is due -----------------------------------------------------------------------


async def _running(store: Store, name: str, *, lease_ttl_s: float, waiting_s: float) -> Task:
    new = make_new_task({"n": name}, kind=f"kind.{name}", timeouts=Timeouts(waiting_s=waiting_s))
    return await drive(store, new, S.WAITING_FOR_RESOURCE, lease_ttl_s=lease_ttl_s)


async def test_due_finds_exactly_what_the_supervisor_must_act_on(
    store: Store, clock: SettableClock
) -> None:
    # Given one task due for each reason, and others that are not due
    lease = await _running(store, "lease", lease_ttl_s=5, waiting_s=1000)
    state = await _running(store, "state", lease_ttl_s=1000, waiting_s=5)
    cancel = await _running(store, "cancel", lease_ttl_s=1000, waiting_s=1000)
    await _running(store, "healthy", lease_ttl_s=1000, waiting_s=1000)
    recent = await _running(store, "recent", lease_ttl_s=1000, waiting_s=1000)
    late = (await store.submit(make_new_task({"n": "late"}, kind="kind.x", deadline_s=5))).task
    await store.submit(make_new_task({"n": "fine"}, kind="kind.x", deadline_s=1000))
    done = await drive(store, make_new_task({"n": "done"}, kind="kind.y", deadline_s=5),
                       S.CANCELLED)  # fmt: skip
    review = await drive(store, make_new_task({"n": "review"}, kind="kind.z"), S.NEEDS_REVIEW,
                         lease_ttl_s=5)  # fmt: skip
    gave_up = await _running(store, "gave_up", lease_ttl_s=5, waiting_s=5)
    asked = await store.request_cancel(gave_up.id)
    await store.apply(step_change(asked, Event.FAIL))  # ended before it saw the request
    await store.request_cancel(cancel.id)
    clock.advance(9)
    await store.request_cancel(recent.id)
    clock.advance(1)
    # When the supervisor asks what is due (10 s later, grace 3 s)
    due = await store.due(limit=100, cancel_grace_s=3)
    # Then each list holds exactly its task
    assert [t.id for t in due.lease_expired] == [lease.id]
    assert [t.id for t in due.state_expired] == [state.id]
    assert [t.id for t in due.deadline_passed] == [late.id]
    assert [t.id for t in due.cancel_overdue] == [cancel.id]
    assert done.id not in {t.id for t in due.deadline_passed}
    assert review.id not in {t.id for t in due.lease_expired + due.state_expired}
    # And the ghost count sees the lapsed lease only once it is older than asked
    assert await store.count_ghosts(older_than_s=0) == 1
    assert await store.count_ghosts(older_than_s=5) == 0


async def test_due_includes_running_tasks_past_their_deadline(
    store: Store, clock: SettableClock
) -> None:
    new = make_new_task(deadline_s=5)
    running = await drive(store, new, S.GENERATING, lease_ttl_s=1000)
    clock.advance(6)
    due = await store.due(limit=100, cancel_grace_s=3)
    assert [t.id for t in due.deadline_passed] == [running.id]
    assert due.lease_expired == due.state_expired == due.cancel_overdue == []


async def test_due_respects_the_limit_and_orders_by_expiry(
    store: Store, clock: SettableClock
) -> None:
    tasks = []
    for i in range(5):
        tasks.append(await _running(store, f"t{i}", lease_ttl_s=1 + i, waiting_s=1000))
    clock.advance(100)
    due = await store.due(limit=3, cancel_grace_s=3)
    assert [t.id for t in due.lease_expired] == [t.id for t in tasks[:3]]


# stats ---------------------------------------------------------------------------------------


async def test_stats_agree_with_the_tasks_table(
    store: Store, engine: kiln.App, clock: SettableClock, truth: Truth
) -> None:
    # Given a scripted run over two tenants
    for i in range(6):
        await engine.submit(KIND, {"n": i}, tenant="acme" if i % 2 else "globex")
    claimed = await store.claim(worker_id="w", kinds=[KIND], limit=4, lease_ttl_s=5)
    boom = {"code": "boom", "message": "x", "retryable": True}
    bad = {"code": "bad_input", "message": "x", "retryable": False}
    await engine.apply(claimed[0], Event.FAIL, fenced=True, retry_error=boom)
    await engine.apply(claimed[1], Event.FAIL, fenced=True, retry_error=bad)
    generating = await engine.apply(claimed[2], Event.ACQUIRE, fenced=True)
    await engine.cancel((await store.list_tasks(tenant=None, status=S.PENDING))[0][0].id)
    claimed[3] = await store.heartbeat(claimed[3].id, claimed[3].epoch, 100, None)
    clock.advance(30)
    # When stats are read
    stats = await store.stats(tenant=None, ghost_after_s=10)
    # Then counts equal the table's ground truth
    truth_counts: dict[str, int] = dict(truth("SELECT status, COUNT(*) FROM tasks GROUP BY status"))
    assert stats.counts == {str(s): truth_counts.get(str(s), 0) for s in Status}
    assert sum(stats.counts.values()) == 6
    # And failures are counted by code, and the one lapsed lease is a ghost
    assert stats.failures == {"boom": 1, "bad_input": 1}
    assert stats.ghosts == 1
    assert await store.count_ghosts(older_than_s=10) == 1
    assert generating.status is S.GENERATING
    # And per tenant, counts follow that tenant's rows
    for tenant in ("acme", "globex"):
        mine = await store.stats(tenant=tenant, ghost_after_s=10)
        rows: dict[str, int] = dict(truth("SELECT status, COUNT(*) FROM tasks WHERE tenant = ?"
                          " GROUP BY status", tenant))  # fmt: skip
        assert mine.counts == {str(s): rows.get(str(s), 0) for s in Status}


async def test_failures_of_the_last_hour_age_out_while_the_totals_stay(
    store: Store, engine: kiln.App, clock: SettableClock
) -> None:
    # Given two failed attempts, one of each tenant, and a third 40 minutes later
    for i in range(3):
        await engine.submit(KIND, {"n": i}, tenant="acme" if i else "globex")
    claimed = await store.claim(worker_id="w", kinds=[KIND], limit=3, lease_ttl_s=5)
    boom = {"code": "boom", "message": "x", "retryable": False}
    await engine.apply(claimed[0], Event.FAIL, fenced=True, retry_error=boom)
    await engine.apply(claimed[1], Event.FAIL, fenced=True, retry_error=boom)
    clock.advance(40 * 60)
    await engine.apply(claimed[2], Event.FAIL, fenced=True, retry_error=boom)
    # Then all three count in the last hour, each tenant seeing its own
    assert (await store.stats(tenant=None, ghost_after_s=10)).failures_last_hour == {"boom": 3}
    by_tenant = {
        t.tenant: (await store.stats(tenant=t.tenant, ghost_after_s=10)).failures_last_hour
        for t in claimed
    }
    assert sum(f["boom"] for f in by_tenant.values()) == 3
    # When 30 more minutes pass, only the latest failure is still within the hour
    clock.advance(30 * 60)
    stats = await store.stats(tenant=None, ghost_after_s=10)
    assert stats.failures_last_hour == {"boom": 1}
    # And the all-time totals keep all three
    assert stats.failures == {"boom": 3}


# two stores on one database --------------------------------------------------------------------


async def test_two_stores_on_one_database_both_work(
    backend: Backend, tmp_path: Path, clock: SettableClock
) -> None:
    # Given two stores opened at the same time on one fresh database
    first, second = await asyncio.gather(
        asyncio.to_thread(backend.open, tmp_path, clock),
        asyncio.to_thread(backend.open, tmp_path, clock),
    )
    try:
        # When both submit the same content at once
        results = await asyncio.gather(
            first.submit(make_new_task()), second.submit(make_new_task())
        )
        # Then one task exists, and each store sees and moves it
        assert sorted(r.created for r in results) == [False, True]
        task_id = results[0].task.id
        assert results[1].task.id == task_id
        claimed = await claim_one(second)
        task, _ = await first.apply(step_change(claimed, Event.ACQUIRE))
        assert await second.get(task_id) == task
        assert [e.event for e in await second.events(task_id=task_id)] == [
            Event.SUBMIT, Event.CLAIM, Event.ACQUIRE,
        ]  # fmt: skip
    finally:
        await first.close()
        await second.close()
