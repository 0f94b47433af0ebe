"""Worker runtime: claim, lease, acquire a resource slot, run, upload, verify, report.

Every write a worker makes is fenced by the task's lease epoch. A refused write
(:class:`~kiln.errors.LeaseLost`) means another actor moved the task on: the worker stops
working on it at once and never touches a newer attempt's storage location.

A worker stops in one of two ways, and neither counts an attempt (DESIGN.md, I9):

- :meth:`Worker.drain` (SIGTERM): it claims nothing more, gives back at once the attempts
  that wait for a resource, lets the running ones finish within the grace period
  (``KILN_SHUTDOWN_GRACE_S``), then gives the rest back and :meth:`Worker.run` returns;
- cancelling :meth:`Worker.run` (a second signal, the end of an App): every attempt is
  given back at once, each write bounded by :data:`RELEASE_TIMEOUT_S`.

An attempt asked to yield its pool slot (preemption, KILN_PREEMPT_AFTER_S: its heartbeat
returns the request, :meth:`Context.should_yield` says so) whose handler raises
:class:`~kiln.errors.Yielded` is given back the same way, uncounted.

Giving an attempt back is the ``release`` event: the task returns to PENDING, its attempt
number goes back by one and its place in the queue is kept (``ready_at``); the epoch is
raised, so the attempt is fenced out. An attempt that cannot be given back in time keeps
its lease until it lapses; the supervisor then expires it, and that attempt counts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from kiln import canonical, tracing
from kiln.breakers import UNAVAILABLE, Breakers
from kiln.bus import ProgressEvent
from kiln.engine import Engine, SupportsEngine, engine_of
from kiln.errors import LeaseLost, Permanent, Retryable, StaleDecision, StoreUnavailable, Yielded
from kiln.kinds import HandlerResult, TaskKind, call_review
from kiln.model_loads import LOADING_MODEL, ModelLoads
from kiln.models import JSON, Output, StoredOutput, Task
from kiln.presence import identity, keep_present, models_loaded
from kiln.retry import classify
from kiln.states import RUNNING, Event, Status
from kiln.storage import sha256_hex, upload
from kiln.store import Progress, WorkerRecord
from kiln.store.claims import Route
from kiln.store.pools import PoolWait, units_needed

log = logging.getLogger("kiln.worker")

#: How often progress is persisted on the task (live progress is published every step).
PROGRESS_PERSIST_S = 1.0
#: Heartbeats come every lease_ttl/3, and at least this often so a cancel asked from
#: another process is seen within seconds.
HEARTBEAT_MAX_S = 2.0
#: Backoff between tries of a write while the store does not answer (seconds).
STORE_RETRY_S = (0.1, 2.0)
#: How often a task waiting in a shared pool's line asks again (seconds, doubling), and
#: at least how often the first in line asks. A slot freed in this process wakes the
#: first of its waiters at once; a waiter that got its slot wakes the next.
POOL_POLL_S = (0.05, 1.0)
POOL_HEAD_POLL_S = 0.2
#: How often a batch that is not full yet looks for more tasks of its key (seconds).
BATCH_FILL_POLL_S = 0.01
#: The most a stopping worker waits for one ``release`` write (seconds); after that the
#: attempt keeps its lease until it lapses, and the supervisor takes the task over.
RELEASE_TIMEOUT_S = 3.0


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


class _Stop(Exception):
    """Raised into an attempt's pipeline when it must stop (cancel or lost lease)."""


@dataclass
class Attempt:
    """One claimed attempt as its worker sees it: the fenced view of the task."""

    task: Task
    kind: TaskKind
    #: What the attempt takes of each pool (the kind's resources, its own amounts).
    needs: dict[str, int] = field(default_factory=dict)
    #: The shared pools it takes, as the ledger names them (a batch member's own, too).
    pools: str = ""
    runner: asyncio.Task[None] | None = None
    pipeline: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    ended: bool = False
    progress: Progress | None = None
    progress_saved_at: float = 0.0
    progress_dirty: bool = False
    outputs: list[StoredOutput] = field(default_factory=list)
    #: Where the task waits in a shared pool's line (None: not waiting for one).
    pool_wait: PoolWait | None = None
    #: Done generating: it holds (and waits for) no pool slot any more.
    past_pools: bool = False
    pool_wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the attempt is halted (``stop_reason`` given): ``Context.stopped``.
    halted: asyncio.Event = field(default_factory=asyncio.Event)
    #: The batch it runs in (a batching kind), and what the batch's call made of it.
    batch: Batch | None = None
    outcome: asyncio.Future[HandlerResult | BaseException] | None = None
    #: Seconds this attempt spent loading models (``ctx.loading_model``), for the ledger.
    loading_s: float = 0.0
    #: Those loads as (model, started, ended) on the store's clock, for its trace spans.
    loads: list[tuple[str, float, float]] = field(default_factory=list)
    #: Its share of the call that generated it (1/n of a batch of n), for the ledger.
    share: float = 1.0
    #: The leading supervisor asked it to yield its slot (its heartbeat said so).
    yield_requested: bool = False


