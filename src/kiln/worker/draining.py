"""How a worker stops. Neither way counts an attempt (DESIGN.md, I9):

- :meth:`Shutdown.drain` (SIGTERM): the worker claims nothing more, gives back at once the
  attempts that wait for a resource, lets the running ones finish within the grace period
  (``KILN_SHUTDOWN_GRACE_S``), then gives the rest back (:meth:`Shutdown.wind_down`);
- :meth:`Shutdown.stop` (a second signal, the end of an App): every attempt is given back
  at once, each write bounded by :data:`~kiln.worker.running.RELEASE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kiln.engine import Engine
from kiln.states import Status
from kiln.worker.attempt import Attempt, Batch
from kiln.worker.leases import Leases
from kiln.worker.running import RELEASE_TIMEOUT_S
from kiln.worker.slots import Slots

log = logging.getLogger("kiln.worker")


class Shutdown:
    """The stopping of one worker: its ``attempts`` (by task id) and ``batches`` running."""

    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        attempts: dict[str, Attempt],
        batches: set[Batch],
        leases: Leases,
        slots: Slots,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.attempts = attempts
        self.batches = batches
        self.leases = leases
        self.slots = slots
        #: Set by :meth:`stop`: every attempt is being given back now.
        self.stopping = False
        #: When the grace of a drain ends (on the event loop's clock); None: not draining.
        self.drain_until: float | None = None
        self._wake = asyncio.Event()

    @property
    def draining(self) -> bool:
        return self.drain_until is not None

    def drain(self, grace_s: float | None = None) -> None:
        """Stop claiming now; let running attempts finish for ``grace_s`` seconds (default
        KILN_SHUTDOWN_GRACE_S), then give the rest back. Calling it again only shortens
        the grace."""
        grace = self.engine.settings.shutdown_grace_s if grace_s is None else grace_s
        until = asyncio.get_running_loop().time() + max(grace, 0.0)
        if self.drain_until is None or until < self.drain_until:
            self.drain_until = until
            log.info(
                "worker_draining",
                extra={
                    "worker_id": self.worker_id,
                    "running": len(self.attempts),
                    "grace_s": grace,
                },
            )
        self.slots.free.set()  # an idle claim loop notices at once
        self._wake.set()

    async def wind_down(self) -> None:
        """Give back what waits for a resource, let the rest run until the grace ends,
        then give back what still runs and wait (boundedly) for those writes."""
        for attempt in list(self.attempts.values()):
            if attempt.task.status is Status.WAITING_FOR_RESOURCE:
                self.leases.halt(attempt, "release")  # not started: nothing to wait for
        loop = asyncio.get_running_loop()
        while self.attempts and self.drain_until is not None:
            left_s = self.drain_until - loop.time()
            if left_s <= 0:
                break
            self._wake.clear()
            woken = asyncio.ensure_future(self._wake.wait())
            runners = {a.runner for a in self.attempts.values() if a.runner is not None}
            await asyncio.wait({woken, *runners}, timeout=left_s, return_when="FIRST_COMPLETED")
            woken.cancel()
        for attempt in list(self.attempts.values()):
            self.leases.halt(attempt, "release")
        runners = {a.runner for a in self.attempts.values() if a.runner is not None}
        if runners:
            await asyncio.wait(runners, timeout=RELEASE_TIMEOUT_S + 1.0)
        log.info("worker_drained", extra={"worker_id": self.worker_id, "left": len(self.attempts)})

    async def stop(self) -> None:
        """Stop running attempts at once and give each back (``release``, bounded by
        :data:`~kiln.worker.running.RELEASE_TIMEOUT_S`); one that cannot be given back
        keeps its lease until it lapses, and the supervisor takes it over."""
        self.stopping = True
        pending = [a.runner for a in self.attempts.values() if a.runner is not None]
        pending += [b.runner for b in self.batches if b.runner is not None]
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
