"""What a handler sees of its attempt: :class:`Context`, the API for handler authors.

A kind's handler is called as ``await handler(ctx, params)`` with a :class:`Context` and
its parsed params (a batching kind's as ``await handler(ctxs, params)``, one context and
one params per member, in the same order)::

    from kiln.worker import Context

    @app.task("demo.count", params=CountParams)
    async def count(ctx: Context, params: CountParams) -> kiln.Output:
        for step in range(params.steps):
            if step and ctx.should_yield():  # between two steps: nothing half-done is kept
                raise kiln.Yielded()  # back to the queue, uncounted
            await asyncio.sleep(0.1)  # one step of the work
            await ctx.progress(step + 1, params.steps, stage="count")
        return kiln.Output("count.txt", b"counted", "text/plain")

The worker holds the attempt's lease meanwhile: a cancel, a lost lease or a stopping
worker cancels the handler (its next ``await``, or its next :meth:`Context.progress`
call raises ``CancelledError``). docs/backends.md ("Writing a handler: the Context")
shows this one whole, and one on a real model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from kiln.model_loads import LOADING_MODEL
from kiln.models import Task
from kiln.store import Progress
from kiln.worker.attempt import Attempt


class AttemptHost(Protocol):
    """What runs the attempt behind a :class:`Context` (a :class:`~kiln.worker.Worker`)."""

    async def report_progress(
        self, attempt: Attempt, progress: Progress, preview: str | None
    ) -> None: ...

    def model_loaded(self, attempt: Attempt, model: str, seconds: float) -> None: ...

    def asked_to_yield(self, attempt: Attempt) -> bool: ...


class Context:
    """What a handler sees: its task, its params, and a way to report progress.

    :attr:`params` is what the handler was called with (the kind's params model, or plain
    JSON); :attr:`task` the task as the worker last read it (status, epoch, attempt).
    """

    def __init__(self, worker: AttemptHost, attempt: Attempt, params: Any) -> None:
        self._worker = worker
        self._attempt = attempt
        #: The task's params, parsed by the kind (as the handler gets them).
        self.params = params

    @property
    def task(self) -> Task:
        """The task, as of the attempt's last write or heartbeat."""
        return self._attempt.task

    @property
    def attempt(self) -> int:
        """The attempt's number: 1 for the first; an attempt given back uncounted (a
        drain, a yield) leaves it as it was."""
        return self._attempt.task.attempt

    @property
    def task_id(self) -> str:
        """The task's id (``t_...``)."""
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
