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
        await app.engine.store.request_cancel(ctx.task_id)
        raise Retryable("upstream went away", code="upstream_unavailable")

    async with app:
        task = (await app.submit("test.raced", {}, max_attempts=3)).task
        worker = app.worker(concurrency=1, idle_poll_s=(0.01, 0.05))
        async with running(worker.run()):
            done = await app.wait(task.id, timeout_s=30)
        events = [e.event for e in await app.engine.store.events(task_id=task.id)]
    # The attempt ended for good: one call, no retry planned, no second claim
    assert calls == [1]
    assert done.status is Status.FAILED and done.attempt == 1
    assert Event.SCHEDULE_RETRY not in events and events.count(Event.CLAIM) == 1


async def test_a_cancel_heard_after_the_upload_committed_leaves_the_success_alone(
    each_store: Settings,
) -> None:
    # Given a handler whose task is asked to cancel while it uploads, and whose worker
    # hears of that cancel only once its `uploaded` change has committed (the listener's
    # call arrives as the commit returns)
    app = kiln.App(settings=each_store)

    @app.task("test.uploading")
    async def uploading(ctx: Context, params: dict[str, Any]) -> list[kiln.Output]:
        return [kiln.Output("out.bin", b"bytes", "application/octet-stream")]

    async with app:
        task = (await app.submit("test.uploading", {})).task
        worker = app.worker(concurrency=1, idle_poll_s=(0.01, 0.05))
        committed = worker.leases.transition

        async def transition(attempt: Any, event: Event, *args: Any, **kwargs: Any) -> Any:
            if event is Event.UPLOADED:
                await app.engine.store.request_cancel(attempt.task.id)
            done = await committed(attempt, event, *args, **kwargs)
            if event is Event.UPLOADED:
                worker.leases.halt(attempt, "cancel")  # the cancel, heard now
            return done

        worker.leases.transition = transition  # type: ignore[method-assign]
        async with running(worker.run()):
            done = await app.wait(task.id, timeout_s=30)
            await worker.stop()
        events = [e.event for e in await app.engine.store.events(task_id=task.id)]
    # Then the task stays SUCCESS with its outputs, and the worker tried no change the
    # state table refuses (a `stopped` after SUCCESS)
    assert done.status is Status.SUCCESS
    assert events[-1] is Event.UPLOADED
    assert app.engine.illegal_transitions == 0
