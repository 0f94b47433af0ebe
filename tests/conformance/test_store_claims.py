"""Claim policies on every backend: priority aging, fair turns between tenants, and
per-tenant running caps that hold across workers (kiln/store/claims.py)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from kiln.models import Task
from kiln.states import Event, Status
from kiln.store import Store
from kiln.store.claims import MAX_TENANTS, ClaimPolicy

from .backends import Backend
from .factories import KIND, SettableClock, drive, make_new_task, step_change

pytestmark = pytest.mark.usefixtures("queue_counts_checked")


async def submit(
    store: Store, n: int, *, tenant: str = "acme", priority: int = 0, tag: str = "t"
) -> list[Task]:
    found = []
    for i in range(n):
        new = make_new_task({"n": f"{tag}{i}"}, tenant=tenant, priority=priority)
        found.append((await store.submit(new)).task)
    return found


async def claim(store: Store, limit: int, policy: ClaimPolicy | None) -> list[Task]:
    return await store.claim(
        worker_id="w-1", kinds=[KIND], limit=limit, lease_ttl_s=30, policy=policy
    )


async def test_aging_lets_old_low_priority_work_pass_newer_high_priority_work(
    store: Store, clock: SettableClock
) -> None:
    (old,) = await submit(store, 1, priority=0, tag="old")
    clock.advance(100)
    (urgent,) = await submit(store, 1, priority=10, tag="urgent")
    # Strict priority: the urgent task goes first however long the old one waited
    assert await store.queue_position(urgent) == 1
    # Aging of 5 s per point: 100 s of waiting beat 10 points (worth 50 s)
    aging = ClaimPolicy(aging_s=5)
    assert await store.queue_position(old, aging) == 1
    assert await store.queue_position(urgent, aging) == 2
    assert [t.id for t in await claim(store, 1, aging)] == [old.id]
    # At 20 s per point, 10 points are worth 200 s: the urgent task is still first
    (older,) = await submit(store, 1, priority=0, tag="older")
    clock.advance(150)
    (newer,) = await submit(store, 1, priority=10, tag="newer")
    slow = ClaimPolicy(aging_s=20)
    first = await claim(store, 1, slow)
    assert [t.id for t in first] == [urgent.id]
    assert [t.id for t in await claim(store, 1, slow)] == [newer.id]
    assert [t.id for t in await claim(store, 1, slow)] == [older.id]


async def test_queue_positions_match_the_claim_order_under_aging(
    store: Store, clock: SettableClock
) -> None:
    # Given tasks of mixed priorities that became ready at different times
    rng = random.Random(11)
    tasks = []
    for i in range(24):
        tasks += await submit(store, 1, priority=rng.choice([-5, 0, 3, 8]), tag=f"m{i}")
        clock.advance(rng.uniform(0.5, 6))
    policy = ClaimPolicy(aging_s=2.5)
    # When each task's place is read, then they are claimed one at a time
    places = {t.id: await store.queue_position(t, policy) for t in tasks}
    assert sorted(places.values()) == list(range(1, 25))
    order = []
    for _ in tasks:
        order += [t.id for t in await claim(store, 1, policy)]
    # Then the claims follow the places exactly
    assert order == sorted(places, key=lambda i: places[i])


async def test_fair_turns_keep_one_tenants_flood_from_stalling_another(
    store: Store, clock: SettableClock
) -> None:
    # Given a flood from one tenant, and later one task each from two others
    flood = await submit(store, 40, tenant="flood", tag="f")
    clock.advance(1)
    (quiet,) = await submit(store, 1, tenant="quiet", tag="q")
    (calm,) = await submit(store, 1, tenant="calm", tag="c")
    fair = ClaimPolicy(fair=True)
    # Their places reflect the turns, not the flood's length
    assert await store.queue_position(quiet, fair) == 1
    assert await store.queue_position(calm, fair) == 1
    assert await store.queue_position(quiet) == 41  # in the plain order
    # When a worker claims four tasks with fair turns
    taken = await claim(store, 4, fair)
    # Then each tenant got a turn, the flood's oldest first
    assert {t.tenant for t in taken} == {"flood", "quiet", "calm"}
    assert [t.id for t in taken if t.tenant == "flood"] == [flood[0].id, flood[1].id]
    # And the plain order would have given all four to the flood
    rest = await claim(store, 4, None)
    assert {t.tenant for t in rest} == {"flood"}


async def test_a_tenant_at_its_running_cap_waits_while_others_are_claimed(
    store: Store, clock: SettableClock
) -> None:
    heavy = await submit(store, 10, tenant="heavy", tag="h")
    clock.advance(1)
    light = await submit(store, 3, tenant="light", tag="l")
    capped = ClaimPolicy(running_cap=2, running_caps={"light": 5})
    taken = await claim(store, 10, capped)
    assert sorted(t.tenant for t in taken) == ["heavy", "heavy", "light", "light", "light"]
    assert await claim(store, 10, capped) == []  # heavy is at its cap; light has no more
    # When one of heavy's tasks ends, heavy gets one more, in its own order
    running = [t for t in taken if t.tenant == "heavy"]
    refused = {"code": "x", "message": "x", "retryable": False}
    await store.apply(step_change(running[0], (Event.FAIL, Status.FAILED), error=refused))
    again = await claim(store, 10, capped)
    assert [t.id for t in again] == [heavy[2].id]
    counts = (await store.stats(tenant="heavy", ghost_after_s=60)).counts
    assert counts["WAITING_FOR_RESOURCE"] == 2 and counts["PENDING"] == 7
    assert {t.id for t in light} <= {t.id for t in taken}


async def test_running_caps_hold_when_workers_claim_at_the_same_moment(
    store: Store, backend: Backend, tmp_path: Path, clock: SettableClock
) -> None:
    await submit(store, 30, tenant="heavy", tag="h")
    capped = ClaimPolicy(running_cap=3)
    other = backend.open(tmp_path / "store", clock)
    try:
        await other.last_seq()
        handles = [store, other]
        batches = await asyncio.gather(*(
            handles[i % 2].claim(worker_id=f"w-{i}", kinds=[KIND], limit=2, lease_ttl_s=30,
                                 policy=capped)
            for i in range(8)
        ))  # fmt: skip
    finally:
        await other.close()
    assert sum(len(b) for b in batches) == 3
    counts = (await store.stats(tenant="heavy", ghost_after_s=60)).counts
    assert counts["WAITING_FOR_RESOURCE"] == 3


async def test_every_tenant_gets_a_turn_when_there_are_more_than_one_claim_reads(
    store: Store,
) -> None:
    tenants = [f"t{i:03d}" for i in range(MAX_TENANTS + 8)]
    for tenant in tenants:
        await submit(store, 2, tenant=tenant, tag=tenant)
    fair = ClaimPolicy(fair=True)
    first_round: set[str] = set()
    for _ in range(len(tenants)):
        first_round |= {t.tenant for t in await claim(store, 1, fair)}
    # One claim reads at most MAX_TENANTS lines; turns move on, so nobody is left out
    assert first_round == set(tenants)


async def test_a_pages_positions_equal_each_tasks_own(store: Store, clock: SettableClock) -> None:
    # Given ready tasks of two kinds, of mixed priorities, tenants and ready times, plus a
    # retry not yet due and a claimed task (neither has a position)
    rng = random.Random(5)
    tasks = []
    for i in range(30):
        new = make_new_task(
            {"n": f"p{i}"},
            kind=rng.choice([KIND, "other.kind"]),
            tenant=rng.choice(["acme", "umbrella"]),
            priority=rng.choice([-3, 0, 0, 7]),
        )
        tasks.append((await store.submit(new)).task)
        clock.advance(rng.uniform(0.1, 3))
    lone = make_new_task({"n": "claimed"}, kind="third.kind")
    claimed = await drive(store, lone, Status.WAITING_FOR_RESOURCE)
    due = clock() + 60
    retry = {"ready_at": due, "next_retry_at": due}
    waiting, _ = await store.apply(
        step_change(claimed, Event.FAIL, Event.SCHEDULE_RETRY, fields=retry)
    )
    page = [*rng.sample(tasks, 20), waiting]
    for policy in (None, ClaimPolicy(aging_s=2.5), ClaimPolicy(fair=True)):
        # When the page's positions are read together, and each task's alone
        together = await store.queue_positions(page, policy)
        alone = {t.id: await store.queue_position(t, policy) for t in page}
        # Then they are the same, and a task with no position is left out
        assert together == {i: p for i, p in alone.items() if p is not None}
        assert waiting.id not in together and len(together) == 20
