"""Shared resource pools and rate buckets, on every backend.

A pool's slot is held under the attempt's lease: it comes back by itself when the task
leaves GENERATING or when its holder stops renewing, and a waiter keeps its place in a
first-come line that every worker of every machine shares.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kiln.errors import LeaseLost
from kiln.limits import Rate
from kiln.models import Task
from kiln.states import Event, Status
from kiln.store import Store

from .backends import Backend
from .factories import KIND, SettableClock, make_new_task, step_change

GPU = {"gpu-a100": 2}


async def claimed(store: Store, n: int, *, ttl: float = 30.0) -> list[Task]:
    for i in range(n):
        await store.submit(make_new_task({"n": i}))
    tasks = await store.claim(worker_id="w-1", kinds=[KIND], limit=n, lease_ttl_s=ttl)
    assert len(tasks) == n
    return sorted(tasks, key=lambda t: t.created_at)


async def acquire(store: Store, task: Task, needs: dict[str, int] | None = None):  # type: ignore[no-untyped-def]
    return await store.pools.acquire(task.id, task.epoch, needs or {"gpu-a100": 1}, GPU)


async def test_capacity_holds_and_the_next_waiter_learns_its_place(store: Store) -> None:
    a, b, c, d = await claimed(store, 4)
    assert await acquire(store, a) is None
    assert await acquire(store, b) is None
    wait_c = await acquire(store, c)
    wait_d = await acquire(store, d)
    assert wait_c is not None and wait_d is not None
    assert (wait_c.pool, wait_c.position, wait_c.held, wait_c.capacity) == ("gpu-a100", 1, 2, 2)
    assert (wait_d.position, wait_d.waiting) == (2, 2)
    # Asking again keeps the place (no jumping the line, no losing it)
    assert (await acquire(store, d)).position == 2  # type: ignore[union-attr]
    assert (await store.pools.wait(c.id)).position == 1  # type: ignore[union-attr]
    assert await store.pools.wait(a.id) is None  # a holder waits for nothing
    usage = {p.name: (p.capacity, p.held, p.waiting) for p in await store.pools.usage()}
    assert usage == {"gpu-a100": (2, 2, 2)}


async def test_a_slot_comes_back_when_its_holder_leaves_generating(store: Store) -> None:
    a, b, c = await claimed(store, 3)
    assert await acquire(store, a) is None and await acquire(store, b) is None
    assert await acquire(store, c) is not None
    generating, _ = await store.apply(step_change(a, Event.ACQUIRE))
    assert await acquire(store, c) is not None  # GENERATING still holds it
    await store.apply(step_change(generating, Event.GENERATED))
    # Uploading needs no slot: the waiter gets it with no release call at all
    assert await acquire(store, c) is None
    usage = {p.name: (p.held, p.waiting) for p in await store.pools.usage()}
    assert usage == {"gpu-a100": (2, 0)}


async def test_a_dead_holders_slot_comes_back_when_its_lease_lapses(
    store: Store, clock: SettableClock
) -> None:
    # Given a holder that stops renewing (killed) and a waiter whose worker beats on
    a, b, c = await claimed(store, 3, ttl=10)
    assert await acquire(store, a) is None and await acquire(store, b) is None
    assert await acquire(store, c) is not None
    clock.advance(6)
    await store.heartbeat(b.id, b.epoch, 10, None)
    await store.heartbeat(c.id, c.epoch, 10, None)
    assert await acquire(store, c) is not None  # a's lease still runs
    clock.advance(6)  # a's lease lapsed; nobody expired it yet
    assert await acquire(store, c) is None
    assert {p.name: p.held for p in await store.pools.usage()} == {"gpu-a100": 2}


async def test_a_failed_or_expired_attempt_frees_its_slot_and_a_new_attempt_queues_again(
    store: Store, clock: SettableClock
) -> None:
    a, b, c = await claimed(store, 3)
    assert await acquire(store, a) is None and await acquire(store, b) is None
    await store.apply(
        step_change(a, Event.EXPIRE, Event.SCHEDULE_RETRY, fenced=False, bump_epoch=True,
                    fields={"ready_at": clock(), "next_retry_at": clock()})
    )  # fmt: skip
    assert await acquire(store, c) is None  # a's slot is free again
    again = (await store.claim(worker_id="w-2", kinds=[KIND], limit=1, lease_ttl_s=30))[0]
    assert again.id == a.id and again.epoch > a.epoch
    wait = await acquire(store, again)
    assert wait is not None and wait.position == 1  # a new attempt queues like anyone


async def test_a_stale_attempt_cannot_take_a_slot(store: Store, clock: SettableClock) -> None:
    (a,) = await claimed(store, 1)
    await store.apply(
        step_change(a, Event.EXPIRE, Event.SCHEDULE_RETRY, fenced=False, bump_epoch=True,
                    fields={"ready_at": clock(), "next_retry_at": clock()})
    )  # fmt: skip
    with pytest.raises(LeaseLost):
        await acquire(store, a)
    assert {p.name: p.held for p in await store.pools.usage()}.get("gpu-a100", 0) == 0


async def test_several_pools_are_taken_all_or_none(store: Store) -> None:
    caps = {"gpu-a100": 1, "upstream": 1}
    a, b, c = await claimed(store, 3)
    assert await store.pools.acquire(a.id, a.epoch, {"upstream": 1}, caps) is None
    # b needs both: the GPU is free but upstream is not, so it takes neither
    wait = await store.pools.acquire(b.id, b.epoch, {"gpu-a100": 1, "upstream": 1}, caps)
    assert wait is not None and wait.pool == "upstream"
    usage = {p.name: (p.held, p.waiting) for p in await store.pools.usage()}
    assert usage == {"gpu-a100": (0, 1), "upstream": (1, 1)}
    # c, behind b in the GPU line, waits too: b keeps its place in every line
    assert await store.pools.acquire(c.id, c.epoch, {"gpu-a100": 1}, caps) is not None


async def test_units_count_and_a_need_beyond_the_capacity_runs_alone(store: Store) -> None:
    caps = {"gpu-a100": 4}
    a, b, c = await claimed(store, 3)
    assert await store.pools.acquire(a.id, a.epoch, {"gpu-a100": 3}, caps) is None
    assert await store.pools.acquire(b.id, b.epoch, {"gpu-a100": 2}, caps) is not None
    big = await store.pools.acquire(c.id, c.epoch, {"gpu-a100": 9}, caps)
    assert big is not None and big.held == 3
    # Pools not configured do not limit
    assert await store.pools.acquire(b.id, b.epoch, {"other": 5}, caps) is None


async def test_concurrent_acquirers_never_exceed_the_capacity(
    store: Store, backend: Backend, tmp_path: Path, clock: SettableClock
) -> None:
    # Twenty attempts ask at once, through two store handles on the same database
    tasks = await claimed(store, 20)
    other = backend.open(tmp_path / "store", clock)
    try:
        await other.last_seq()
        handles = [store, other]
        caps = {"gpu-a100": 3}
        answers = await asyncio.gather(*(
            handles[i % 2].pools.acquire(t.id, t.epoch, {"gpu-a100": 1}, caps)
            for i, t in enumerate(tasks)
        ))  # fmt: skip
    finally:
        await other.close()
    assert sum(1 for a in answers if a is None) == 3
    # Once all have asked, the line is one order with every place taken once
    waiting = [t for t, a in zip(tasks, answers, strict=True) if a is not None]
    places = [await store.pools.wait(t.id) for t in waiting]
    assert sorted(p.position for p in places if p is not None) == list(range(1, 18))
    assert {p.name: p.held for p in await store.pools.usage()} == {"gpu-a100": 3}


async def test_a_changed_capacity_applies_at_the_next_acquire(store: Store) -> None:
    a, b = await claimed(store, 2)
    assert await store.pools.acquire(a.id, a.epoch, {"p": 1}, {"p": 1}) is None
    assert await store.pools.acquire(b.id, b.epoch, {"p": 1}, {"p": 1}) is not None
    assert await store.pools.acquire(b.id, b.epoch, {"p": 1}, {"p": 2}) is None
    assert {p.name: p.capacity for p in await store.pools.usage()} == {"p": 2}


async def test_token_bucket_allows_a_burst_then_refills_at_its_rate(
    store: Store, backend: Backend, tmp_path: Path, clock: SettableClock
) -> None:
    rate = Rate(per_s=2.0, burst=3.0)
    assert [await store.limits.take_token("submit:acme", rate) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = await store.limits.take_token("submit:acme", rate)
    assert wait == pytest.approx(0.5)
    assert await store.limits.take_token("submit:other", rate) == 0.0  # buckets are separate
    # Another handle on the same database shares the bucket (another API node)
    other = backend.open(tmp_path / "store", clock)
    try:
        await other.last_seq()
        assert await other.limits.take_token("submit:acme", rate) > 0
        clock.advance(0.5)
        assert await other.limits.take_token("submit:acme", rate) == 0.0
        assert await store.limits.take_token("submit:acme", rate) > 0
        clock.advance(60)  # refills up to the burst, never beyond
        assert [await store.limits.take_token("submit:acme", rate) for _ in range(4)][-1] > 0
    finally:
        await other.close()


async def test_a_bucket_takes_a_token_per_task_and_a_request_past_the_burst_goes_into_debt(
    store: Store, clock: SettableClock
) -> None:
    rate = Rate(per_s=1.0, burst=10.0)
    # A request of 4 tasks takes 4 tokens; one of 7 finds 6 and waits for the seventh
    assert await store.limits.take_token("submit:acme", rate, 4) == 0.0
    assert await store.limits.take_token("submit:acme", rate, 7) == pytest.approx(1.0)
    assert await store.limits.take_token("submit:acme", rate, 6) == 0.0
    # A request larger than the burst goes in from a full bucket only, and leaves a debt
    clock.advance(10)
    assert await store.limits.take_token("submit:acme", rate, 25) == 0.0
    assert await store.limits.take_token("submit:acme", rate) == pytest.approx(16.0)
    clock.advance(15.5)
    assert await store.limits.take_token("submit:acme", rate) > 0
    clock.advance(0.5)
    assert await store.limits.take_token("submit:acme", rate) == 0.0


async def test_waiting_tasks_show_their_status_untouched(store: Store) -> None:
    a, b = await claimed(store, 2)
    caps = {"gpu-a100": 1}
    await store.pools.acquire(a.id, a.epoch, {"gpu-a100": 1}, caps)
    await store.pools.acquire(b.id, b.epoch, {"gpu-a100": 1}, caps)
    after = await store.get(b.id)
    assert after is not None
    assert (after.status, after.epoch, after.version) == (Status.WAITING_FOR_RESOURCE, b.epoch,
                                                          b.version)  # fmt: skip
    assert [e.event for e in await store.events(task_id=b.id)] == [Event.SUBMIT, Event.CLAIM]
