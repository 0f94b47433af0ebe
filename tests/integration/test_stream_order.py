"""A stream shows progress only after its task's GENERATING event, and loses none that
overtook that event (App.watch, StreamOrder)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import kiln
from kiln.bus import Message, ProgressEvent
from kiln.config import Settings
from kiln.models import Task, TaskEvent
from kiln.states import Event, Status
from kiln.store.records import WORKER

KIND = "test.plain"


def shown(messages: list[Message]) -> list[str]:
    return [str(m.event) if isinstance(m, TaskEvent) else f"progress:{m.stage}" for m in messages]


@contextlib.asynccontextmanager
async def watched(settings: Settings, n: int) -> AsyncIterator[tuple[kiln.App, Task, Follow]]:
    """An app with a no-op kind, a task of it, and a stream of the task that has replayed
    its submit (it knows the task PENDING); ``follow`` ends with the stream."""
    app = kiln.App(settings=settings)

    @app.task(KIND)
    async def plain(ctx: object, params: dict[str, object]) -> None:
        return None

    async with app:
        task = (await app.submit(KIND, {"n": n})).task
        seen: list[Message] = []
        replayed = asyncio.Event()

        async def follow() -> None:
            async for message in app.watch(task.id):
                seen.append(message)
                replayed.set()

        following = asyncio.create_task(follow())
        await asyncio.wait_for(replayed.wait(), timeout=10)
        yield app, task, Follow(following, seen)


@dataclass
class Follow:
    task: asyncio.Task[None]
    seen: list[Message]

    async def to_the_end(self) -> list[str]:
        await asyncio.wait_for(self.task, timeout=10)
        return shown(self.seen)


async def test_progress_that_overtakes_its_generating_event_is_shown_right_after_it(
    settings: Settings,
) -> None:
    async with watched(settings, 1) as (app, task, stream):
        # When progress arrives before the task's GENERATING event has reached the stream
        early = ProgressEvent(task.id, task.tenant, "GENERATING", "loading_model", None)
        app.engine.publish_progress(early)
        (claimed,) = await app.engine.store.claim(
            worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=30, acquire=[KIND]
        )
        app.engine.hub.poke()
        generated = await app.engine.apply(claimed, Event.GENERATED, fence=WORKER)
        await app.engine.apply(generated, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
        seen = await stream.to_the_end()
    # Then the stream shows it right after the GENERATING event, once
    assert seen == [
        "submit", "claim", "acquire", "progress:loading_model", "generated", "uploaded",
    ]  # fmt: skip


async def test_progress_of_a_task_that_goes_another_way_is_dropped(settings: Settings) -> None:
    async with watched(settings, 2) as (app, task, stream):
        # When stray progress comes while it is PENDING, and then it is cancelled
        stray = ProgressEvent(task.id, task.tenant, "GENERATING", "loading_model", None)
        app.engine.publish_progress(stray)
        await app.cancel(task.id)
        seen = await stream.to_the_end()
    # Then no progress was shown
    assert seen == ["submit", "cancel"]
