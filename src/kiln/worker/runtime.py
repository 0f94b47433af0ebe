"""The :class:`Worker`: claims tasks of its kinds and runs up to ``concurrency`` of them
at once; its rooms do the rest (see the package's docstring, :mod:`kiln.worker`)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import Sequence
from dataclasses import replace

from kiln import canonical
from kiln.breakers import Breakers
from kiln.engine import Engine, SupportsEngine, engine_of
from kiln.errors import StoreUnavailable
from kiln.model_loads import ModelLoads
from kiln.models import Task
from kiln.presence import identity, keep_present, models_loaded
from kiln.store import Progress, WorkerRecord
from kiln.store.claims import Route
from kiln.worker.attempt import Attempt, asked_to_yield
from kiln.worker.batches import Batches
from kiln.worker.draining import Shutdown
from kiln.worker.leases import Leases
from kiln.worker.running import Runner
from kiln.worker.slots import Slots

log = logging.getLogger("kiln.worker")


class Worker:
    """Claims tasks of its kinds and runs up to ``concurrency`` of them at once.

    It takes the process's :class:`~kiln.engine.Engine` (or an App, for its engine) and
    the process's circuit breakers: workers of one process share one :class:`Breakers`
    (``App.worker`` passes the App's); without one the worker keeps its own.
    """

    def __init__(
        self,
        engine: Engine | SupportsEngine,
        *,
        breakers: Breakers | None = None,
        concurrency: int = 4,
        kinds: Sequence[str] | None = None,
        resources: dict[str, int] | None = None,
        worker_id: str | None = None,
        lease_ttl_s: float | None = None,
        idle_poll_s: tuple[float, float] = (0.05, 1.0),
    ) -> None:
        self.engine = engine = engine_of(engine)
        self.concurrency = concurrency
        self.kinds = list(kinds) if kinds else list(engine.kinds)
        unknown = [k for k in self.kinds if k not in engine.kinds]
        if unknown:
            raise ValueError(f"no handler registered for kinds {unknown}")
        self.worker_id = (
            worker_id or f"{socket.gethostname()}:{os.getpid()}:" + (canonical.new_id("w")[-8:])
        )
        self.lease_ttl_s = lease_ttl_s or engine.settings.lease_ttl_s
        self.idle_poll_s = idle_poll_s
        #: The circuit breakers of this worker's kinds, shared through the store.
        self.breakers = breakers if breakers is not None else Breakers(engine)
        #: The model loads this worker's attempts timed (``ctx.loading_model``).
        self.model_loads = ModelLoads()
        self.slots = Slots(engine, resources if resources is not None else {})
        self.leases = Leases(engine, self.slots, self.lease_ttl_s)
        self.runner = Runner(engine, self.slots, self.leases, self.breakers, self.model_loads)
        self.batches = Batches(self.runner, self.worker_id, self.lease_ttl_s, self._stopped)
        attempts, batches = self.runner.attempts, self.batches.running
        self.shutdown = Shutdown(engine, self.worker_id, attempts, batches, self.leases, self.slots)
        #: This process's resource slots, and what each kind takes of them.
        self.pool = self.slots.pool
        self.needs = self.slots.needs
        #: The attempts running (or waiting for a resource), by task id.
        self.attempts: dict[str, Attempt] = self.runner.attempts
        self._rng = random.Random()
        self._identity = identity(
            self.worker_id, {k: engine.kinds[k] for k in self.kinds}, concurrency, self.needs
        )
        #: Whether a kind of this worker names the model its tasks need (routing applies).
        self.routed = any(engine.kinds[k].model is not None for k in self.kinds)
        #: The models other live workers of these kinds with a free slot hold loaded (as
        #: the registry said at this worker's last beat): their tasks are left to them.
        self.reserved: frozenset[str] = frozenset()

    @property
    def completed(self) -> int:
        """The attempts this worker ran to an end, however they ended."""
        return self.runner.completed

    # stopping (kiln.worker.draining)

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called: the worker claims nothing more."""
        return self.shutdown.draining

    def drain(self, grace_s: float | None = None) -> None:
        """Stop claiming now; let running attempts finish for ``grace_s`` seconds (default
        KILN_SHUTDOWN_GRACE_S), then give the rest back, and let :meth:`run` return.

        Call it from the worker's event loop. Calling it again only shortens the grace.
        """
        self.shutdown.drain(grace_s)

    async def stop(self) -> None:
        """Stop running attempts at once and give each back (``release``, bounded by
        :data:`~kiln.worker.RELEASE_TIMEOUT_S`); one that cannot be given back keeps its
        lease until it lapses, and the supervisor takes it over."""
        await self.shutdown.stop()

    def _stopped(self) -> bool:
        return self.shutdown.stopping or self.shutdown.draining

    # the claim loop

    def presence(self) -> WorkerRecord:
        """What this worker says of itself in the worker registry (``kiln workers``)."""
        return replace(
            self._identity,
            running=len(self.attempts),
            models=models_loaded(self.engine.kinds[k] for k in self.kinds),
        )

    async def run(self) -> None:
        """Claim and run tasks until :meth:`drain` ends or the call is cancelled; either
        way the running attempts are given back, not counted (see :mod:`kiln.worker`)."""
        idle_s = self.idle_poll_s[0]
        self.engine.cancel_listeners.append(self._cancel_requested)
        present = asyncio.create_task(
            keep_present(
                self.engine.store,
                self.presence,
                interval_s=self.leases.beat_interval_s,
                ttl_s=self.lease_ttl_s,
                peers=self.peers_seen if self.routed else None,
            )
        )
        try:
            while not self._stopped():
                free = self.concurrency - self._busy()
                claimed = await self._claim(free) if free > 0 else []
                if claimed:
                    idle_s = self.idle_poll_s[0]
                    continue
                # A store that did not answer is waited for, not a wake-up of the queue.
                await self._idle(idle_s, free > 0 and claimed is not None)
                idle_s = min(idle_s * 2, self.idle_poll_s[1])
            if self.draining:
                await self.shutdown.wind_down()
        finally:
            self.engine.cancel_listeners.remove(self._cancel_requested)
            await self.stop()
            present.cancel()
            await asyncio.wait([present])

    async def _claim(self, free: int) -> list[Task] | None:
        """Claim up to ``free`` tasks and start them. A store that does not answer leaves
        what was claimed before it failed running; None when it failed before any."""
        self.engine.wake.clear()
        claimed: list[Task] = []
        try:
            kinds, probes = await self.breakers.claimable(self.kinds)
            kinds, limit = self.slots.room(kinds, free, self.attempts.values())
            if kinds:
                claimed = await self.engine.claim(
                    worker_id=self.worker_id,
                    kinds=kinds,
                    limit=limit,
                    lease_ttl_s=self.lease_ttl_s,
                    acquire=self._acquiring(kinds),
                    route=self.route(),
                )
            self.batches.start_all(claimed)  # committed: run them, whatever follows
            probes, room = self.slots.room(probes, free - len(claimed), self.attempts.values())
            found = await self._claim_probes(probes, room)
            self.batches.start_all(found)
            claimed += found
        except StoreUnavailable as exc:  # wait for the store
            log.warning("claim_failed", extra={"error": exc.message})
            return claimed or None
        return claimed

    def _cancel_requested(self, task_id: str) -> None:
        attempt = self.attempts.get(task_id)
        if attempt is not None:
            self.leases.halt(attempt, "cancel")

    def route(self) -> Route | None:
        """How this worker's claims prefer tasks by model (KILN_AFFINITY_WAIT_S): the
        models it holds go ahead, those other idle workers hold are left to them a while."""
        wait_s = self.engine.settings.affinity_wait_s
        if not self.routed or wait_s <= 0:
            return None
        held = frozenset(models_loaded(self.engine.kinds[k] for k in self.kinds))
        return Route(held, self.reserved, wait_s)

    def peers_seen(self, workers: Sequence[WorkerRecord]) -> None:
        """The live workers, as read at a beat: note the models other workers of these
        kinds hold with a slot free (see :meth:`route`)."""
        mine = set(self.kinds)
        self.reserved = frozenset(
            model
            for peer in workers
            if peer.id != self.worker_id and peer.running < peer.slots and mine & set(peer.kinds)
            for model in peer.models
        )

    def _acquiring(self, kinds: list[str]) -> list[str]:
        """The kinds a claim acquires at once (one write, the wait recorded as zero):
        they take no resource and their breakers are closed."""
        return [
            kind
            for kind in kinds
            if not any(n > 0 for n in self.needs[kind].values())
            and self.engine.kinds[kind].amounts is None
            and self.engine.kinds[kind].batch is None
            and self.breakers.closed(kind)
        ]

    async def _claim_probes(self, kinds: list[str], free: int) -> list[Task]:
        """One task of each ``pause`` kind whose open breakers' half-open probe this
        process holds: it goes through as their probe."""
        claimed: list[Task] = []
        left = list(kinds)
        try:
            while left:
                found: list[Task] = []
                if len(claimed) < free:
                    found = await self.engine.claim(
                        worker_id=self.worker_id,
                        kinds=[left[0]],
                        limit=1,
                        lease_ttl_s=self.lease_ttl_s,
                    )
                self.breakers.probing(left.pop(0), found[0].id if found else None)
                for task in found:
                    log.info("breaker_probe_claimed", extra={"task_id": task.id})
                claimed += found
        finally:
            for kind in left:  # the claim failed: the probes go back
                self.breakers.probing(kind, None)
        return claimed

    async def _idle(self, idle_s: float, may_claim: bool) -> None:
        waiters = [asyncio.ensure_future(self.slots.free.wait())]
        if may_claim:
            waiters.append(asyncio.ensure_future(self.engine.wake.wait()))
        jitter = self._rng.uniform(0.5, 1.0)
        try:
            await asyncio.wait(waiters, timeout=idle_s * jitter, return_when="FIRST_COMPLETED")
        finally:
            for waiter in waiters:
                waiter.cancel()
        self.slots.free.clear()

    def _busy(self) -> int:
        """The places of ``concurrency`` taken: an attempt alone, or a batch."""
        alone = sum(1 for a in self.attempts.values() if a.batch is None)
        return alone + len(self.batches.running)

    # what a handler's Context asks of its attempt (kiln.worker.context.AttemptHost)

    async def report_progress(
        self, attempt: Attempt, progress: Progress, preview: str | None
    ) -> None:
        await self.runner.report_progress(attempt, progress, preview)

    def model_loaded(self, attempt: Attempt, model: str, seconds: float) -> None:
        self.runner.model_loaded(attempt, model, seconds)

    @staticmethod
    def asked_to_yield(attempt: Attempt) -> bool:
        """Whether ``attempt`` was asked to yield (see :meth:`Context.should_yield`)."""
        return asked_to_yield(attempt)
