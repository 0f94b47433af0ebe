"""An attempt's lease: every write fenced by its epoch, the heartbeats that renew it (and
carry progress, and bring back a cancel or a yield request), and halting the attempt when
the lease is lost.

A refused write (:class:`~kiln.errors.LeaseLost`) means another actor moved the task on:
the worker stops working on it at once and never touches a newer attempt's storage
location.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kiln.bus import ProgressEvent
from kiln.contributions import Ran, Retry
from kiln.engine import Engine
from kiln.errors import LeaseLost, StaleDecision, StoreUnavailable
from kiln.models import JSON
from kiln.states import Event, Status
from kiln.store import Progress
from kiln.store.records import Fence
from kiln.worker.attempt import Attempt, ids
from kiln.worker.slots import Slots

log = logging.getLogger("kiln.worker")

#: How often progress is persisted on the task (live progress is published every step).
PROGRESS_PERSIST_S = 1.0
#: Heartbeats come every lease_ttl/3, and at least this often so a cancel asked from
#: another process is seen within seconds.
HEARTBEAT_MAX_S = 2.0
#: Backoff between tries of a write while the store does not answer (seconds).
STORE_RETRY_S = (0.1, 2.0)


class Leases:
    """The leases of one worker's attempts, held for ``lease_ttl_s`` and renewed by
    heartbeats; every write of an attempt goes through :meth:`transition`, fenced."""

    def __init__(self, engine: Engine, slots: Slots, lease_ttl_s: float) -> None:
        self.engine = engine
        self.slots = slots
        self.lease_ttl_s = lease_ttl_s

    @property
    def beat_interval_s(self) -> float:
        return max(min(self.lease_ttl_s / 3, HEARTBEAT_MAX_S), 0.01)

    async def heartbeat(self, attempt: Attempt) -> None:
        """Beat now (one interval into the attempt), then every interval until it ends."""
        while not attempt.ended and attempt.stop_reason != "lease_lost":
            await self.beat(attempt, with_progress=attempt.progress_dirty)
            await asyncio.sleep(self.beat_interval_s)

    async def beat(self, attempt: Attempt, *, with_progress: bool) -> None:
        if self.slots.lease_lapsed(attempt):
            log.warning("pool_lease_lapsed", extra=ids(attempt))
            self.halt(attempt, "lease_lost")
            return
        progress = attempt.progress if with_progress else None
        try:
            task = await self.engine.store.heartbeat(
                attempt.task.id, attempt.task.epoch, self.lease_ttl_s, progress
            )
        except LeaseLost:
            self.halt(attempt, "lease_lost")
            return
        except StoreUnavailable as exc:  # the next beat tries again; the lease may hold
            log.warning("heartbeat_failed", extra={**ids(attempt), "error": exc.message})
            return
        if progress is not None:
            attempt.progress_dirty = False
            attempt.progress_saved_at = self.engine.now()
        attempt.task = task
        if task.cancel_requested:
            self.halt(attempt, "cancel")
        if task.yield_requested_at is not None and not attempt.yield_requested:
            attempt.yield_requested = True
            log.info("yield_requested", extra=ids(attempt))

    def halt(self, attempt: Attempt, reason: str) -> None:
        """Stop the attempt's pipeline for ``reason`` (cancel, lease_lost, release); one
        not started yet stops as it starts."""
        if attempt.stop_reason is None:
            attempt.stop_reason = reason
            attempt.halted.set()
            log.info("attempt_halted", extra={**ids(attempt), "reason": reason})
            if attempt.pipeline is not None:
                attempt.pipeline.cancel()

    async def report_progress(
        self, attempt: Attempt, progress: Progress, preview: str | None
    ) -> None:
        """Publish the attempt's progress now; persist it with a beat at most once every
        :data:`PROGRESS_PERSIST_S`. A halted attempt alone stops here (CancelledError)."""
        attempt.progress = progress
        attempt.progress_dirty = True
        task = attempt.task
        self.engine.publish_progress(
            ProgressEvent(
                task.id,
                task.tenant,
                str(Status.GENERATING),
                progress.stage,
                _progress_json(progress),
                preview,
            )
        )
        if self.engine.now() - attempt.progress_saved_at >= PROGRESS_PERSIST_S:
            attempt.progress_saved_at = self.engine.now()
            await self.beat(attempt, with_progress=True)
        if attempt.stop_reason is not None and attempt.batch is None:
            raise asyncio.CancelledError  # a batch's call goes on for its other members

    async def transition(
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
        then: tuple[Event, Status] | None = None,
    ) -> None:
        """Record ``event`` for the attempt, fenced by its epoch (and ``then``, one more
        event to its target, in the same write); while the store does not answer, try
        again as long as the lease holds, then raise LeaseLost."""
        changes: dict[str, Any] = {}
        if state_timeout is not None:
            changes["state_deadline_at"] = self.engine.now() + state_timeout
        if attempt.progress_dirty and attempt.progress is not None and event is Event.GENERATED:
            changes.update(
                stage=attempt.progress.stage,
                progress_step=attempt.progress.step,
                progress_total=attempt.progress.total,
            )
        changes.update(fields or {})  # a chained ``uploaded`` clears the stage
        retry = None
        if retry_error is not None or then is not None:
            chained, chained_to = then or (None, None)
            retry = Retry(retry_error, retry_after_s, chained, chained_to)
        fence = Fence(fenced=True, bump=bump_epoch)
        delay = STORE_RETRY_S[0]
        while True:
            try:
                await self._apply(attempt, event, target, changes, retry, fence)
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
                log.warning(
                    "transition_retry",
                    extra={**ids(attempt), "event": str(event), "error": exc.message},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, STORE_RETRY_S[1])

    async def _apply(
        self,
        attempt: Attempt,
        event: Event,
        target: Status | None,
        changes: dict[str, Any],
        retry: Retry | None,
        fence: Fence,
    ) -> None:
        """One try of the write. Cancelled (a cancel request, a shutdown) while the write
        is in flight, it lets the write land, so the attempt knows the status it left."""
        write = asyncio.ensure_future(
            self.engine.apply(
                attempt.task,
                event,
                target,
                fields=changes,
                fence=fence,
                retry=retry,
                facts=[Ran(attempt.loading_s, attempt.pools, attempt.share, attempt.loads)],
            )
        )
        try:
            attempt.task = await asyncio.shield(write)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                attempt.task = await write
            raise


def _progress_json(progress: Progress) -> JSON | None:
    if progress.step is None or progress.total is None:
        return None
    fraction = min(progress.step / max(progress.total, 1), 1.0)
    return {"step": progress.step, "total": progress.total, "fraction": round(fraction, 4)}
