"""Submissions that arrive together are answered each as if it came alone: its own task
or the one holding its content, the task's queue position as a read gives it, one submit
event per new task, the queue's counts kept (SQLite writes the plain ones of a group commit
together, :mod:`kiln.store.sqlite_submits`; PostgreSQL one by one, at once)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from kiln.models import NewTask, SubmitResult
from kiln.states import Event
from kiln.store import Store, sqlite_submits
from kiln.store.sqlite import SqliteStore
from kiln.store.tx import Tx

from .factories import SettableClock, make_new_task

pytestmark = pytest.mark.usefixtures("queue_counts_checked")


@asynccontextmanager
async def writer_held(store: Store) -> AsyncIterator[None]:
    """On SQLite, the writer thread busy until the block ends, so that what is submitted
    inside it queues up and is written in the next group commit; elsewhere nothing."""
    if not isinstance(store, SqliteStore):
        yield
        return
    started, release = threading.Event(), threading.Event()

    async def hold(_: Tx) -> None:
        started.set()
        release.wait()

    holding = asyncio.ensure_future(store._write(hold))
    await asyncio.to_thread(started.wait)
    try:
        yield
    finally:
        release.set()
        await holding


async def queued(store: Store, count: int) -> None:
    """Until ``count`` operations wait for SQLite's held writer (each submission queues
    itself before its first suspension, so a few turns of the loop do it)."""
    if not isinstance(store, SqliteStore):
        return
    for _ in range(100):
        if store._writer._jobs.qsize() >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{store._writer._jobs.qsize()} of {count} submissions queued")


async def at_once(store: Store, news: list[NewTask]) -> list[SubmitResult]:
    async with writer_held(store):
        pending: list[Awaitable[SubmitResult]] = [
            asyncio.ensure_future(store.submit(new, place=True)) for new in news
        ]
        await queued(store, len(news))
    return list(await asyncio.gather(*pending))


async def assert_each_as_read(store: Store, results: list[SubmitResult]) -> None:
    for result in results:
        assert result.placed
        assert result.queue_position == await store.queue_position(result.task)


def grouped(store: Store) -> int | None:
    """Submissions SQLite's writer wrote together with others (None elsewhere)."""
    return store.grouped_submits if isinstance(store, SqliteStore) else None


async def submit_events(store: Store, task_id: str) -> list[Any]:
    return [e for e in await store.events(task_id=task_id) if e.event == Event.SUBMIT]


async def test_submissions_at_once_are_answered_each_as_alone(
    store: Store, clock: SettableClock
) -> None:
    # Given a task already queued at priority 0
    older = await store.submit(make_new_task({"n": "old"}), place=True)
    clock.advance(1)
    # When two tasks at priority 3, new content, the same content again, the older task's
    # content, another tenant's task, a delayed task and a keyed one arrive together
    news = [
        make_new_task({"n": 2}, priority=3),
        make_new_task({"n": 6}, priority=3),
        make_new_task({"n": 1}),
        make_new_task({"n": 1}),  # the one before's content
        make_new_task({"n": "old"}),  # the older task's
        make_new_task({"n": 3}, tenant="other"),
        replace(make_new_task({"n": 4}), run_at=clock() + 60),
        make_new_task({"n": 5}, idempotency_key="key-5"),
        make_new_task({"n": 7}),
    ]
    was = grouped(store)
    results = await at_once(store, news)
    # (SQLite wrote the seven plain ones before the keyed one together)
    assert was is None or grouped(store) == was + 7
    # Then each new content made one task, and each repeat answers with its holder
    created = [r for r in results if r.created]
    assert len(created) == 7
    assert len({r.task.id for r in created}) == 7
    assert (results[3].deduplicated, results[3].task.id) == (True, results[2].task.id)
    assert (results[4].deduplicated, results[4].task.id) == (True, older.task.id)
    # And each answer's position is the one a read gives (nothing that came after went
    # ahead of it), the delayed task none: priority 3 first, then the line at 0 in order
    # (on SQLite all of them are one group commit; on PostgreSQL each is its own
    # transaction, and commits at once may land in any order: each position is a place)
    positions = [r.queue_position for r in results]
    if isinstance(store, SqliteStore):
        await assert_each_as_read(store, results)
        assert positions == [1, 2, 4, 4, 3, 5, None, 6, 7]
    else:
        assert positions[6] is None
        assert all(1 <= p <= 7 for p in positions[:6] + positions[7:])  # type: ignore[operator]
    # And each new task has exactly one submit event
    for result in created:
        assert len(await submit_events(store, result.task.id)) == 1
    # And the keyed one replays alone
    again = await store.submit(make_new_task({"n": 5}, idempotency_key="key-5"), place=True)
    assert (again.replayed, again.task.id) == (True, results[7].task.id)


