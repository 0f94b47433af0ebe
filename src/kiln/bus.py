"""In-process fan-out of task events, fed by one tail of the store's event log.

Every status event reaches subscribers through the tail, in ``seq`` order, whichever
process wrote it; a local write only pokes the tail so it reads at once (while anyone
subscribes: else the tail moves on every ``poll_interval_s``; where events commit in seq
order (SQLite) straight to the log's end, without reading the events nobody would get).
Progress is not persisted on every step: a local worker publishes it directly, and
progress saved by workers in other processes is picked up by the same tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kiln.models import JSON, TaskEvent
from kiln.states import Status
from kiln.store import Store

log = logging.getLogger("kiln.bus")


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    task_id: str
    tenant: str
    status: str
    stage: str | None
    progress: JSON | None
    preview: str | None = None

    @property
    def final(self) -> bool:
        return False

    def to_json(self) -> JSON:
        body: JSON = {
            "type": "progress",
            "task_id": self.task_id,
            "status": self.status,
            "stage": self.stage,
            "progress": self.progress,
        }
        if self.preview is not None:
            body["preview"] = self.preview
        return body


Message = TaskEvent | ProgressEvent


class Subscription:
    def __init__(self, hub: EventHub, task_id: str | None, tenant: str | None) -> None:
        self.hub = hub
        self.task_id = task_id
        self.tenant = tenant
        self.queue: asyncio.Queue[Message] = asyncio.Queue(maxsize=2000)
        self.lagged = False

    def wants(self, message: Message) -> bool:
        if self.task_id is not None:
            return message.task_id == self.task_id
        return self.tenant is None or message.tenant == self.tenant

    def offer(self, message: Message) -> None:
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.lagged = True  # the reader re-reads the log from its last seq

    def close(self) -> None:
        self.hub.subscribers.discard(self)


class EventHub:
    def __init__(self, store: Store, *, poll_interval_s: float = 0.1) -> None:
        self.store = store
        self.poll_interval_s = poll_interval_s
        self.subscribers: set[Subscription] = set()
        self.local_progress: set[str] = set()
        self.last_seq = 0
        self._progress_since = 0.0
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._closing = False

    def poke(self) -> None:
        """A local write: read the log at once, if anyone listens. With nobody
        subscribed the tail keeps its place every ``poll_interval_s`` instead: a read
        per write would serve nobody (a new subscriber pokes it)."""
        if self.subscribers:
            self._poke.set()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kiln-event-tail")
        await self._started.wait()

    async def close(self) -> None:
        if self._task is not None:
            # Python 3.11's wait_for swallows a cancel that lands as the poke fires;
            # the flag ends the loop then.
            self._closing = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @contextlib.asynccontextmanager
    async def subscribe(
        self, *, task_id: str | None = None, tenant: str | None = None
    ) -> AsyncIterator[Subscription]:
        await self.start()
        sub = Subscription(self, task_id, tenant)
        self.subscribers.add(sub)
        self._poke.set()  # the tail catches up now, not at its next poll
        try:
            yield sub
        finally:
            sub.close()

    def publish(self, message: Message) -> None:
        for sub in list(self.subscribers):
            if sub.wants(message):
                sub.offer(message)

    async def _run(self) -> None:
        self.last_seq = await self.store.last_seq()
        self._progress_since = self.store.clock()
        self._started.set()
        while not self._closing:
            try:
                await self._poll()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event_tail_failed")
            with contextlib.suppress(TimeoutError):  # (not wait_for: see kiln.webhooks)
                async with asyncio.timeout(self.poll_interval_s):
                    await self._poke.wait()
            self._poke.clear()

    async def _poll(self) -> None:
        if not self.subscribers and self.store.commits_in_seq_order:
            # Nobody to publish to: move to the log's end without reading its events
            # (where they commit in seq order, nothing can still appear before it). A
            # subscriber that came meanwhile starts where the tail stood: keep it.
            end = await self.store.last_seq()
            if not self.subscribers:
                self.last_seq = max(self.last_seq, end)
                self._progress_since = self.store.clock()
                return
        while True:
            batch = await self.store.tail(after=self.last_seq, limit=1000)
            for event in batch:
                self.last_seq = event.seq
                self.publish(event)
            if len(batch) < 1000:
                break
        if not self.subscribers:
            self._progress_since = self.store.clock()
            return
        for task in await self.store.progressed(since=self._progress_since):
            self._progress_since = max(self._progress_since, task.progress_at or 0.0)
            if task.id in self.local_progress or task.status is not Status.GENERATING:
                continue
            self.publish(
                ProgressEvent(task.id, task.tenant, str(task.status), task.stage, task.progress())
            )


def event_json(message: Any) -> JSON:
    data: JSON = message.to_json()
    return data
