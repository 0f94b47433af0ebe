"""Store.purge on every backend: only old final tasks go, with everything that is theirs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from kiln.states import Status
from kiln.store import Store

from .backends import Row
from .factories import SettableClock, drive, make_new_task

pytestmark = pytest.mark.usefixtures("queue_counts_checked")

Truth = Callable[..., list[Row]]


async def test_purge_takes_old_final_tasks_with_their_events_and_keys(
    store: Store, clock: SettableClock, truth: Truth
) -> None:
    # Given old final tasks (one with an idempotency key), an old live one, a recent one
    old_done = await drive(store, make_new_task({"prompt": "a"}, idempotency_key="k1"),
                           Status.SUCCESS)  # fmt: skip
    old_cancelled = await drive(store, make_new_task({"prompt": "b"}), Status.CANCELLED)
    old_live = await drive(store, make_new_task({"prompt": "c"}, kind="other"), Status.PENDING)
    clock.advance(100)
    recent = await drive(store, make_new_task({"prompt": "d"}), Status.FAILED)
    # When what finished more than 50 s ago is purged
    purged = await store.purge(finished_before=clock() - 50)
    # Then exactly the old final tasks went, oldest first, with their events and keys
    assert [t.id for t in purged] == [old_done.id, old_cancelled.id]
    remaining = {row[0] for row in truth("SELECT id FROM tasks")}
    assert remaining == {old_live.id, recent.id}
    assert {row[0] for row in truth("SELECT DISTINCT task_id FROM events")} == remaining
    assert truth("SELECT COUNT(*) FROM idempotency_keys") == [(0,)]
    # And the counts still equal the table
    stats = await store.stats(tenant=None, ghost_after_s=60)
    table = Counter(dict(truth("SELECT status, COUNT(*) FROM tasks GROUP BY status")))
    assert stats.counts == {str(s): table.get(str(s), 0) for s in Status}
    assert (await store.counters())[("purged", "")] == 2


async def test_after_a_purge_the_same_request_makes_a_new_task(
    store: Store, clock: SettableClock
) -> None:
    # Given a finished task found by content and by key, then purged
    first = await drive(store, make_new_task(idempotency_key="k1"), Status.SUCCESS)
    again = await store.submit(make_new_task(idempotency_key="k1"))
    assert again.task.id == first.id and not again.created
    clock.advance(10)
    assert [t.id for t in await store.purge(finished_before=clock())] == [first.id]
    # When the same request comes again
    after = await store.submit(make_new_task(idempotency_key="k1"))
    # Then it is a new task
    assert after.created and after.task.id != first.id
    assert await store.get(first.id) is None


async def test_purge_keeps_to_one_tenant_or_spares_the_excluded(
    store: Store, clock: SettableClock
) -> None:
    # Given old finished tasks of two tenants
    acme = await drive(store, make_new_task({"prompt": "a"}, tenant="acme"), Status.CANCELLED)
    beta = await drive(store, make_new_task({"prompt": "b"}, tenant="beta"), Status.CANCELLED)
    clock.advance(10)
    # When a purge spares beta, and one is limited to beta
    spared = await store.purge(finished_before=clock(), exclude=["beta"])
    only = await store.purge(finished_before=clock(), tenant="beta")
    # Then each took its own tenant's task
    assert [t.id for t in spared] == [acme.id]
    assert [t.id for t in only] == [beta.id]


async def test_purge_pages_through_many_tasks(store: Store, clock: SettableClock) -> None:
    # Given seven finished tasks
    ids = [
        (await drive(store, make_new_task({"prompt": str(i)}), Status.CANCELLED)).id
        for i in range(7)
    ]
    clock.advance(10)
    # When they are purged three at a time
    pages = []
    while page := await store.purge(finished_before=clock(), limit=3):
        pages.append([t.id for t in page])
    # Then the pages hold them all once, oldest first
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [i for p in pages for i in p] == ids