@dataclass(eq=False)
class Batch:
    """One call of a batching kind's handler over several claimed tasks, its members.

    The batch fills (more tasks of its key, for at most the policy's wait), then takes
    its resources once for all (this process's slots; the shared pools' units of every
    member, held through its first live member, the leader), lets each member record its
    ``acquire``, calls the handler with the members still running, and hands each its
    outcome. Everything after the call (``generated``, upload, verification, the final
    transition, a retry) is each member's own, as for a task alone.
    """

    kind: TaskKind
    key: str
    members: list[Attempt] = field(default_factory=list)
    #: The members that recorded their ``acquire`` and wait for the call, with params.
    ready: dict[str, Any] = field(default_factory=dict)
    leader: Attempt | None = None
    #: Set when the batch holds its resources: its members acquire then.
    acquired: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set whenever a member became ready or ended: the runner counts again.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the call is over and the batch gave its own resources back.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None

    def live(self) -> list[Attempt]:
        return [m for m in self.members if not m.ended and m.stop_reason is None]

    def settled(self) -> bool:
        """Every member is ready for the call or gone."""
        return all(m.task.id in self.ready or m.ended or m.stop_reason for m in self.members)


class Context:
    """What a handler sees: its task, its params, and a way to report progress."""

    def __init__(self, worker: Worker, attempt: Attempt, params: Any) -> None:
        self._worker = worker
        self._attempt = attempt
        self.params = params

    @property
    def task(self) -> Task:
        return self._attempt.task

    @property
    def attempt(self) -> int:
        return self._attempt.task.attempt

    @property
    def task_id(self) -> str:
        return self._attempt.task.id

    async def progress(
        self,
        step: int | None,
        total: int | None,
        *,
        stage: str | None = None,
        preview: str | None = None,
    ) -> None:
        """Report progress: published live now, persisted at most once a second.

        ``step`` and ``total`` may be None for a stage without steps (an upstream request).
        """
        await self._worker.report_progress(self._attempt, Progress(stage, step, total), preview)

    @contextlib.asynccontextmanager
    async def loading_model(self, model: str) -> AsyncIterator[None]:
        """Mark the load of ``model`` as this attempt's ``loading_model`` stage; when it
        loaded, its seconds go to ``kiln_model_load_seconds{model}`` and the log
        (``model_loaded``). A load that fails records nothing."""
        await self.progress(None, None, stage=LOADING_MODEL)
        started = time.monotonic()
        yield
        self._worker.model_loaded(self._attempt, model, time.monotonic() - started)

    def should_yield(self) -> bool:
        """Whether the attempt was asked to give its pool slot up (preemption,
        KILN_PREEMPT_AFTER_S): a handler that honours it raises
        :class:`~kiln.errors.Yielded` at its next step boundary, and the task goes back
        to the queue uncounted. A handler that never asks just runs on. A batch member is
        asked when its batch's slot holder (the first member) is."""
        return self._worker.asked_to_yield(self._attempt)

    async def stopped(self) -> None:
        """Return once the attempt is halted (cancelled, its lease lost, given back). A
        batch's call goes on when one member stops; a handler that makes its members'
        results separately can race each against this to drop a stopped one's work."""
        await self._attempt.halted.wait()


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
        self.pool = ResourcePool(resources if resources is not None else {})
        self.worker_id = (
            worker_id or f"{socket.gethostname()}:{os.getpid()}:" + (canonical.new_id("w")[-8:])
        )
        self.lease_ttl_s = lease_ttl_s or engine.settings.lease_ttl_s
        self.idle_poll_s = idle_poll_s
        self.attempts: dict[str, Attempt] = {}
        self.completed = 0
        self._slot_free = asyncio.Event()
        #: This process's attempts waiting in shared pools' lines, in arrival order.
        self._pool_waiters: list[Attempt] = []
        #: The batches running (each takes one of ``concurrency``'s places).
        self._batches: set[Batch] = set()
        #: What each kind takes: its code's resources with KILN_KIND_RESOURCES on top.
        self.needs = {
            name: engine.settings.kind_needs(name, kind.resources)
            for name, kind in engine.kinds.items()
        }
        self._stopping = False
        #: When the grace of a drain ends (on the event loop's clock); None: not draining.
        self._drain_until: float | None = None
        self._drain_wake = asyncio.Event()
        self._rng = random.Random()
        #: The circuit breakers of this worker's kinds, shared through the store.
        self.breakers = breakers if breakers is not None else Breakers(engine)
        #: The model loads this worker's attempts timed (``ctx.loading_model``).
        self.model_loads = ModelLoads()
        self._identity = identity(
            self.worker_id, {k: engine.kinds[k] for k in self.kinds}, concurrency, self.needs
        )
        #: Whether a kind of this worker names the model its tasks need (routing applies).
        self.routed = any(engine.kinds[k].model is not None for k in self.kinds)
        #: The models other live workers of these kinds with a free slot hold loaded (as
        #: the registry said at this worker's last beat): their tasks are left to them.
        self.reserved: frozenset[str] = frozenset()

    # the claim loop

    def _cancel_requested(self, task_id: str) -> None:
        attempt = self.attempts.get(task_id)
        if attempt is not None:
            self._halt(attempt, "cancel")

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called: the worker claims nothing more."""
        return self._drain_until is not None

    def drain(self, grace_s: float | None = None) -> None:
        """Stop claiming now; let running attempts finish for ``grace_s`` seconds (default
        KILN_SHUTDOWN_GRACE_S), then give the rest back, and let :meth:`run` return.

        Call it from the worker's event loop. Calling it again only shortens the grace.
        """
        grace = self.engine.settings.shutdown_grace_s if grace_s is None else grace_s
        until = asyncio.get_running_loop().time() + max(grace, 0.0)
        if self._drain_until is None or until < self._drain_until:
            self._drain_until = until
            log.info("worker_draining", extra={"worker_id": self.worker_id,
                     "running": len(self.attempts), "grace_s": grace})  # fmt: skip
        self._slot_free.set()  # an idle claim loop notices at once
        self._drain_wake.set()

    def presence(self) -> WorkerRecord:
        """What this worker says of itself in the worker registry (``kiln workers``)."""
        return replace(
            self._identity, running=len(self.attempts),
            models=models_loaded(self.engine.kinds[k] for k in self.kinds),
        )  # fmt: skip

    async def run(self) -> None:
        """Claim and run tasks until :meth:`drain` ends or the call is cancelled; either
        way the running attempts are given back, not counted (see the module docstring)."""
        idle_s = self.idle_poll_s[0]
        self.engine.cancel_listeners.append(self._cancel_requested)
        present = asyncio.create_task(keep_present(
            self.engine.store, self.presence, interval_s=self._beat_interval_s,
            ttl_s=self.lease_ttl_s, peers=self.peers_seen if self.routed else None,
        ))  # fmt: skip
        try:
            while not self._stopping and not self.draining:
                free = self.concurrency - self._busy()
                if free > 0:
                    self.engine.wake.clear()
                    claimed: list[Task] = []
                    try:
                        kinds, probes = await self.breakers.claimable(self.kinds)
                        kinds, limit = self._pool_room(kinds, free)
                        claimed = await self.engine.claim(
                            worker_id=self.worker_id, kinds=kinds, limit=limit,
                            lease_ttl_s=self.lease_ttl_s, acquire=self._acquiring(kinds),
                            route=self.route(),
                        ) if kinds else []  # fmt: skip
                        self._start_all(claimed)  # committed: run them, whatever follows
                        probes, room = self._pool_room(probes, free - len(claimed))
                        found = await self._claim_probes(probes, room)
                        self._start_all(found)
                        claimed += found
                    except StoreUnavailable as exc:  # wait for the store
                        log.warning("claim_failed", extra={"error": exc.message})
                        if not claimed:
                            await self._idle(idle_s, False)
                            idle_s = min(idle_s * 2, self.idle_poll_s[1])
                            continue
                    if claimed:
                        idle_s = self.idle_poll_s[0]
                        continue
                await self._idle(idle_s, free > 0)
                idle_s = min(idle_s * 2, self.idle_poll_s[1])
            if self.draining:
                await self._drain()
        finally:
            self.engine.cancel_listeners.remove(self._cancel_requested)
            await self.stop()
            present.cancel()
            await asyncio.wait([present])

    async def _drain(self) -> None:
        """Give back what waits for a resource, let the rest run until the grace ends,
        then give back what still runs and wait (boundedly) for those writes."""
        for attempt in list(self.attempts.values()):
            if attempt.task.status is Status.WAITING_FOR_RESOURCE:
                self._halt(attempt, "release")  # not started: nothing to wait for
        loop = asyncio.get_running_loop()
        while self.attempts and self._drain_until is not None:
            left_s = self._drain_until - loop.time()
            if left_s <= 0:
                break
            self._drain_wake.clear()
            woken = asyncio.ensure_future(self._drain_wake.wait())
            runners = {a.runner for a in self.attempts.values() if a.runner is not None}
            await asyncio.wait({woken, *runners}, timeout=left_s, return_when="FIRST_COMPLETED")
            woken.cancel()
        for attempt in list(self.attempts.values()):
            self._halt(attempt, "release")
        runners = {a.runner for a in self.attempts.values() if a.runner is not None}
        if runners:
            await asyncio.wait(runners, timeout=RELEASE_TIMEOUT_S + 1.0)
        log.info("worker_drained", extra={"worker_id": self.worker_id,
                 "left": len(self.attempts)})  # fmt: skip

    def _pool_room(self, kinds: list[str], free: int) -> tuple[list[str], int]:
        """The kinds to claim and how many: this process keeps at most a shared pool's
        capacity of attempts before that pool (claimed, waiting or holding a slot), so a
        busy pool leaves its tasks PENDING, in the queue, instead of waiting here."""
        capacities = self.engine.settings.pools
        if not capacities:
            return kinds, free
        before = collections.Counter(
            pool
            for attempt in self.attempts.values()
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
            kind for kind in kinds
            if not any(n > 0 for n in self.needs[kind].values())
            and self.engine.kinds[kind].amounts is None and self.engine.kinds[kind].batch is None
            and self.breakers.closed(kind)
        ]  # fmt: skip

    async def _idle(self, idle_s: float, may_claim: bool) -> None:
        waiters = [asyncio.ensure_future(self._slot_free.wait())]
        if may_claim:
            waiters.append(asyncio.ensure_future(self.engine.wake.wait()))
        jitter = self._rng.uniform(0.5, 1.0)
        try:
            await asyncio.wait(waiters, timeout=idle_s * jitter, return_when="FIRST_COMPLETED")
        finally:
            for waiter in waiters:
                waiter.cancel()
        self._slot_free.clear()

    async def stop(self) -> None:
        """Stop running attempts at once and give each back (``release``, bounded by
        :data:`RELEASE_TIMEOUT_S`); one that cannot be given back keeps its lease until
        it lapses, and the supervisor takes it over."""
        self._stopping = True
        pending = [a.runner for a in self.attempts.values() if a.runner is not None]
        pending += [b.runner for b in self._batches if b.runner is not None]
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _start(self, task: Task, batch: Batch | None = None) -> None:
        kind = self.engine.kinds[task.kind]
        needs = self._needs_of(kind, task)
        pools = ",".join(sorted(units_needed(needs, self.engine.settings.pools)))
        attempt = Attempt(task, kind, needs, pools=pools, batch=batch)
        if batch is not None:
            attempt.outcome = asyncio.get_running_loop().create_future()
            batch.members.append(attempt)
        self.attempts[task.id] = attempt
        attempt.runner = asyncio.create_task(self._execute(attempt), name=f"kiln-{task.id}")

    def _start_all(self, tasks: Sequence[Task]) -> None:
        """Run claimed tasks: alone, or in batches of their key (a batching kind)."""
        groups: dict[tuple[str, str], list[Task]] = {}
        for task in tasks:
            if self.engine.kinds[task.kind].batch is None or task.batch_key is None:
                self._start(task)
            else:
                groups.setdefault((task.kind, task.batch_key), []).append(task)
        for (name, key), members in groups.items():
            kind = self.engine.kinds[name]
            size = kind.batch.max_size if kind.batch else 1
            for first in range(0, len(members), size):
                batch = Batch(kind, key)
                for task in members[first : first + size]:
                    self._start(task, batch)
                self._batches.add(batch)
                batch.runner = asyncio.create_task(self._run_batch(batch), name=f"kiln-{key}")

    def _busy(self) -> int:
        """The places of ``concurrency`` taken: an attempt alone, or a batch."""
        return sum(1 for a in self.attempts.values() if a.batch is None) + len(self._batches)

    def _needs_of(self, kind: TaskKind, task: Task) -> dict[str, int]:
        """What ``task`` takes of each pool; params its amounts cannot read take the
        kind's resources (the handler refuses such params when it parses them)."""
        try:
            return kind.needs_of(task.params, self.needs[kind.name])
        except Exception as exc:  # the attempt fails on its params anyway
            log.warning("amounts_failed", extra={"task_id": task.id, "error": repr(exc)})
            return dict(self.needs[kind.name])

    # one attempt

    async def _claim_probes(self, kinds: list[str], free: int) -> list[Task]:
        """One task of each ``pause`` kind whose open breakers' half-open probe this
        process holds: it goes through as their probe."""
        claimed: list[Task] = []
        left = list(kinds)
        try:
            while left:
                found = await self.engine.claim(
                    worker_id=self.worker_id, kinds=[left[0]], limit=1,
                    lease_ttl_s=self.lease_ttl_s,
                ) if len(claimed) < free else []  # fmt: skip
                self.breakers.probing(left.pop(0), found[0].id if found else None)
                for task in found:
                    log.info("breaker_probe_claimed", extra={"task_id": task.id})
                claimed += found
        finally:
            for kind in left:  # the claim failed: the probes go back
                self.breakers.probing(kind, None)
        return claimed

    async def _guarded(self, attempt: Attempt) -> None:
        """The pipeline behind the kind's circuit breakers: a ``fail_fast`` kind whose
        breaker is open fails at once (permanently, ``upstream_unavailable``); the
        attempt's outcome is recorded on the breakers the worker feeds."""
        breakers, task = self.breakers, attempt.task
        refusal = await breakers.refusal(task.kind, task.id)
        if refusal is not None:
            breakers.settle(task, {}, None)  # gives back a probe it was handed
            raise Permanent(refusal, code=UNAVAILABLE)
        permits = breakers.admit(task.kind)
        try:
            await self._pipeline(attempt)
        except BaseException as exc:
            breakers.settle(attempt.task, permits, exc)
            raise
        breakers.settle(attempt.task, permits, None)

    async def _execute(self, attempt: Attempt) -> None:
        attempt.pipeline = asyncio.create_task(self._guarded(attempt))
        if attempt.stop_reason is not None:  # halted before it started (a drain)
            attempt.pipeline.cancel()
        # The heartbeat starts when the attempt outlives its first interval: an attempt
        # that ends sooner (most short ones) never pays for a task of its own.
        beating: list[asyncio.Task[None]] = []
        start = asyncio.get_running_loop().call_later(
            self._beat_interval_s,
            lambda: beating.append(asyncio.create_task(self._heartbeat(attempt))),
        )
        try:
            await self._settle(attempt, attempt.pipeline)
        except LeaseLost:
            log.warning("lease_lost", extra=self._ids(attempt))
        finally:
            # The loop also ends by itself on ``ended``: a cancel that lands as a store
            # call completes can be lost on Python 3.11, and the slot must come back.
            attempt.ended = True
            if attempt.batch is not None:
                attempt.batch.changed.set()
            start.cancel()
            # The slot comes back before any await: a stop that cancels this runner while
            # it waits for its heartbeat must not keep the slot.
            self.engine.hub.local_progress.discard(attempt.task.id)
            self.attempts.pop(attempt.task.id, None)
            self.completed += 1
            self._slot_free.set()
            self._wake_pool_waiters()
            for heartbeat in beating:
                heartbeat.cancel()
                await asyncio.wait([heartbeat], timeout=1.0)

    async def _settle(self, attempt: Attempt, work: asyncio.Task[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            if attempt.stop_reason == "cancel":
                batch = attempt.batch
                if batch is not None and batch.leader is attempt and not attempt.past_pools:
                    await batch.done.wait()  # the pools' units it holds are the batch's
                await self._transition(attempt, Event.STOPPED)
            elif attempt.stop_reason == "release":  # a drain's grace ended
                await self._release(attempt)
            elif attempt.stop_reason is None:
                await self._release(attempt)
                raise  # the worker itself is shutting down
        except LeaseLost:
            raise
        except Exception as exc:
            await self._raised(attempt, exc)

    async def _raised(self, attempt: Attempt, exc: Exception) -> None:
        """The attempt's pipeline raised ``exc``: give it back (a drain stopped it, or it
        yielded when asked), stop it (a cancel was asked), or fail it."""
        if attempt.stop_reason == "release":  # stopped by a drain, whatever it raised
            await self._release(attempt)
            return
        if attempt.task.cancel_requested:  # a cancel was asked: stop, do not retry
            await self._transition(attempt, Event.STOPPED)
            return
        if isinstance(exc, Yielded) and self.asked_to_yield(attempt):
            log.info("attempt_yielded", extra=self._ids(attempt))
            await self._release(attempt)  # uncounted, its place kept (preemption)
            return
        error = classify(exc)
        log.info("attempt_failed", extra={**self._ids(attempt), "code": error["code"]})
        wait_s = exc.retry_after_s if isinstance(exc, Retryable) else None
        await self._transition(attempt, Event.FAIL, retry_error=error, retry_after_s=wait_s)

    async def _release(self, attempt: Attempt) -> None:
        """Give the attempt back to the queue uncounted (``release``; a stop is not a
        failure), or end it ``stopped`` when a cancel was asked meanwhile. Bounded by
        :data:`RELEASE_TIMEOUT_S`; a write that does not land leaves the lease to lapse."""
        task = attempt.task
        if task.status not in RUNNING:
            return  # it left the running statuses as it was stopped (SUCCESS, FAILED, ...)
        ids = self._ids(attempt)
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                cancel = task.cancel_requested or await self._cancel_asked(task)
                event = Event.STOPPED if cancel else Event.RELEASE
                fields = None if cancel else release_fields(task)
                await self._transition(attempt, event, fields=fields, bump_epoch=not cancel)
        except Exception as exc:  # the lease decides now; the supervisor takes it over
            log.warning("release_failed", extra={**ids, "error": str(exc) or type(exc).__name__})
            return
        log.info("attempt_released", extra={**ids, "event": str(event), "status": str(task.status)})

    async def _cancel_asked(self, task: Task) -> bool:
        """Whether a cancel was asked since the last heartbeat (from another process): a
        task given back would otherwise wait in the queue with its cancel unheeded."""
        try:
            fresh = await self.engine.store.get(task.id)
        except StoreUnavailable:
            return False
        return fresh is not None and fresh.epoch == task.epoch and fresh.cancel_requested

    async def _pipeline(self, attempt: Attempt) -> None:
        kind = attempt.kind
        if attempt.batch is not None:
            params, produced = await self._generate_in_batch(attempt, attempt.batch)
        else:
            params, produced = await self._generate(attempt)
        await self._transition(
            attempt, Event.GENERATED, state_timeout=attempt.task.timeouts.uploading_s
        )
        attempt.past_pools = True
        self._wake_pool_waiters()  # leaving GENERATING gave the shared slots back
        # The verdict goes into the manifest, which is written with the outputs.
        flagged = bool(kind.review) and await call_review(kind.review, params, produced)  # type: ignore[arg-type]
        stored = await self._upload(attempt, produced, flagged=flagged)
        result = {"outputs": [o.to_json() for o in stored]}
        await self._transition(
            attempt,
            Event.UPLOADED,
            Status.NEEDS_REVIEW if flagged else Status.SUCCESS,
            fields={"result": result, "error": None, "stage": None},
        )

    async def _generate(self, attempt: Attempt) -> tuple[Any, list[Output]]:
        """Take the attempt's resources, record ``acquire``, run the handler."""
        kind, needs = attempt.kind, attempt.needs
        async with self.pool.hold(needs):
            await self._acquire_shared(attempt, needs)
            if self._pool_lease_lapsed(attempt):  # the slot may be another task's by now
                raise LeaseLost(f"the lease of {attempt.task.id} lapsed while it took a slot")
            await self._acquired(attempt)
            params = kind.parse(attempt.task.params)
            ctx = Context(self, attempt, params)
            self.engine.hub.local_progress.add(attempt.task.id)
            with tracing.outgoing(await self._trace_headers(attempt)):
                produced = _as_outputs(await kind.handler(ctx, params))
        return params, produced

    async def _trace_headers(self, attempt: Attempt) -> dict[str, str]:
        """With tracing on, the ``traceparent`` the handler's outgoing HTTP carries (its
        attempt's generate span); nothing otherwise."""
        if self.engine.tracing is None:
            return {}
        task = attempt.task
        return tracing.attempt_headers(task.id, task.epoch, await self.engine.store.trace(task.id))

    async def _acquired(self, attempt: Attempt) -> None:
        if attempt.task.status is Status.WAITING_FOR_RESOURCE:  # else the claim acquired
            await self._transition(
                attempt, Event.ACQUIRE, state_timeout=attempt.task.timeouts.generating_s
            )

    async def _generate_in_batch(self, attempt: Attempt, batch: Batch) -> tuple[Any, list[Output]]:
        """A member's part of its batch: once the batch holds its resources, record
        ``acquire``, then wait for what the batch's call made of this task."""
        await batch.acquired.wait()
        assert attempt.outcome is not None
        failed = attempt.outcome.result() if attempt.outcome.done() else None
        if isinstance(failed, BaseException):
            raise failed  # the batch failed before its call
        await self._acquired(attempt)
        params = attempt.kind.parse(attempt.task.params)
        batch.ready[attempt.task.id] = params
        batch.changed.set()
        self.engine.hub.local_progress.add(attempt.task.id)
        outcome = await asyncio.shield(attempt.outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        return params, _as_outputs(outcome)

    async def _run_batch(self, batch: Batch) -> None:
        """Fill the batch, take its resources, call the handler once for its members."""
        try:
            await self._fill(batch)
            async with self.pool.hold(self.needs[batch.kind.name]):
                if await self._batch_acquire(batch):
                    await self._call_batch(batch)
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
            self._batches.discard(batch)
            self._slot_free.set()

    async def _fill(self, batch: Batch) -> None:
        """Claim more tasks of the batch's key until it is full or its wait is over."""
        policy = batch.kind.batch
        assert policy is not None
        loop = asyncio.get_running_loop()
        until = loop.time() + policy.max_wait_ms / 1000
        while len(batch.members) < policy.max_size and not self._stopping and not self.draining:
            try:
                more = await self.engine.store.claim_batch(
                    worker_id=self.worker_id, kind=batch.kind.name, batch_key=batch.key,
                    limit=policy.max_size - len(batch.members), lease_ttl_s=self.lease_ttl_s,
                )  # fmt: skip
            except StoreUnavailable:
                more = []
            for task in more:
                self._start(task, batch)
            left = until - loop.time()
            if left <= 0 or len(batch.members) >= policy.max_size:
                break
            if not more:
                await asyncio.sleep(min(left, BATCH_FILL_POLL_S))

    async def _batch_acquire(self, batch: Batch) -> bool:
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
                await self._acquire_shared(leader, leader.needs)
            except LeaseLost:  # the leader was given back meanwhile: the next one leads
                continue
            if self._pool_lease_lapsed(leader):
                continue
            batch.acquired.set()
            return True

    async def _call_batch(self, batch: Batch) -> None:
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
        ctxs = [Context(self, m, p) for m, p in zip(members, params, strict=True)]
        log.info("batch_call", extra={"batch": batch.key, "kind": batch.kind.name,
                 "size": len(members), "task_ids": [m.task.id for m in members]})  # fmt: skip
        results: list[Any]
        try:
            results = list(cast(Sequence[Any], await batch.kind.handler(ctxs, params)))
            if len(results) != len(members):
                raise ValueError(f"the batch handler of {batch.kind.name} returned "
                                 f"{len(results)} results for {len(members)} tasks")  # fmt: skip
        except Exception as exc:
            results = [exc] * len(members)
        for member, result in zip(members, results, strict=True):
            if member.outcome is not None and not member.outcome.done():
                member.outcome.set_result(result)

    async def _acquire_shared(self, attempt: Attempt, needs: dict[str, int]) -> None:
        """Wait in line for the task's slots of the shared pools (KILN_POOLS); the store
        keeps the line, so every worker on every machine shares it."""
        capacities = self.engine.settings.pools
        if not units_needed(needs, capacities):
            return
        delay = POOL_POLL_S[0]
        self._pool_waiters.append(attempt)
        try:
            while True:
                attempt.pool_wake.clear()  # a wake-up from now on is kept for the wait below
                task = attempt.task
                in_line = attempt.pool_wait is not None
                try:
                    wait = await self.engine.store.acquire_slots(
                        task.id, task.epoch, needs, capacities, in_line=in_line
                    )
                except StoreUnavailable as exc:  # keep the place; the lease decides how long
                    log.warning("pool_acquire_failed", extra={**self._ids(attempt),
                                "error": exc.message})  # fmt: skip
                    wait = attempt.pool_wait
                else:
                    if wait is None:
                        attempt.pool_wait = None
                        return
                    if wait != attempt.pool_wait:
                        log.info("pool_wait", extra={**self._ids(attempt), "pool": wait.pool,
                                 "position": wait.position, "held": wait.held,
                                 "capacity": wait.capacity})  # fmt: skip
                    attempt.pool_wait = wait
                ceiling = POOL_HEAD_POLL_S if wait and wait.position == 1 else POOL_POLL_S[1]
                delay = min(delay, ceiling)
                with contextlib.suppress(TimeoutError):
                    pause = delay * self._rng.uniform(0.5, 1.0)
                    await asyncio.wait_for(attempt.pool_wake.wait(), pause)
                delay = min(delay * 2, ceiling)
        finally:
            self._pool_waiters.remove(attempt)
            self._wake_pool_waiters()  # the next in line may have moved up

    def _wake_pool_waiters(self) -> None:
        """A slot of this process came back, or its first waiter left the line: the first
        waiter asks again now (one ask, not one per waiter), and the claim loop may take
        more of the pool's tasks."""
        if self._pool_waiters:
            self._pool_waiters[0].pool_wake.set()
        if self.engine.settings.pools:
            self._slot_free.set()

    async def _upload(
        self, attempt: Attempt, produced: list[Output], *, flagged: bool
    ) -> list[StoredOutput]:
        """Store the outputs, each verified, then the manifest that lets recovery find them."""
        prefix = attempt.task.result_prefix
        assert prefix is not None
        files = [
            (StoredOutput(name=output.name, key=f"{prefix}/{output.name}",
                          content_type=output.content_type, size=len(output.data),
                          sha256=sha256_hex(output.data)), output.data)
            for output in produced
        ]  # fmt: skip
        failed = await upload(self.engine.storage, prefix, files, flagged=flagged)
        if failed is not None:
            raise Retryable(f"output {failed.name} did not verify in storage",
                            code="storage_verify_failed")  # fmt: skip
        return [record for record, _ in files]

    async def _transition(
        self,
        attempt: Attempt,
        event: Event,
        target: Status | None = None,
        *,
        fields: dict[str, Any] | None = None,
        retry_error: JSON | None = None,
        state_timeout: float | None = None,
        retry_after_s: float | None = None,
        bump_epoch: bool = False,
    ) -> None:
        changes = dict(fields or {})
        if state_timeout is not None:
            changes["state_deadline_at"] = self.engine.now() + state_timeout
        if attempt.progress_dirty and attempt.progress is not None and event is Event.GENERATED:
            changes.update(stage=attempt.progress.stage, progress_step=attempt.progress.step,
                           progress_total=attempt.progress.total)  # fmt: skip
        delay = STORE_RETRY_S[0]
        while True:
            try:
                write = asyncio.ensure_future(self.engine.apply(
                    attempt.task, event, target, fields=changes, fenced=True,
                    retry_error=retry_error, retry_after_s=retry_after_s, bump_epoch=bump_epoch,
                    loading_s=attempt.loading_s, pool=attempt.pools,
                    share=attempt.share, loads=attempt.loads,
                ))  # fmt: skip
                try:
                    attempt.task = await asyncio.shield(write)
                except asyncio.CancelledError:
                    # Cancelled (a cancel request, a shutdown) while the write was in
                    # flight: let it land, so the attempt knows the status it left.
                    with contextlib.suppress(Exception):
                        attempt.task = await write
                    raise
                return
            except StaleDecision:
                # A cancel was asked after the read this change was planned on (a retry):
                # plan it again on the row as it is now, in the same attempt.
                fresh = await self.engine.store.get(attempt.task.id)
                task = attempt.task
                if fresh is None or (fresh.status, fresh.epoch) != (task.status, task.epoch):
                    raise LeaseLost(f"task {task.id} moved on while {event} was recorded") from None
                attempt.task = fresh
            except StoreUnavailable as exc:
                # Try again while the lease holds; after that the supervisor owns the task
                # (and finds a complete upload through its manifest).
                expires = attempt.task.lease_expires_at or 0.0
                if self.engine.now() + delay >= expires:
                    raise LeaseLost(
                        f"could not record {event} for {attempt.task.id} before its lease"
                        f" ran out: {exc.message}"
                    ) from exc
                log.warning("transition_retry", extra={**self._ids(attempt),
                            "event": str(event), "error": exc.message})  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, STORE_RETRY_S[1])

    # heartbeats, progress, cancellation

    @property
    def _beat_interval_s(self) -> float:
        return max(min(self.lease_ttl_s / 3, HEARTBEAT_MAX_S), 0.01)

    async def _heartbeat(self, attempt: Attempt) -> None:
        """Beat now (one interval into the attempt), then every interval until it ends."""
        while not attempt.ended and attempt.stop_reason != "lease_lost":
            await self._beat(attempt, with_progress=attempt.progress_dirty)
            await asyncio.sleep(self._beat_interval_s)

    def _pool_lease_lapsed(self, attempt: Attempt) -> bool:
        """A shared pool's slot counts only while the attempt's lease runs: once it lapsed
        (a paused process, a store that did not answer) another task may hold the slot,
        so an attempt before or in a pool stops instead of renewing the lease."""
        if attempt.past_pools or not units_needed(attempt.needs, self.engine.settings.pools):
            return False
        return self.engine.now() >= (attempt.task.lease_expires_at or 0.0)

    async def _beat(self, attempt: Attempt, *, with_progress: bool) -> None:
        if self._pool_lease_lapsed(attempt):
            log.warning("pool_lease_lapsed", extra=self._ids(attempt))
            self._halt(attempt, "lease_lost")
            return
        progress = attempt.progress if with_progress else None
        try:
            task = await self.engine.store.heartbeat(
                attempt.task.id, attempt.task.epoch, self.lease_ttl_s, progress
            )
        except LeaseLost:
            self._halt(attempt, "lease_lost")
            return
        except StoreUnavailable as exc:  # the next beat tries again; the lease may hold
            log.warning("heartbeat_failed", extra={**self._ids(attempt), "error": exc.message})
            return
        if progress is not None:
            attempt.progress_dirty = False
            attempt.progress_saved_at = self.engine.now()
        attempt.task = task
        if task.cancel_requested:
            self._halt(attempt, "cancel")
        if task.yield_requested_at is not None and not attempt.yield_requested:
            attempt.yield_requested = True
            log.info("yield_requested", extra=self._ids(attempt))

    @staticmethod
    def asked_to_yield(attempt: Attempt) -> bool:
        """Whether ``attempt`` was asked to yield (see :meth:`Context.should_yield`)."""
        if attempt.yield_requested:
            return True
        leader = attempt.batch.leader if attempt.batch is not None else None
        return leader is not None and leader.yield_requested

    def _halt(self, attempt: Attempt, reason: str) -> None:
        """Stop the attempt's pipeline for ``reason`` (cancel, lease_lost, release); one
        not started yet stops as it starts."""
        if attempt.stop_reason is None:
            attempt.stop_reason = reason
            attempt.halted.set()
            log.info("attempt_halted", extra={**self._ids(attempt), "reason": reason})
            if attempt.pipeline is not None:
                attempt.pipeline.cancel()

    async def report_progress(
        self, attempt: Attempt, progress: Progress, preview: str | None
    ) -> None:
        attempt.progress = progress
        attempt.progress_dirty = True
        task = attempt.task
        self.engine.publish_progress(
            ProgressEvent(task.id, task.tenant, str(Status.GENERATING), progress.stage,
                          _progress_json(progress), preview)
        )  # fmt: skip
        if self.engine.now() - attempt.progress_saved_at >= PROGRESS_PERSIST_S:
            attempt.progress_saved_at = self.engine.now()
            await self._beat(attempt, with_progress=True)
        if attempt.stop_reason is not None and attempt.batch is None:
            raise asyncio.CancelledError  # a batch's call goes on for its other members

    def model_loaded(self, attempt: Attempt, model: str, seconds: float) -> None:
        attempt.loading_s += seconds
        now = self.engine.now()
        attempt.loads.append((model, now - seconds, now))
        self.model_loads.record(model, seconds)
        log.info("model_loaded", extra={**self._ids(attempt), "model": model,
                 "duration_s": round(seconds, 3)})  # fmt: skip

    @staticmethod
    def _ids(attempt: Attempt) -> dict[str, Any]:
        task = attempt.task
        return {"task_id": task.id, "attempt": task.attempt, "epoch": task.epoch}


def release_fields(task: Task) -> dict[str, Any]:
    """What ``release`` sets besides the status: the attempt number goes back by one (the
    attempt does not count, so ``attempt <= max_attempts`` holds however often workers
    stop) and its progress is cleared. ``ready_at`` is left as it is, so the task keeps
    its place ahead of later work of its priority."""
    return {
        "attempt": max(task.attempt - 1, 0),
        "yield_requested_at": None,
        "stage": None,
        "progress_step": None,
        "progress_total": None,
        "progress_at": None,
    }


def _progress_json(progress: Progress) -> JSON | None:
    if progress.step is None or progress.total is None:
        return None
    fraction = min(progress.step / max(progress.total, 1), 1.0)
    return {"step": progress.step, "total": progress.total, "fraction": round(fraction, 4)}


def _as_outputs(result: HandlerResult) -> list[Output]:
    if result is None:
        return []
    if isinstance(result, Output):
        return [result]
    outputs = list(result)
    names = [o.name for o in outputs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate output names {names}")
    for name in names:
        if not name or "/" in name or name in (".", "..", "manifest.json"):
            raise ValueError(f"invalid output name {name!r}")
    return outputs
