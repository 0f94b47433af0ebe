"""A worker's slots and resources: this process's resource slots (:class:`ResourcePool`,
``--gpus``), what each kind needs, and its attempts' places in the shared pools' lines
(KILN_POOLS), which the store keeps for every worker on every machine."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Iterable

from kiln.engine import Engine
from kiln.errors import StoreUnavailable
from kiln.kinds import TaskKind
from kiln.models import Task
from kiln.store.pools import units_needed
from kiln.worker.attempt import Attempt, ids

log = logging.getLogger("kiln.worker")

#: How often a task waiting in a shared pool's line asks again (seconds, doubling), and
#: at least how often the first in line asks. A slot freed in this process wakes the
#: first of its waiters at once; a waiter that got its slot wakes the next.
POOL_POLL_S = (0.05, 1.0)
POOL_HEAD_POLL_S = 0.2


class ResourcePool:
    """Named counting semaphores of one worker process (``{"gpu": 1}``), FIFO."""

    def __init__(self, capacities: dict[str, int]) -> None:
        self.capacities = dict(capacities)
        self._semaphores = {name: asyncio.Semaphore(n) for name, n in capacities.items()}
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def hold(self, needs: dict[str, int]) -> AsyncIterator[None]:
        taken: list[asyncio.Semaphore] = []
        self.waiting += 1
        try:
            for name in sorted(needs):  # one global order: no deadlock between kinds
                semaphore = self._semaphores.get(name)
                if semaphore is None:
                    continue  # this worker does not limit that resource
                for _ in range(min(needs[name], self.capacities[name])):
                    await semaphore.acquire()
                    taken.append(semaphore)
        except BaseException:
            self.waiting -= 1
            for semaphore in taken:
                semaphore.release()
            raise
        self.waiting -= 1
        try:
            yield
        finally:
            for semaphore in taken:
                semaphore.release()


class Slots:
    """What a worker's attempts take: this process's slots (:attr:`pool`), each kind's
    :attr:`needs`, and the shared pools' lines; :attr:`free` wakes the claim loop when a
    slot comes back."""

    def __init__(self, engine: Engine, resources: dict[str, int]) -> None:
        self.engine = engine
        self.pool = ResourcePool(resources)
        #: What each kind takes: its code's resources with KILN_KIND_RESOURCES on top.
        self.needs = {
            name: engine.settings.kind_needs(name, kind.resources)
            for name, kind in engine.kinds.items()
        }
        #: Set when a place of ``concurrency`` or a pool's slot may have come back.
        self.free = asyncio.Event()
        #: This process's attempts waiting in shared pools' lines, in arrival order.
        self.waiters: list[Attempt] = []
        self._rng = random.Random()

    def needs_of(self, kind: TaskKind, task: Task) -> dict[str, int]:
        """What ``task`` takes of each pool; params its amounts cannot read take the
        kind's resources (the handler refuses such params when it parses them)."""
        try:
            return kind.needs_of(task.params, self.needs[kind.name])
        except Exception as exc:  # the attempt fails on its params anyway
            log.warning("amounts_failed", extra={"task_id": task.id, "error": repr(exc)})
            return dict(self.needs[kind.name])

    def room(
        self, kinds: list[str], free: int, attempts: Iterable[Attempt]
    ) -> tuple[list[str], int]:
        """The kinds to claim and how many: this process keeps at most a shared pool's
        capacity of attempts before that pool (claimed, waiting or holding a slot), so a
        busy pool leaves its tasks PENDING, in the queue, instead of waiting here."""
        capacities = self.engine.settings.pools
        if not capacities:
            return kinds, free
        before = collections.Counter(
            pool
            for attempt in attempts
            if not attempt.past_pools
            for pool in units_needed(attempt.needs, capacities)
        )
        keep = []
        for kind in kinds:
            pools = units_needed(self.needs[kind], capacities)
            room = min((capacities[p] - before[p] for p in pools), default=free)
            if room > 0:
                keep.append(kind)
                free = min(free, room)
        return keep, free

    async def acquire_shared(self, attempt: Attempt, needs: dict[str, int]) -> None:
        """Wait in line for the task's slots of the shared pools (KILN_POOLS); the store
        keeps the line, so every worker on every machine shares it."""
        capacities = self.engine.settings.pools
        if not units_needed(needs, capacities):
            return
        delay = POOL_POLL_S[0]
        self.waiters.append(attempt)
        try:
            while True:
                attempt.pool_wake.clear()  # a wake-up from now on is kept for the wait below
                task = attempt.task
                in_line = attempt.pool_wait is not None
                try:
                    wait = await self.engine.store.pools.acquire(
                        task.id, task.epoch, needs, capacities, in_line=in_line
                    )
                except StoreUnavailable as exc:  # keep the place; the lease decides how long
                    log.warning("pool_acquire_failed", extra={**ids(attempt), "error": exc.message})
                    wait = attempt.pool_wait
                else:
                    if wait is None:
                        attempt.pool_wait = None
                        return
                    if wait != attempt.pool_wait:
                        log.info(
                            "pool_wait",
                            extra={
                                **ids(attempt),
                                "pool": wait.pool,
                                "position": wait.position,
                                "held": wait.held,
                                "capacity": wait.capacity,
                            },
                        )
                    attempt.pool_wait = wait
                ceiling = POOL_HEAD_POLL_S if wait and wait.position == 1 else POOL_POLL_S[1]
                delay = min(delay, ceiling)
                pause = delay * self._rng.uniform(0.5, 1.0)
                with contextlib.suppress(TimeoutError):  # (not wait_for: see kiln.webhooks)
                    async with asyncio.timeout(pause):
                        await attempt.pool_wake.wait()
                delay = min(delay * 2, ceiling)
        finally:
            self.waiters.remove(attempt)
            self.wake_waiters()  # the next in line may have moved up

    def wake_waiters(self) -> None:
        """A slot of this process came back, or its first waiter left the line: the first
        waiter asks again now (one ask, not one per waiter), and the claim loop may take
        more of the pool's tasks."""
        if self.waiters:
            self.waiters[0].pool_wake.set()
        if self.engine.settings.pools:
            self.free.set()

    def lease_lapsed(self, attempt: Attempt) -> bool:
        """A shared pool's slot counts only while the attempt's lease runs: once it lapsed
        (a paused process, a store that did not answer) another task may hold the slot,
        so an attempt before or in a pool stops instead of renewing the lease."""
        if attempt.past_pools or not units_needed(attempt.needs, self.engine.settings.pools):
            return False
        return self.engine.now() >= (attempt.task.lease_expires_at or 0.0)
