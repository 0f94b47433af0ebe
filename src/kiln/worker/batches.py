"""Batches of a batching kind (:class:`~kiln.kinds.BatchPolicy`): claimed tasks of one
key grouped, filled for at most the policy's wait, given their resources once, and run
through one call of the handler (see :class:`~kiln.worker.attempt.Batch`)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

from kiln.errors import LeaseLost, StoreUnavailable
from kiln.models import Task
from kiln.store.pools import units_needed
from kiln.worker.attempt import Batch
from kiln.worker.context import Context
from kiln.worker.running import Runner

log = logging.getLogger("kiln.worker")

#: How often a batch that is not full yet looks for more tasks of its key (seconds).
BATCH_FILL_POLL_S = 0.01


class Batches:
    """The batches a worker runs (:attr:`running`; each takes one place of its
    ``concurrency``). ``stopped`` says when the worker claims nothing more."""

    def __init__(
        self, runner: Runner, worker_id: str, lease_ttl_s: float, stopped: Callable[[], bool]
    ) -> None:
        self.runner = runner
        self.engine = runner.engine
        self.slots = runner.slots
        self.worker_id = worker_id
        self.lease_ttl_s = lease_ttl_s
        self.stopped = stopped
        self.running: set[Batch] = set()

    def start_all(self, tasks: Sequence[Task]) -> None:
        """Run claimed tasks: alone, or in batches of their key (a batching kind)."""
        groups: dict[tuple[str, str], list[Task]] = {}
        for task in tasks:
            if self.engine.kinds[task.kind].batch is None or task.batch_key is None:
                self.runner.start(task)
            else:
                groups.setdefault((task.kind, task.batch_key), []).append(task)
        for (name, key), members in groups.items():
            kind = self.engine.kinds[name]
            size = kind.batch.max_size if kind.batch else 1
            for first in range(0, len(members), size):
                batch = Batch(kind, key)
                for task in members[first : first + size]:
                    self.runner.start(task, batch)
                self.running.add(batch)
                batch.runner = asyncio.create_task(self._run(batch), name=f"kiln-{key}")

    async def _run(self, batch: Batch) -> None:
        """Fill the batch, take its resources, call the handler once for its members."""
        try:
            await self._fill(batch)
            async with self.slots.pool.hold(self.slots.needs[batch.kind.name]):
                if await self._acquire(batch):
                    await self._call(batch)
        except Exception as exc:  # the members fail with it, each on its own
            log.warning("batch_failed", extra={"batch": batch.key, "error": repr(exc)})
            for member in batch.members:
                if member.outcome is not None and not member.outcome.done():
                    member.outcome.set_result(exc)
        finally:
            batch.acquired.set()  # members left waiting see their outcome (or stop)
            for member in batch.members:
                if member.outcome is not None and not member.outcome.done():
                    member.outcome.cancel()
            batch.done.set()
            self.running.discard(batch)
            self.slots.free.set()

    async def _fill(self, batch: Batch) -> None:
        """Claim more tasks of the batch's key until it is full or its wait is over."""
        policy = batch.kind.batch
        assert policy is not None
        loop = asyncio.get_running_loop()
        until = loop.time() + policy.max_wait_ms / 1000
        while len(batch.members) < policy.max_size and not self.stopped():
            try:
                more = await self.engine.store.claim_batch(
                    worker_id=self.worker_id,
                    kind=batch.kind.name,
                    batch_key=batch.key,
                    limit=policy.max_size - len(batch.members),
                    lease_ttl_s=self.lease_ttl_s,
                )
            except StoreUnavailable:
                more = []
            for task in more:
                self.runner.start(task, batch)
            left = until - loop.time()
            if left <= 0 or len(batch.members) >= policy.max_size:
                break
            if not more:
                await asyncio.sleep(min(left, BATCH_FILL_POLL_S))

    async def _acquire(self, batch: Batch) -> bool:
        """Take the shared pools' units of every live member through the first (the
        leader); False when no member is left."""
        capacities = self.engine.settings.pools
        while True:
            live = batch.live()
            if not live:
                return False
            leader = live[0]
            total: collections.Counter[str] = collections.Counter()
            for member in live:
                total.update(units_needed(member.needs, capacities))
                member.needs = {}  # what the batch holds, the leader holds
            leader.needs = dict(total)
            batch.leader = leader
            try:
                await self.slots.acquire_shared(leader, leader.needs)
            except LeaseLost:  # the leader was given back meanwhile: the next one leads
                continue
            if self.slots.lease_lapsed(leader):
                continue
            batch.acquired.set()
            return True

    async def _call(self, batch: Batch) -> None:
        """Wait until every member is ready or gone, then call the handler with the ready
        ones and hand each its outcome (an exception fails that member alone; a call that
        raises fails every member)."""
        while not batch.settled():
            batch.changed.clear()
            await batch.changed.wait()
        members = [m for m in batch.live() if m.task.id in batch.ready]
        if not members:
            return
        params = [batch.ready[m.task.id] for m in members]
        for member in members:
            member.share = 1 / len(members)
        ctxs = [Context(self.runner, m, p) for m, p in zip(members, params, strict=True)]
        log.info(
            "batch_call",
            extra={
                "batch": batch.key,
                "kind": batch.kind.name,
                "size": len(members),
                "task_ids": [m.task.id for m in members],
            },
        )
        results: list[Any]
        try:
            results = list(cast(Sequence[Any], await batch.kind.handler(ctxs, params)))
            if len(results) != len(members):
                raise ValueError(
                    f"the batch handler of {batch.kind.name} returned "
                    f"{len(results)} results for {len(members)} tasks"
                )
        except Exception as exc:
            results = [exc] * len(members)
        for member, result in zip(members, results, strict=True):
            if member.outcome is not None and not member.outcome.done():
                member.outcome.set_result(result)
