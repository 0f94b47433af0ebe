"""A stream shows progress only after its task's GENERATING event, and loses none that
overtook that event (App.watch, StreamOrder)."""

from __future__ import annotations

import asyncio

import kiln
from kiln.bus import Message, ProgressEvent
from kiln.config import Settings
from kiln.models import TaskEvent
from kiln.states import Event, Status

KIND = "test.plain"


def shown(messages: list[Message]) -> list[str]:
    return [str(m.event) if isinstance(m, TaskEvent) else f"progress:{m.stage}" for m in messages]


async def test_progress_that_overtakes_its_generating_event_is_shown_right_after_it(
    settings: Settings,
) -> None:
    app = kiln.App(settings=settings)

    @app.task(KIND)
    async def plain(ctx: object, params: dict[str, object]) -> None:
        return None

    async with app:
        task = (await app.submit(KIND, {"n": 1})).task
        seen: list[Message] = []
        replayed = asyncio.Event()

        async def follow() -> None:
            async for message in app.watch(task.id):
                seen.append(message)
                replayed.set()

        following = asyncio.create_task(follow())
        await asyncio.wait_for(replayed.wait(), timeout=10)  # the stream knows it PENDING
        # When progress arrives before the task's GENERATING event has reached the stream,
        # and progress for a task that will not run (it is cancelled) too
        early = ProgressEvent(task.id, task.tenant, "GENERATING", "loading_model", None)
        app.engine.publish_progress(early)
        (claimed,) = await app.engine.store.claim(
            worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=30, acquire=[KIND]
        )
        app.engine.hub.poke()
        generated = await app.engine.apply(claimed, Event.GENERATED, fenced=True)
        await app.engine.apply(generated, Event.UPLOADED, Status.SUCCESS, fenced=True)
        await asyncio.wait_for(following, timeout=10)
    # Then the stream shows it right after the GENERATING event, once
    assert shown(seen) == [
        "submit", "claim", "acquire", "progress:loading_model", "generated", "uploaded",
    ]  # fmt: skip


async def test_progress_of_a_task_that_goes_another_way_is_dropped(settings: Settings) -> None:
    app = kiln.App(settings=settings)

    @app.task(KIND)
    async def plain(ctx: object, params: dict[str, object]) -> None:
        return None

    async with app:
        task = (await app.submit(KIND, {"n": 2})).task
        seen: list[Message] = []
        replayed = asyncio.Event()

        async def follow() -> None:
            async for message in app.watch(task.id):
                seen.append(message)
                replayed.set()

        following = asyncio.create_task(follow())
        await asyncio.wait_for(replayed.wait(), timeout=10)
        # When stray progress comes while it is PENDING, and then it is cancelled
        stray = ProgressEvent(task.id, task.tenant, "GENERATING", "loading_model", None)
        app.engine.publish_progress(stray)
        await app.cancel(task.id)
        await asyncio.wait_for(following, timeout=10)
    # Then no progress was shown
    assert shown(seen) == ["submit", "cancel"]