@pytest.mark.sqlite_only
async def test_a_line_with_others_among_the_group_reads_each_position(
    store: Store, clock: SettableClock
) -> None:
    # Given three tasks queued before
    first = [(await store.submit(make_new_task({"n": n}), place=True)).task for n in range(3)]
    clock.advance(1)
    # When the first one's content arrives with two new ones (the line's two ends are not
    # the group's alone: the two older tasks stand between them)
    results = await at_once(
        store, [make_new_task({"n": 0}), make_new_task({"n": 10}), make_new_task({"n": 11})]
    )
    # Then each answers where it stands
    assert results[0].task.id == first[0].id
    assert [r.queue_position for r in results] == [1, 4, 5]
    await assert_each_as_read(store, results)


async def test_many_at_once_take_consecutive_places(store: Store) -> None:
    results = await at_once(store, [make_new_task({"n": n}) for n in range(40)])
    assert all(r.created for r in results)
    assert grouped(store) in (None, 40)
    if not isinstance(store, SqliteStore):
        return  # each its own transaction: places as of each one's commit
    by_place = sorted(results, key=lambda r: r.queue_position or 0)
    assert [r.queue_position for r in by_place] == list(range(1, 41))
    # In the line's order: each task's key (ready time, id) before the next one's
    keys = [(r.task.ready_at, r.task.id) for r in by_place]
    assert keys == sorted(keys)
    await assert_each_as_read(store, results)


# SQLite's group, where it leaves the submissions to the one-by-one path -----------------


def sqlite_of(store: Store) -> SqliteStore:
    assert isinstance(store, SqliteStore)
    return store


@pytest.mark.sqlite_only
async def test_a_content_key_the_group_did_not_see_runs_the_batch_again_one_by_one(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    sqlite = sqlite_of(store)
    holder = await store.submit(make_new_task({"n": 1}), place=True)
    # Given a group whose look-up of content keys misses the row holding one (its INSERT
    # then writes fewer rows than asked, after the rows it wrote)
    monkeypatch.setattr(sqlite_submits, "_held_content", lambda tx, items: {})
    reruns = sqlite._writer.reruns
    news = [make_new_task({"n": n}) for n in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    news += [make_new_task({"n": n}) for n in (16, 17, 1)]
    results = await at_once(store, news)
    # Then the batch ran again with a savepoint each, and answered as alone
    assert sqlite._writer.reruns == reruns + 1
    assert grouped(store) == 0
    assert (results[-1].deduplicated, results[-1].task.id) == (True, holder.task.id)
    assert [r.created for r in results] == [True] * 16 + [False]
    assert len((await store.list_tasks(tenant=None, limit=100))[0]) == 17
    await assert_each_as_read(store, results)


@pytest.mark.sqlite_only
async def test_a_row_the_writer_cannot_build_sends_the_group_one_by_one(store: Store) -> None:
    # Given a group with a submission whose row SQLite stores another way (an int priority
    # given as a bool reads back as 1): nothing is written, each one runs alone
    first = make_new_task({"n": 0}, priority=1)
    odd = replace(make_new_task({"n": 1}), priority=True)
    line = [first, odd, make_new_task({"n": 2}, priority=1)]
    results = await at_once(store, line)
    assert grouped(store) == 0
    assert [r.created for r in results] == [True, True, True]
    stored = await store.get(results[1].task.id)
    assert stored is not None and stored.priority == 1 and type(stored.priority) is int
    assert results[1].task == stored
    await assert_each_as_read(store, results)
