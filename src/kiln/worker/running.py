"""Running one attempt: its pipeline (resources, ``acquire``, the handler, ``generated``,
the outputs) behind the kind's circuit breakers, its heartbeat, and how it settles: done,
failed (a retry or for good), stopped (a cancel), or given back uncounted (``release``:
a stopping worker, a yield).

Giving an attempt back is the ``release`` event: the task returns to PENDING, its attempt
number goes back by one and its place in the queue is kept (``ready_at``); the epoch is
raised, so the attempt is fenced out. An attempt that cannot be given back in time keeps
its lease until it lapses; the supervisor then expires it, and that attempt counts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kiln import tracing
from kiln.breakers import UNAVAILABLE, Breakers
from kiln.engine import Engine
from kiln.errors import LeaseLost, Permanent, Retryable, StoreUnavailable, Yielded
from kiln.model_loads import ModelLoads
from kiln.models import Output, Task
from kiln.retry import classify
from kiln.states import RUNNING, Event, Status
from kiln.store import Progress
from kiln.store.pools import units_needed
from kiln.worker.attempt import Attempt, Batch, asked_to_yield, ids
from kiln.worker.context import Context
from kiln.worker.leases import Leases
from kiln.worker.outputs import as_outputs, deliver, uploaded_fields
from kiln.worker.slots import Slots

log = logging.getLogger("kiln.worker")

#: The most a stopping worker waits for one ``release`` write (seconds); after that the
#: attempt keeps its lease until it lapses, and the supervisor takes the task over.
RELEASE_TIMEOUT_S = 3.0


class Runner:
    """Runs a worker's claimed attempts, each in a task of its own (:attr:`attempts`,
    by task id), and hosts their handlers' :class:`~kiln.worker.Context`."""

    def __init__(
        self,
        engine: Engine,
        slots: Slots,
        leases: Leases,
        breakers: Breakers,
        model_loads: ModelLoads,
    ) -> None:
        self.engine = engine
        self.slots = slots
        self.leases = leases
        self.breakers = breakers
        self.model_loads = model_loads
        self.attempts: dict[str, Attempt] = {}
        self.completed = 0

    def start(self, task: Task, batch: Batch | None = None) -> None:
        """Run a claimed task's attempt (a member of ``batch``, for a batching kind)."""
        kind = self.engine.kinds[task.kind]
        needs = self.slots.needs_of(kind, task)
        pools = ",".join(sorted(units_needed(needs, self.engine.settings.pools)))
        attempt = Attempt(task, kind, needs, pools=pools, batch=batch)
        if batch is not None:
            attempt.outcome = asyncio.get_running_loop().create_future()
            batch.members.append(attempt)
        self.attempts[task.id] = attempt
        attempt.runner = asyncio.create_task(self._execute(attempt), name=f"kiln-{task.id}")

    # how an attempt runs and ends

    async def _execute(self, attempt: Attempt) -> None:
        attempt.pipeline = asyncio.create_task(self._guarded(attempt))
        if attempt.stop_reason is not None:  # halted before it started (a drain)
            attempt.pipeline.cancel()
        # The heartbeat starts when the attempt outlives its first interval: an attempt
        # that ends sooner (most short ones) never pays for a task of its own.
        beating: list[asyncio.Task[None]] = []
        start = asyncio.get_running_loop().call_later(
            self.leases.beat_interval_s,
            lambda: beating.append(asyncio.create_task(self.leases.heartbeat(attempt))),
        )
        try:
            await self._settle(attempt, attempt.pipeline)
        except LeaseLost:
            log.warning("lease_lost", extra=ids(attempt))
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
            self.slots.free.set()
            self.slots.wake_waiters()
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
                if await self._still_running(attempt):
                    await self.leases.transition(attempt, Event.STOPPED)
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
            await self.leases.transition(attempt, Event.STOPPED)
            return
        if isinstance(exc, Yielded) and asked_to_yield(attempt):
            log.info("attempt_yielded", extra=ids(attempt))
            await self._release(attempt)  # uncounted, its place kept (preemption)
            return
        error = classify(exc)
        log.info("attempt_failed", extra={**ids(attempt), "code": error["code"]})
        wait_s = exc.retry_after_s if isinstance(exc, Retryable) else None
        await self.leases.transition(attempt, Event.FAIL, retry_error=error, retry_after_s=wait_s)

    async def _release(self, attempt: Attempt) -> None:
        """Give the attempt back to the queue uncounted (``release``; a stop is not a
        failure), or end it ``stopped`` when a cancel was asked meanwhile. Bounded by
        :data:`RELEASE_TIMEOUT_S`; a write that does not land leaves the lease to lapse."""
        task = attempt.task
        if task.status not in RUNNING:
            return  # it left the running statuses as it was stopped (SUCCESS, FAILED, ...)
        who = ids(attempt)
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                cancel = task.cancel_requested or await self._cancel_asked(task)
                event = Event.STOPPED if cancel else Event.RELEASE
                fields = None if cancel else release_fields(task)
                await self.leases.transition(attempt, event, fields=fields, bump_epoch=not cancel)
        except Exception as exc:  # the lease decides now; the supervisor takes it over
            log.warning("release_failed", extra={**who, "error": str(exc) or type(exc).__name__})
            return
        log.info("attempt_released", extra={**who, "event": str(event), "status": str(task.status)})

    async def _still_running(self, attempt: Attempt) -> bool:
        """Whether the attempt's task is still running at its epoch: a cancel heard as the
        attempt's last change committed (``uploaded``, its await cut short) finds the task
        already final, and must leave it so."""
        task = attempt.task
        if task.status not in RUNNING:
            return False
        try:
            fresh = await self.engine.store.get(task.id)
        except StoreUnavailable:
            return True  # the fenced change decides
        return fresh is not None and fresh.epoch == task.epoch and fresh.status in RUNNING

    async def _cancel_asked(self, task: Task) -> bool:
        """Whether a cancel was asked since the last heartbeat (from another process): a
        task given back would otherwise wait in the queue with its cancel unheeded."""
        try:
            fresh = await self.engine.store.get(task.id)
        except StoreUnavailable:
            return False
        return fresh is not None and fresh.epoch == task.epoch and fresh.cancel_requested

    # the pipeline

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

    async def _pipeline(self, attempt: Attempt) -> None:
        if attempt.batch is not None:
            params, produced = await self._generate_in_batch(attempt, attempt.batch)
        else:
            params, produced = await self._generate(attempt)
        to_deliver = bool(produced) or attempt.kind.review is not None
        if to_deliver:
            timeout = attempt.task.timeouts.uploading_s
            await self.leases.transition(attempt, Event.GENERATED, state_timeout=timeout)
        else:  # nothing acts between generated and uploaded: one write, both event rows
            await self.leases.transition(
                attempt,
                Event.GENERATED,
                fields=uploaded_fields([]),
                then=(Event.UPLOADED, Status.SUCCESS),
            )
        attempt.past_pools = True
        self.slots.wake_waiters()  # leaving GENERATING gave the shared slots back
        if to_deliver:
            await deliver(self.leases, self.engine.storage, attempt, params, produced)

    async def _generate(self, attempt: Attempt) -> tuple[Any, list[Output]]:
        """Take the attempt's resources, record ``acquire``, run the handler."""
        kind, needs = attempt.kind, attempt.needs
        async with self.slots.pool.hold(needs):
            await self.slots.acquire_shared(attempt, needs)
            if self.slots.lease_lapsed(attempt):  # the slot may be another task's by now
                raise LeaseLost(f"the lease of {attempt.task.id} lapsed while it took a slot")
            await self.acquired(attempt)
            params = kind.parse(attempt.task.params)
            ctx = Context(self, attempt, params)
            self.engine.hub.local_progress.add(attempt.task.id)
            with tracing.outgoing(await self._trace_headers(attempt)):
                produced = as_outputs(await kind.handler(ctx, params))
        return params, produced

    async def _trace_headers(self, attempt: Attempt) -> dict[str, str]:
        """With tracing on, the ``traceparent`` the handler's outgoing HTTP carries (its
        attempt's generate span); nothing otherwise."""
        if self.engine.tracing is None:
            return {}
        task = attempt.task
        return tracing.attempt_headers(task.id, task.epoch, await self.engine.store.trace(task.id))

    async def acquired(self, attempt: Attempt) -> None:
        """Record ``acquire`` once the attempt holds its resources (unless its claim did)."""
        if attempt.task.status is Status.WAITING_FOR_RESOURCE:  # else the claim acquired
            await self.leases.transition(
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
        await self.acquired(attempt)
        params = attempt.kind.parse(attempt.task.params)
        batch.ready[attempt.task.id] = params
        batch.changed.set()
        self.engine.hub.local_progress.add(attempt.task.id)
        outcome = await asyncio.shield(attempt.outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        return params, as_outputs(outcome)

    # what a handler's Context asks of the attempt

    async def report_progress(
        self, attempt: Attempt, progress: Progress, preview: str | None
    ) -> None:
        await self.leases.report_progress(attempt, progress, preview)

    def model_loaded(self, attempt: Attempt, model: str, seconds: float) -> None:
        attempt.loading_s += seconds
        now = self.engine.now()
        attempt.loads.append((model, now - seconds, now))
        self.model_loads.record(model, seconds)
        log.info(
            "model_loaded", extra={**ids(attempt), "model": model, "duration_s": round(seconds, 3)}
        )

    @staticmethod
    def asked_to_yield(attempt: Attempt) -> bool:
        """Whether ``attempt`` was asked to yield (see :meth:`Context.should_yield`)."""
        return asked_to_yield(attempt)


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
