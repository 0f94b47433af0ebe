"""The event tail (kiln.bus.EventHub) reads the log at once after a local write only while
someone subscribes; with nobody subscribed it moves to the log's end at its poll interval,
reading no event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

import kiln
from kiln import demo
from kiln.bus import Subscription
from kiln.config import Settings
from kiln.models import TaskEvent


@pytest.fixture
async def app(each_store: Settings) -> AsyncIterator[kiln.App]:
    """An App with the demo kind on each store backend."""
    instance = kiln.App(settings=each_store)
    demo.register(instance)
    async with instance:
        yield instance


async def test_local_writes_make_no_log_read_while_nobody_subscribes(
    app: kiln.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a started tail that polls once an hour, and every read of the log counted
    hub = app.hub
    hub.poll_interval_s = 3600.0
    store = app.engine.store
    reads: list[str] = []
    tail, last_seq = store.tail, store.last_seq

    async def counted_tail(*, after: int, limit: int = 1000) -> Any:
        reads.append("tail")
        return await tail(after=after, limit=limit)

    async def counted_end() -> int:
        reads.append("end")
        return await last_seq()

    monkeypatch.setattr(store, "tail", counted_tail)
    monkeypatch.setattr(store, "last_seq", counted_end)
    await hub.start()
    await asyncio.sleep(0)  # its first poll: to the log's end (SQLite: no event read)
    first = ["end", "end"] if store.commits_in_seq_order else ["end", "tail"]
    assert reads == first
    # When twenty tasks are submitted with nobody subscribed
    for n in range(20):
        await app.submit("image.generate", {"prompt": f"unwatched {n}"})
    # Then the tail read nothing more, not even the log's end
    assert reads == first
    # And a subscriber is caught up at once, and sees a new task's submit live
    async with hub.subscribe(tenant="default") as sub:
        seen = await app.submit("image.generate", {"prompt": "watched"})
        event = await asyncio.wait_for(_next_submit(sub.queue, seen.task.id), timeout=10)
        assert event.task_id == seen.task.id
        assert hub.last_seq == await store.last_seq()


async def _next_submit(queue: asyncio.Queue[Any], task_id: str) -> TaskEvent:
    while True:
        message = await queue.get()
        if isinstance(message, TaskEvent) and message.task_id == task_id:
            return message


async def test_a_feed_opened_after_unwatched_writes_replays_them_then_goes_live(
    app: kiln.App,
) -> None:
    # Given a tail that polls once an hour, and tasks submitted with nobody watching
    app.hub.poll_interval_s = 3600.0
    await app.hub.start()
    before = [
        (await app.submit("image.generate", {"prompt": f"before {n}"})).task.id for n in range(5)
    ]
    # When a tenant feed opens (replay on) and one more task comes
    seen: list[str] = []
    replayed, done = asyncio.Event(), asyncio.Event()

    async def follow() -> None:
        async for message in app.watch(tenant="default"):
            if isinstance(message, TaskEvent):
                seen.append(message.task_id)
                if len(seen) == len(before):
                    replayed.set()
                elif len(seen) > len(before):
                    done.set()

    following = asyncio.create_task(follow())
    await asyncio.wait_for(replayed.wait(), timeout=10)
    after = (await app.submit("image.generate", {"prompt": "after"})).task.id
    await asyncio.wait_for(done.wait(), timeout=10)
    following.cancel()
    # Then it showed every submit once, in order, the live one last
    assert seen == [*before, after]


@pytest.mark.sqlite_only  # PostgreSQL's tail reads the log past its gaps, never its end
async def test_a_subscriber_that_comes_while_the_tail_finds_the_logs_end_misses_nothing(
    app: kiln.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a started tail with nobody subscribed, and a task submitted since its last poll
    hub = app.hub
    hub.poll_interval_s = 3600.0
    await hub.start()
    store = app.engine.store
    made = await app.submit("image.generate", {"prompt": "submitted unwatched"})
    # When a subscriber comes while the tail reads where the log ends
    sub = Subscription(hub, made.task.id, None)
    last_seq = store.last_seq

    async def subscribed_meanwhile() -> int:
        hub.subscribers.add(sub)
        return await last_seq()

    monkeypatch.setattr(store, "last_seq", subscribed_meanwhile)
    await hub._poll()
    # Then the tail does not pass the task's events unread: the subscriber gets them
    event = await asyncio.wait_for(_next_submit(sub.queue, made.task.id), timeout=10)
    assert event.task_id == made.task.id
    sub.close()
