"""A cancel asked from another process while a handler fails: the worker's failure, planned
with a retry on its earlier read, is refused by the store (StaleDecision); the worker reads
the task again and ends the attempt without a retry, so no attempt runs for a task whose
cancel was asked. On each store."""

from __future__ import annotations

from typing import Any

import kiln
from kiln.app import running
from kiln.config import Settings
from kiln.errors import Retryable
from kiln.states import Event, Status
from kiln.worker import Context


async def test_a_failure_after_a_cancel_from_elsewhere_is_not_retried(
    each_store: Settings,
) -> None:
    app = kiln.App(settings=each_store)
    calls: list[int] = []

    @app.task("test.raced")
    async def raced(ctx: Context, params: dict[str, Any]) -> None:
        calls.append(ctx.attempt)
        # Another process asks to cancel (the store only: no listener of this one hears)
        await app.store.request_cancel(ctx.task_id)
        raise Retryable("upstream went away", code="upstream_unavailable")

    async with app:
        task = (await app.submit("test.raced", {}, max_attempts=3)).task
        worker = app.worker(concurrency=1, idle_poll_s=(0.01, 0.05))
        async with running(worker.run()):
            done = await app.wait(task.id, timeout_s=30)
        events = [e.event for e in await app.store.events(task_id=task.id)]
    # The attempt ended for good: one call, no retry planned, no second claim
    assert calls == [1]
    assert done.status is Status.FAILED and done.attempt == 1
    assert Event.SCHEDULE_RETRY not in events and events.count(Event.CLAIM) == 1
