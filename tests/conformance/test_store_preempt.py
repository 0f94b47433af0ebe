"""Preemption requests (kiln/store/preempt.py), on every backend: which running attempt
of a full pool the leading supervisor asks to yield, one at a time, only for a task of
higher priority that waited in the pool's line past the threshold."""

from __future__ import annotations

import itertools

import pytest

from kiln import counters
from kiln.errors import NotLeader
from kiln.models import Task
from kiln.states import Event, Status
from kiln.store import LeaderToken, Store
from kiln.worker import release_fields

from .factories import KIND, SettableClock, make_new_task, step_change

POOL = "gpu-a100"
AFTER_S = 10.0
_numbers = itertools.count()


async def claim(store: Store, priority: int, *, ttl: float = 600.0) -> Task:
    await store.submit(make_new_task({"p": priority, "n": next(_numbers)}, priority=priority))
    found = await store.claim(worker_id="w-1", kinds=[KIND], limit=1, lease_ttl_s=ttl)
    assert len(found) == 1 and found[0].priority == priority
    return found[0]


async def holding(store: Store, capacity: int, priority: int, clock: SettableClock) -> Task:
    """A task of ``priority`` GENERATING with a slot of the pool, started now (then 1 s on)."""
    task = await claim(store, priority)
    assert await store.pools.acquire(task.id, task.epoch, {POOL: 1}, {POOL: capacity}) is None
    generating, _ = await store.apply(step_change(task, Event.ACQUIRE))
    clock.advance(1)
    return generating


async def waiting(store: Store, capacity: int, priority: int) -> Task:
    task = await claim(store, priority)
    wait = await store.pools.acquire(task.id, task.epoch, {POOL: 1}, {POOL: capacity})
    assert wait is not None
    return task


async def leader(store: Store) -> LeaderToken:
    token = await store.lead("supervisor", "s-1", 3600)
    assert token is not None
    return token


async def ask(store: Store) -> list[str]:
    made = await store.request_yields(waited_s=AFTER_S, leader=await leader(store))
    return [p.task_id for p in made]


async def release(store: Store, task: Task) -> Task:
    fresh = await store.get(task.id)
    assert fresh is not None
    back, _ = await store.apply(
        step_change(fresh, Event.RELEASE, bump_epoch=True, fields=release_fields(fresh))
    )
    return back


async def test_the_lowest_priority_then_latest_started_holder_is_asked_once_the_wait_passed(
    store: Store, clock: SettableClock
) -> None:
    # Given a full pool of three: two holders of priority 0 (a, then b) and one of 1
    a = await holding(store, 3, 0, clock)
    b = await holding(store, 3, 0, clock)
    c = await holding(store, 3, 1, clock)
    high = await waiting(store, 3, 5)
    # When the waiter of priority 5 has not waited long enough: nobody is asked
    clock.advance(AFTER_S - 1)
    assert await ask(store) == []
    # Once it has: the lowest priority, most recently started holder is asked
    clock.advance(2)
    assert await ask(store) == [b.id]
    asked = await store.get(b.id)
    assert asked is not None and asked.yield_requested_at == clock()
    assert asked.status is Status.GENERATING and asked.epoch == b.epoch  # no transition
    # The holder learns it from its heartbeat
    beat = await store.heartbeat(b.id, b.epoch, 600, None)
    assert beat.yield_requested_at is not None
    # One request per pool at a time: nobody else is asked while b has not yielded
    clock.advance(5)
    assert await ask(store) == []
    # b yields (release): the request is cleared and the waiter takes the slot
    back = await release(store, b)
    assert back.status is Status.PENDING and back.yield_requested_at is None
    assert await store.pools.acquire(high.id, high.epoch, {POOL: 1}, {POOL: 3}) is None
    assert await ask(store) == []  # nobody waits now
    # A second long waiter of higher priority: a is next (priority 0 before c's 1)
    await waiting(store, 3, 5)
    clock.advance(AFTER_S + 1)
    assert await ask(store) == [a.id]
    assert (await store.counters())[(counters.PREEMPTIONS, POOL)] == 2
    assert (await store.get(c.id)).yield_requested_at is None  # type: ignore[union-attr]


async def test_nobody_yields_to_a_waiter_of_the_same_or_lower_priority(
    store: Store, clock: SettableClock
) -> None:
    await holding(store, 1, 3, clock)
    await waiting(store, 1, 3)
    await waiting(store, 1, 1)
    clock.advance(AFTER_S * 3)
    assert await ask(store) == []


async def test_nobody_yields_when_the_line_ahead_of_the_long_waiter_is_no_better(
    store: Store, clock: SettableClock
) -> None:
    # The freed slot would go to the head of the line, a task of the holder's priority:
    # a yield would only swap equals
    await holding(store, 1, 0, clock)
    await waiting(store, 1, 0)
    clock.advance(1)
    await waiting(store, 1, 9)
    clock.advance(AFTER_S * 3)
    assert await ask(store) == []


async def test_nobody_yields_while_the_pool_has_room_for_its_first_waiter(
    store: Store, clock: SettableClock
) -> None:
    holder = await holding(store, 1, 0, clock)
    await waiting(store, 1, 5)
    clock.advance(AFTER_S + 1)
    # The holder moved on (its slot is free) before the waiter asked again
    await store.apply(step_change(holder, Event.GENERATED))
    assert await ask(store) == []


async def test_a_task_waiting_for_its_slot_is_never_asked(
    store: Store, clock: SettableClock
) -> None:
    # A holder still in WAITING_FOR_RESOURCE (granted, not yet GENERATING) is not asked
    low = await claim(store, 0)
    assert await store.pools.acquire(low.id, low.epoch, {POOL: 1}, {POOL: 1}) is None
    await waiting(store, 1, 5)
    clock.advance(AFTER_S + 1)
    assert await ask(store) == []


async def test_a_new_attempt_starts_unasked(store: Store, clock: SettableClock) -> None:
    low = await holding(store, 1, 0, clock)
    await waiting(store, 1, 5)
    clock.advance(AFTER_S + 1)
    assert await ask(store) == [low.id]
    # The attempt is expired instead of yielding, and claimed again: not asked any more
    fresh = await store.get(low.id)
    assert fresh is not None
    await store.apply(
        step_change(fresh, Event.EXPIRE, Event.SCHEDULE_RETRY, fenced=False, bump_epoch=True,
                    fields={"ready_at": clock(), "next_retry_at": clock()})
    )  # fmt: skip
    again = (await store.claim(worker_id="w-2", kinds=[KIND], limit=1, lease_ttl_s=60))[0]
    assert again.id == low.id and again.yield_requested_at is None


async def test_a_supervisor_that_no_longer_leads_asks_nobody(
    store: Store, clock: SettableClock
) -> None:
    await holding(store, 1, 0, clock)
    await waiting(store, 1, 5)
    clock.advance(AFTER_S + 1)
    stale = LeaderToken("supervisor", "s-old", 99, clock())
    with pytest.raises(NotLeader):
        await store.request_yields(waited_s=AFTER_S, leader=stale)
    tasks, _ = await store.list_tasks(tenant=None, limit=100)
    assert tasks and all(t.yield_requested_at is None for t in tasks)
