"""Many tasks' changes in one call (``Store.apply_many``): each stays its own
compare-and-set (I11), with its own event rows (I6) and counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kiln.errors import Conflict, LeaseLost, NotFound
from kiln.states import Event, Status, replay
from kiln.store import Store

from .backends import Row
from .factories import KIND, make_new_task, step_change

Truth = Callable[..., list[Row]]


async def test_a_batch_commits_every_change_but_the_refused_one(store: Store, truth: Truth) -> None:
    # Given three claimed tasks, one of which moved on since its worker read it
    for n in range(3):
        await store.submit(make_new_task({"n": n}))
    claimed = await store.claim(worker_id="w-1", kinds=[KIND], limit=3, lease_ttl_s=30)
    stale = claimed[1]
    await store.apply(step_change(stale, Event.EXPIRE, fenced=False, bump_epoch=True))
    transitions_before = (await store.counters()).get(
        ("transitions", "WAITING_FOR_RESOURCE>GENERATING"), 0
    )
    # When the worker acquires all three in one call
    results = await store.apply_many([step_change(task, Event.ACQUIRE) for task in claimed])
    # Then the stale one is refused alone, as its own apply would be, and the others commit
    assert isinstance(results[1], LeaseLost)
    for index in (0, 2):
        task, events = results[index]  # type: ignore[misc]
        assert task.status is Status.GENERATING
        assert [(e.event, e.status) for e in events] == [(Event.ACQUIRE, Status.GENERATING)]
    rows = dict(truth("SELECT id, status FROM tasks"))
    assert rows[claimed[0].id] == "GENERATING" and rows[claimed[2].id] == "GENERATING"
    assert rows[stale.id] == "TIMEOUT"
    # And every task's log still replays to its status, with the counts to match
    for task in claimed:
        events = await store.events(task_id=task.id)
        status = replay((e.event, e.from_status, e.status) for e in events)
        assert str(status) == rows[task.id]
    counters = await store.counters()
    assert counters[("transitions", "WAITING_FOR_RESOURCE>GENERATING")] == transitions_before + 2
    assert counters.get(("stale_writes", ""), 0) == 1
    stats = await store.stats(tenant=None, ghost_after_s=60)
    assert stats.counts["GENERATING"] == 2 and stats.counts["TIMEOUT"] == 1


async def test_a_batch_answers_each_refusal_as_apply_would(store: Store) -> None:
    # Given a pending task, and a change for a task that does not exist
    task = (await store.submit(make_new_task())).task
    ghost = replace(step_change(task, Event.CANCEL, fenced=False), task_id="tsk_none")
    # When a batch cancels it twice and touches the missing one
    cancel = step_change(task, Event.CANCEL, fenced=False)
    results = await store.apply_many([cancel, cancel, ghost])
    # Then the first cancel lands, the repeat is a conflict, the missing task is not found
    assert results[0][0].status is Status.CANCELLED  # type: ignore[index]
    assert isinstance(results[1], Conflict)
    assert isinstance(results[2], NotFound)
    assert len(await store.events(task_id=task.id)) == 2  # submit, cancel


async def test_an_empty_batch_writes_nothing(store: Store) -> None:
    assert await store.apply_many([]) == []
