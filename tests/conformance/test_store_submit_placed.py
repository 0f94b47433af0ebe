"""``store.submit(new, place=True)``: the answer carries the task's queue position, read in
the submit's own transaction (SQLite; PostgreSQL's one-statement insert reads it after),
for a new task, a content-dedup hit and a replayed key alike, under every claim policy."""

from __future__ import annotations

import pytest

from kiln.errors import IdempotencyKeyReused
from kiln.models import SubmitResult
from kiln.store import Store
from kiln.store.claims import ClaimPolicy

from .factories import SettableClock, make_new_task

pytestmark = [pytest.mark.usefixtures("queue_counts_checked"), pytest.mark.submit_process]


async def assert_placed_as_read(store: Store, result: SubmitResult, expected: int | None) -> None:
    assert result.placed
    assert result.queue_position == expected
    assert await store.queue_position(result.task) == expected  # what a read says


async def test_a_placed_submit_answers_the_position_of_each_kind_of_answer(
    store: Store, clock: SettableClock
) -> None:
    # Given new tasks at two priorities, with and without a key
    low = await store.submit(make_new_task({"n": 1}), place=True)
    await assert_placed_as_read(store, low, 1)
    clock.advance(1)
    high = await store.submit(make_new_task({"n": 2}, priority=5), place=True)
    await assert_placed_as_read(store, high, 1)
    clock.advance(1)
    keyed = await store.submit(make_new_task({"n": 3}, idempotency_key="k"), place=True)
    await assert_placed_as_read(store, keyed, 3)
    # Then a content-dedup hit and a replayed key answer where their task stands now
    hit = await store.submit(make_new_task({"n": 1}), place=True)
    assert (hit.deduplicated, hit.task.id) == (True, low.task.id)
    await assert_placed_as_read(store, hit, 2)
    replay = await store.submit(make_new_task({"n": 3}, idempotency_key="k"), place=True)
    assert (replay.replayed, replay.task.id) == (True, keyed.task.id)
    await assert_placed_as_read(store, replay, 3)
    # And a refused key is refused as without a position
    with pytest.raises(IdempotencyKeyReused):
        await store.submit(make_new_task({"n": 4}, idempotency_key="k"), place=True)
    # And an unplaced submit says so
    plain = await store.submit(make_new_task({"n": 5}))
    assert (plain.placed, plain.queue_position) == (False, None)


async def test_a_placed_submit_follows_the_claim_policy(store: Store, clock: SettableClock) -> None:
    # Given three tasks of one tenant queued before another tenant's first
    fair = ClaimPolicy(fair=True)
    for n in range(3):
        await store.submit(make_new_task({"n": n}, tenant="busy"), place=True, policy=fair)
        clock.advance(1)
    quiet = await store.submit(make_new_task({"n": 9}, tenant="quiet"), place=True, policy=fair)
    # Then under fair turns its tenant has the next turn: first, not fourth
    assert quiet.placed
    assert quiet.queue_position == await store.queue_position(quiet.task, fair) == 1
    assert await store.queue_position(quiet.task) == 4
