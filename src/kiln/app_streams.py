"""The App's streams: a task's or a tenant's status events, replayed from the log and then
live, with live progress shown in an order a client can trust (``App.watch``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kiln import pipelines
from kiln.bus import Message, Subscription
from kiln.engine import Engine
from kiln.models import Task, TaskEvent
from kiln.states import BEFORE_GENERATING, Status

__all__ = ["HISTORY_PAGE", "STATUS_MEMORY", "StreamOrder", "Streams"]

HISTORY_PAGE = 500
#: How many tasks' latest status a stream remembers to keep progress behind its status.
STATUS_MEMORY = 10_000


class StreamOrder:
    """What a stream shows of its messages, in an order a client can trust: progress only
    once the task's GENERATING event was shown. Live progress may overtake that event (the
    event comes through the log's tail, progress at once); the latest such progress is held
    back and shown right after the event, and dropped if the task goes another way."""

    def __init__(self) -> None:
        self.status_of: dict[str, Status] = {}
        self.held: dict[str, Message] = {}

    def admit(self, message: Message) -> list[Message]:
        """The messages to show now for ``message`` (none, it, or it and held progress)."""
        shown: list[Message] = []
        if isinstance(message, TaskEvent):
            self.status_of[message.task_id] = message.status
            shown.append(message)
            if message.status is Status.GENERATING:
                early = self.held.pop(message.task_id, None)
                if early is not None:
                    shown.append(early)
            elif message.status not in BEFORE_GENERATING:
                self.held.pop(message.task_id, None)
        else:
            status = self.status_of.get(message.task_id, Status.GENERATING)
            if status == Status.GENERATING:
                shown.append(message)
            elif status in BEFORE_GENERATING:
                self.held[message.task_id] = message
        for memory in (self.status_of, self.held):  # a long-lived feed forgets old tasks
            if len(memory) > STATUS_MEMORY:
                del memory[next(iter(memory))]
        return shown


class Streams:
    """The status events and progress of one task, one pipeline or a tenant's feed."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def watch(
        self,
        task_id: str | None = None,
        *,
        tenant: str | None = None,
        after: int | None = None,
        replay: bool = True,
    ) -> AsyncIterator[Message]:
        """Status events (replayed from the log, then live) and live progress.

        For one task the stream ends after its final event; the tenant feed never ends. A
        pipeline's stream carries its steps' events too (:meth:`pipeline`).
        """
        found = None if task_id is None else await self.engine.store.get(task_id)
        if found is not None and found.kind == pipelines.KIND:
            stream = self.pipeline(found, after or 0)
        else:
            stream = self.events(task_id, tenant=tenant, after=after, replay=replay)
        async for message in stream:
            yield message

    async def events(
        self, task_id: str | None, *, tenant: str | None, after: int | None, replay: bool
    ) -> AsyncIterator[Message]:
        """The stream of one task (until its final event) or of a tenant's feed."""
        hub = self.engine.hub
        async with hub.subscribe(task_id=task_id, tenant=tenant) as sub:
            live_only = task_id is None and after is None and not replay
            last = after or 0
            if live_only:  # "from now": what committed before, even if the tail lags
                last = max(hub.last_seq, await self.engine.store.last_seq())
            replayed, final_seen = False, False
            order = StreamOrder()
            # A feed of many tasks replays up to where the tail stands and takes the rest
            # live: past that point a smaller seq may still commit (PostgreSQL). One
            # task's events commit in seq order, so its replay reads to the end.
            upto = None if task_id is not None else hub.last_seq
            async for event in self.history(task_id, tenant, last, upto):
                last, replayed, final_seen = event.seq, True, event.final
                order.admit(event)
                yield event
            if task_id is not None and await self._ended(task_id, replayed, final_seen):
                return
            while True:
                async for message in self._next(sub, task_id, tenant, last):
                    if isinstance(message, TaskEvent):
                        last = message.seq
                    for shown in order.admit(message):
                        yield shown
                        if task_id is not None and shown.final:
                            return

    async def pipeline(self, pipeline: Task, after: int) -> AsyncIterator[Message]:
        """A pipeline's events and its steps' (status and progress), replayed then live,
        until the pipeline's final event. New steps appear with a step's final event or
        the pipeline's own: the steps are read again then."""
        async with self.engine.hub.subscribe(task_id=None, tenant=pipeline.tenant) as sub:
            follow = PipelineFollow(self, pipeline.id, after)
            for event in await follow.catch_up() + await follow.catch_up():
                yield event  # twice: steps made while the first replay read
            current = await self.engine.store.get(pipeline.id)
            if current is None or current.final:
                return
            while True:
                message = await sub.queue.get()
                batch = await follow.catch_up() if sub.lagged else follow.admit(message)
                sub.lagged = False
                while batch:
                    shown = batch.pop(0)
                    yield shown
                    if shown.task_id == pipeline.id and shown.final:
                        return
                    if isinstance(shown, TaskEvent) and (
                        shown.final or shown.task_id == pipeline.id
                    ):
                        batch += await follow.catch_up()

    async def _ended(self, task_id: str, replayed: bool, final_seen: bool) -> bool:
        """Whether a task stream is done after its replay: its latest event was final."""
        if replayed:
            return final_seen
        task = await self.engine.store.get(task_id)
        return task is not None and task.final

    async def _next(
        self, sub: Subscription, task_id: str | None, tenant: str | None, last: int
    ) -> AsyncIterator[Message]:
        """The next messages of a subscription, re-read from the log if it fell behind."""
        message = await sub.queue.get()
        if sub.lagged:
            sub.lagged = False
            upto = None if task_id is not None else self.engine.hub.last_seq
            async for event in self.history(task_id, tenant, last, upto):
                yield event
        elif not isinstance(message, TaskEvent) or message.seq > last:
            yield message

    async def history(
        self, task_id: str | None, tenant: str | None, after: int, upto: int | None = None
    ) -> AsyncIterator[TaskEvent]:
        """The persisted events after ``after`` (up to ``upto``), read page by page."""
        while True:
            page = await self.engine.events(
                task_id=task_id, tenant=tenant, after=after, limit=HISTORY_PAGE
            )
            for event in page:
                if upto is not None and event.seq > upto:
                    return
                yield event
            if len(page) < HISTORY_PAGE:
                return
            after = page[-1].seq

    async def wait(self, task_id: str, *, timeout_s: float | None = None) -> Task:
        """Wait until the task is final and return it."""

        async def follow() -> Task:
            async for _ in self.watch(task_id):
                pass
            return await self.engine.get(task_id, None)

        return await asyncio.wait_for(follow(), timeout_s)


class PipelineFollow:
    """What a pipeline's stream has shown: the tasks it follows, the events it sent."""

    def __init__(self, streams: Streams, pipeline_id: str, after: int) -> None:
        self.streams, self.pipeline_id, self.after = streams, pipeline_id, after
        self.ids: set[str] = {pipeline_id}
        self.seen: set[int] = set()

    async def catch_up(self) -> list[Message]:
        """The pipeline's steps read again, and the events of them all not sent yet."""
        store = self.streams.engine.store
        current = await store.get(self.pipeline_id)
        if current is not None:
            self.ids.update(t.id for t in (await store.pipeline_steps(current)).values())
        history = self.streams.history
        found = [e for i in sorted(self.ids) async for e in history(i, None, self.after)]
        fresh = sorted((e for e in found if e.seq not in self.seen), key=lambda e: e.seq)
        self.seen.update(e.seq for e in fresh)
        return list(fresh)

    def admit(self, message: Message) -> list[Message]:
        """A live message, when it is one of the pipeline's and was not sent yet."""
        if message.task_id not in self.ids:
            return []
        if isinstance(message, TaskEvent):
            if message.seq in self.seen:
                return []
            self.seen.add(message.seq)
        return [message]
