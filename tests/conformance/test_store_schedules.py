"""Schedules in the store: a tick fires at most once, under the leader, with its next tick
moved on in the same transaction (kiln/store/schedules.py)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from kiln import canonical
from kiln.counters import SCHEDULE_FIRES
from kiln.errors import NotLeader, TooManySchedules
from kiln.limits import Rate, rate_bucket
from kiln.models import Task
from kiln.scheduler import tick_key, tick_task
from kiln.states import Event, Status
from kiln.store import ScheduleRecord, Store, Tick

from .backends import Backend
from .factories import KIND, SettableClock, step_change

NOW = 1_800_000_000.0


def make_schedule(
    *, overlap: str = "queue", missed: str = "fire_once", tenant: str = "acme", next_at: float = NOW
) -> ScheduleRecord:
    submission = {
        "kind": KIND, "params": {"prompt": "a fox at dawn"}, "priority": 0, "max_attempts": 3,
        "deadline_s": 3600.0,
        "timeouts": {"waiting_s": 600.0, "generating_s": 600.0, "uploading_s": 120.0},
        "metadata": {}, "webhook": None,
    }  # fmt: skip
    return ScheduleRecord(
        id=canonical.new_id("sch_"), tenant=tenant, cron="* * * * * *", timezone="UTC",
        submission=submission, overlap=overlap, missed=missed, paused=False, next_at=next_at,
    )  # fmt: skip


async def tasks_of(store: Store) -> list[Task]:
    tasks, _ = await store.list_tasks(tenant="acme", limit=10)
    return tasks


def fire(schedule: ScheduleRecord, tick_at: float) -> Tick:
    return Tick(schedule.id, tick_at, tick_at + 1, tick_task(schedule, tick_at), tick_at)


async def test_a_tick_fires_one_task_and_moves_the_schedule_on(store: Store) -> None:
    # Given a schedule due now and the leadership
    schedule = await store.schedules.create(make_schedule())
    token = await store.lead("supervisor", "s1", 30)
    assert token is not None
    assert [s.id for s in await store.schedules.due()] == [schedule.id]

    # When its tick is handled
    done = await store.schedules.handle_tick(fire(schedule, NOW), token)

    # Then one PENDING task with the tick's key exists, and the schedule waits for NOW + 1
    assert done is not None and done.outcome == "fired" and done.task is not None
    assert done.task.idempotency_key == tick_key(schedule.id, NOW)
    assert done.task.status is Status.PENDING and done.task.tenant == "acme"
    assert done.schedule.next_at == NOW + 1 and done.schedule.fired == 1
    assert done.schedule.last_task_id == done.task.id
    assert await store.schedules.due() == []
    assert (await store.counters())[(SCHEDULE_FIRES, "fired")] == 1

    # And handling the same tick again does nothing
    assert await store.schedules.handle_tick(fire(schedule, NOW), token) is None
    assert len(await tasks_of(store)) == 1


async def test_two_stores_racing_for_one_tick_make_one_task(
    backend: Backend, store: Store, tmp_path: Path, clock: SettableClock
) -> None:
    # Given a due schedule and a second store on the same database
    schedule = await store.schedules.create(make_schedule())
    token = await store.lead("supervisor", "s1", 30)
    assert token is not None
    other = backend.open(tmp_path / "store", clock)
    try:
        # When both handle the tick at once (each with its own task id)
        results = await asyncio.gather(
            store.schedules.handle_tick(fire(schedule, NOW), token),
            other.schedules.handle_tick(fire(schedule, NOW), token),
        )
    finally:
        await other.close()

    # Then exactly one fired, and one task holds the tick's key
    assert sorted(r is None for r in results) == [False, True]
    tasks = await tasks_of(store)
    assert [t.idempotency_key for t in tasks] == [tick_key(schedule.id, NOW)]


async def test_a_leader_that_lost_its_lease_fires_nothing(
    store: Store, clock: SettableClock
) -> None:
    schedule = await store.schedules.create(make_schedule())
    old = await store.lead("supervisor", "s1", 1)
    assert old is not None
    clock.advance(2)
    assert await store.lead("supervisor", "s2", 30) is not None
    with pytest.raises(NotLeader):
        await store.schedules.handle_tick(fire(schedule, NOW), old)
    assert await tasks_of(store) == []
    after = await store.schedules.get(schedule.id)
    assert after is not None and after.next_at == NOW


async def test_overlap_skip_skips_while_the_last_task_runs_and_fires_once_it_ended(
    store: Store,
) -> None:
    # Given a schedule with overlap "skip" whose first tick fired a task still PENDING
    schedule = await store.schedules.create(make_schedule(overlap="skip"))
    token = await store.lead("supervisor", "s1", 30)
    assert token is not None
    first = await store.schedules.handle_tick(fire(schedule, NOW), token)
    assert first is not None and first.task is not None

    # When the next tick comes: skipped, no task, counted
    second = await store.schedules.handle_tick(fire(schedule, NOW + 1), token)
    assert second is not None and second.outcome == "skipped_overlap" and second.task is None
    assert second.schedule.skipped == 1 and second.schedule.next_at == NOW + 2

    # And once the first task is final, the next tick fires
    await store.apply(step_change(first.task, Event.CANCEL, fenced=False))
    third = await store.schedules.handle_tick(fire(schedule, NOW + 2), token)
    assert third is not None and third.outcome == "fired"
    counts = await store.counters()
    assert counts[(SCHEDULE_FIRES, "fired")] == 2
    assert counts[(SCHEDULE_FIRES, "skipped_overlap")] == 1


async def test_a_paused_schedule_is_not_due_and_fires_nothing(store: Store) -> None:
    schedule = await store.schedules.create(make_schedule())
    token = await store.lead("supervisor", "s1", 30)
    assert token is not None
    paused = await store.schedules.set_paused(schedule.id, paused=True, next_at=NOW)
    assert paused is not None and paused.paused
    assert await store.schedules.due() == []
    assert await store.schedules.handle_tick(fire(schedule, NOW), token) is None
    resumed = await store.schedules.set_paused(schedule.id, paused=False, next_at=NOW + 5)
    assert resumed is not None and not resumed.paused and resumed.next_at == NOW + 5


async def test_schedules_are_listed_per_tenant_and_deleted(store: Store) -> None:
    mine = [await store.schedules.create(make_schedule()) for _ in range(3)]
    theirs = await store.schedules.create(make_schedule(tenant="other"))
    listed = await store.schedules.page(tenant="acme")
    assert [s.id for s in listed] == [s.id for s in mine]
    assert [s.id for s in await store.schedules.page(tenant="acme", after=mine[0].id, limit=1)] == [
        mine[1].id
    ]
    assert len(await store.schedules.page(tenant=None)) == 4
    assert await store.schedules.delete(theirs.id)
    assert not await store.schedules.delete(theirs.id)
    assert await store.schedules.get(theirs.id) is None


async def test_a_tick_whose_advance_fails_leaves_no_task_and_fires_once_later(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a due schedule, and a fault between the tick's submit and the schedule's advance
    # (a crash there, as a leader SIGKILLed mid-fire would leave it)
    schedule = await store.schedules.create(make_schedule())
    token = await store.lead("supervisor", "s1", 30)
    assert token is not None
    monkeypatch.setattr(store.q, "advance_schedule", "UPDATE no_such_table SET x = 1")

    # When the tick is handled: the transaction fails as a whole
    with pytest.raises(Exception):  # noqa: B017 - the driver's own error, whichever it is
        await store.schedules.handle_tick(fire(schedule, NOW), token)
    assert await tasks_of(store) == []
    still = await store.schedules.get(schedule.id)
    assert still is not None and still.next_at == NOW and still.fired == 0

    # Then the next handler fires the tick, once
    monkeypatch.undo()
    done = await store.schedules.handle_tick(fire(schedule, NOW), token)
    assert done is not None and done.outcome == "fired"
    assert [t.idempotency_key for t in await tasks_of(store)] == [tick_key(schedule.id, NOW)]


async def test_concurrent_creations_never_pass_the_schedule_cap(
    backend: Backend, store: Store, tmp_path: Path, clock: SettableClock
) -> None:
    # Given a cap of 3 schedules and two store handles (two API nodes)
    other = backend.open(tmp_path / "store", clock)
    try:
        await other.last_seq()
        # When ten creations race through both handles
        handles = [store, other] * 5
        results = await asyncio.gather(
            *(h.schedules.create(make_schedule(), most=3) for h in handles),
            return_exceptions=True,
        )
    finally:
        await other.close()

    # Then three were stored and seven refused, and another tenant is not held back
    refused = [r for r in results if isinstance(r, TooManySchedules)]
    assert len(refused) == 7 and len(await store.schedules.page(tenant="acme")) == 3
    assert refused[0].details[0]["limit"] == 3
    assert await store.schedules.create(make_schedule(tenant="other"), most=3)


async def test_a_tick_over_its_rate_is_put_off_and_fires_once_the_tokens_are_back(
    store: Store, clock: SettableClock
) -> None:
    # Given a due schedule whose tenant's bucket is empty
    rate = Rate(per_s=1.0, burst=1.0)
    schedule = await store.schedules.create(make_schedule())
    token = await store.lead("supervisor", "s1", 30)
    assert token is not None
    assert await store.limits.take_token(rate_bucket("acme"), rate) == 0.0

    # When the tick is handled: put off, nothing fired, the schedule not moved on
    put_off = await store.schedules.handle_tick(replace(fire(schedule, NOW), rate=rate), token)
    assert put_off is not None and put_off.outcome == "rate_limited" and put_off.task is None
    assert await tasks_of(store) == []
    still = await store.schedules.get(schedule.id)
    assert still is not None and still.next_at == NOW and still.fired == 0

    # Then once a token is back the same tick fires
    clock.advance(1)
    done = await store.schedules.handle_tick(replace(fire(schedule, NOW), rate=rate), token)
    assert done is not None and done.outcome == "fired"
    assert [t.idempotency_key for t in await tasks_of(store)] == [tick_key(schedule.id, NOW)]
    counters = await store.counters()
    assert counters[(SCHEDULE_FIRES, "rate_limited")] == 1
