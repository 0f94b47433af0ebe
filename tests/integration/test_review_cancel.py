"""Moderation review (approve / reject) and cancellation in every kind of status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.errors import AlreadyFinal, NotInReview
from kiln.models import StoredOutput, Task
from kiln.states import FINAL, Event, Status
from kiln.storage import verify
from kiln.store import Change, Store, open_store
from kiln.worker import Worker

from .conftest import (
    assert_one_final_state,
    claim_generating,
    demo_params,
    wait_for_status,
    wait_for_task,
    wait_until,
)


@pytest.fixture
async def live_app(settings: Settings) -> AsyncIterator[kiln.App]:
    """Real clock, short leases (heartbeat every 0.1 s), quick retries."""
    app = kiln.App(settings=settings.with_(lease_ttl_s=0.3, retry_base_s=0.01, retry_max_s=0.02))
    demo.register(app)
    async with app:
        yield app


def run_worker(app: kiln.App) -> Coroutine[Any, Any, None]:
    worker: Worker = app.worker(concurrency=2, resources={"gpu": 2}, idle_poll_s=(0.01, 0.05))
    return worker.run()


def outputs_of(task: Task) -> list[StoredOutput]:
    assert task.result is not None
    return [StoredOutput.from_json(o) for o in task.result["outputs"]]


async def in_review(app: kiln.App, prompt: str) -> Task:
    task = (await app.submit("image.generate", demo_params(prompt, review=True))).task
    async with running(run_worker(app)):
        return await wait_for_status(app.engine.store, task.id, Status.NEEDS_REVIEW)


async def test_flagged_output_waits_in_review_with_its_result_stored(live_app: kiln.App) -> None:
    # Given / When a task the moderation check flags runs
    held = await in_review(live_app, "a flagged sunset")

    # Then it rests in NEEDS_REVIEW with verified outputs, not final
    assert not held.final and held.finished_at is None
    outputs = outputs_of(held)
    assert outputs
    for output in outputs:
        assert await verify(live_app.storage, output)
    events = await live_app.engine.store.events(task_id=held.id)
    assert (events[-1].event, events[-1].status) == (Event.UPLOADED, Status.NEEDS_REVIEW)


async def test_approve_verifies_again_and_succeeds(live_app: kiln.App) -> None:
    # Given a task in review
    held = await in_review(live_app, "an approved sunset")

    # When a moderator approves it
    approved = await live_app.review(held.id, "approve")

    # Then it is SUCCESS with the same, still verified outputs
    assert approved.status is Status.SUCCESS and approved.finished_at is not None
    assert approved.result == held.result
    for output in outputs_of(approved):
        assert await verify(live_app.storage, output)
    events = await assert_one_final_state(live_app.engine.store, held.id)
    assert events[-1].event is Event.APPROVE


async def test_approve_of_a_lost_output_ends_failed_result_lost(live_app: kiln.App) -> None:
    # Given a task in review whose output was deleted behind the store's back
    held = await in_review(live_app, "a vanished sunset")
    for output in outputs_of(held):
        await live_app.storage.delete(output.key)

    # When a moderator approves it
    after = await live_app.review(held.id, "approve")

    # Then it never becomes SUCCESS: FAILED result_lost, final
    assert after.status is Status.FAILED and after.final
    assert after.error is not None and after.error["code"] == "result_lost"
    events = await assert_one_final_state(live_app.engine.store, held.id)
    assert not [e for e in events if e.status is Status.SUCCESS]


async def test_approve_of_a_corrupted_output_ends_failed_result_lost(
    live_app: kiln.App,
) -> None:
    # Given a task in review whose output bytes were replaced behind the store's back
    held = await in_review(live_app, "a tampered sunset")
    [output] = outputs_of(held)
    data = await live_app.storage.get(output.key)
    await live_app.storage.put(output.key, bytes([data[0] ^ 0xFF]) + data[1:])

    # When a moderator approves it / Then it is FAILED result_lost
    after = await live_app.review(held.id, "approve")
    assert after.status is Status.FAILED
    assert after.error is not None and after.error["code"] == "result_lost"


async def test_reject_fails_for_good_and_deletes_the_outputs(live_app: kiln.App) -> None:
    # Given a task in review
    held = await in_review(live_app, "a rejected sunset")

    # When a moderator rejects it
    rejected = await live_app.review(held.id, "reject", reason="not allowed")

    # Then it is FAILED content_rejected, final, and its outputs are gone from storage
    assert rejected.status is Status.FAILED and rejected.final
    assert rejected.error is not None
    assert rejected.error["code"] == "content_rejected"
    assert rejected.error["retryable"] is False
    for output in outputs_of(held):
        assert await live_app.storage.stat(output.key) is None
    events = await assert_one_final_state(live_app.engine.store, held.id)
    assert events[-1].event is Event.REJECT
    with pytest.raises(NotInReview):
        await live_app.review(held.id, "approve")


async def test_cancel_of_a_task_in_review_cancels_it(live_app: kiln.App) -> None:
    held = await in_review(live_app, "a cancelled sunset")
    cancelled = await live_app.cancel(held.id)
    assert cancelled.status is Status.CANCELLED
    events = await assert_one_final_state(live_app.engine.store, held.id)
    assert (events[-1].event, events[-1].from_status) == (Event.CANCEL, Status.NEEDS_REVIEW)


async def test_cancel_of_a_pending_task_is_immediate(live_app: kiln.App) -> None:
    # Given a PENDING task and no worker
    task = (await live_app.submit("image.generate", demo_params("a queued kite"))).task

    # When it is cancelled
    cancelled = await live_app.cancel(task.id)

    # Then it is CANCELLED at once, and no worker can claim it any more
    assert cancelled.status is Status.CANCELLED and cancelled.finished_at is not None
    events = await assert_one_final_state(live_app.engine.store, task.id)
    assert [e.event for e in events] == [Event.SUBMIT, Event.CANCEL]
    assert await live_app.engine.store.claim(worker_id="w", kinds=["image.generate"], limit=1,
                                      lease_ttl_s=1.0) == []  # fmt: skip


async def test_cancel_of_a_retrying_task_is_immediate(
    fake_app: kiln.App,
) -> None:
    task = (await fake_app.submit("image.generate", demo_params("a kite"))).task
    held = await claim_generating(fake_app)
    error = {"code": "flaky", "message": "again", "retryable": True}
    retrying = await fake_app.apply(held, Event.FAIL, fenced=True, retry_error=error)
    assert retrying.status is Status.RETRYING

    cancelled = await fake_app.cancel(task.id)

    assert cancelled.status is Status.CANCELLED
    events = await assert_one_final_state(fake_app.engine.store, task.id)
    assert (events[-1].event, events[-1].from_status) == (Event.CANCEL, Status.RETRYING)


async def test_cancel_of_a_generating_task_stops_the_worker_at_its_next_heartbeat(
    live_app: kiln.App,
) -> None:
    # Given a task GENERATING slowly on a live worker
    params = demo_params("a slow kite", steps=100, step_ms=50)
    task = (await live_app.submit("image.generate", params)).task
    async with running(run_worker(live_app)):
        generating = await wait_for_status(live_app.engine.store, task.id, Status.GENERATING)

        # When it is cancelled
        requested = await live_app.cancel(task.id)

        # Then it only gets cancel_requested, and the worker stops it: CANCELLED via stopped
        assert requested.status is Status.GENERATING and requested.cancel_requested
        # (a worker in the same process is told at once, so a second cancel may find the
        # task already CANCELLED)
        try:
            again = await live_app.cancel(task.id)
        except AlreadyFinal:
            pass
        else:
            assert again.cancel_requested and again.status is Status.GENERATING
        done = await wait_for_status(live_app.engine.store, task.id, Status.CANCELLED, timeout_s=5)

    assert done.attempt == generating.attempt == 1
    assert done.result is None
    events = await assert_one_final_state(live_app.engine.store, task.id)
    assert (events[-1].event, events[-1].from_status) == (Event.STOPPED, Status.GENERATING)
    assert done.result_prefix is not None
    assert [o async for o in live_app.storage.list(done.result_prefix + "/")] == []


async def test_cancel_of_a_final_task_is_refused(live_app: kiln.App) -> None:
    # Given a task that succeeded, and one already cancelled
    done_task = (await live_app.submit("image.generate", demo_params("a finished kite"))).task
    async with running(run_worker(live_app)):
        done = await wait_for_status(live_app.engine.store, done_task.id, Status.SUCCESS)
    cancelled = (await live_app.submit("image.generate", demo_params("a gone kite"))).task
    await live_app.cancel(cancelled.id)

    # When either is cancelled / Then AlreadyFinal, and nothing changes
    for task_id in (done.id, cancelled.id):
        before = await live_app.get(task_id)
        with pytest.raises(AlreadyFinal):
            await live_app.cancel(task_id)
        after = await live_app.get(task_id)
        assert (after.status, after.version) == (before.status, before.version)


async def test_cancel_of_a_task_waiting_for_a_resource_stops_it_unrun(
    live_app: kiln.App,
) -> None:
    # Given two slow tasks on a worker with one gpu slot: one runs, the other waits
    ids = [
        (await live_app.submit("image.generate",
                               demo_params(f"a slow kite {n}", steps=60, step_ms=50))).task.id
        for n in range(2)
    ]  # fmt: skip
    worker = live_app.worker(concurrency=2, resources={"gpu": 1}, idle_poll_s=(0.01, 0.05))
    async with running(worker.run()):
        statuses: dict[Status, str] = {}

        async def one_waits() -> bool:
            statuses.clear()
            for task_id in ids:
                statuses[(await live_app.get(task_id)).status] = task_id
            return set(statuses) == {Status.GENERATING, Status.WAITING_FOR_RESOURCE}

        await wait_until(one_waits, what="one GENERATING and one WAITING_FOR_RESOURCE")
        waiter, runner = statuses[Status.WAITING_FOR_RESOURCE], statuses[Status.GENERATING]

        # When the waiting task is cancelled
        await live_app.cancel(waiter)

        # Then the worker stops it without running it, while the other keeps its slot
        done = await wait_for_status(live_app.engine.store, waiter, Status.CANCELLED, timeout_s=5)
        assert (await live_app.get(runner)).status is Status.GENERATING
        await live_app.cancel(runner)
        await wait_for_status(live_app.engine.store, runner, Status.CANCELLED, timeout_s=5)
    events = await assert_one_final_state(live_app.engine.store, waiter)
    assert (events[-1].event, events[-1].from_status) == (
        Event.STOPPED, Status.WAITING_FOR_RESOURCE)  # fmt: skip
    assert Event.ACQUIRE not in [e.event for e in events]
    assert done.result is None


class GatedAcquire:
    """A store whose ``acquire`` write waits at a gate: a cancel can land mid-write."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.clock = inner.clock
        self.writing = asyncio.Event()
        self.gate = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def apply(self, change: Change) -> Any:
        if change.steps[0][0] is Event.ACQUIRE:
            self.writing.set()
            await self.gate.wait()
        return await self.inner.apply(change)


async def test_a_cancel_during_a_workers_write_is_honoured(settings: Settings) -> None:
    # Given a worker whose move to GENERATING is in flight when the cancel arrives
    store = GatedAcquire(open_store(settings.resolved_database_url))
    app = kiln.App(settings=settings, store=store)  # type: ignore[arg-type]
    demo.register(app)
    async with app, running(run_worker(app)):
        task = (await app.submit("image.generate", demo_params("a canyon"))).task
        await store.writing.wait()
        cancelling = asyncio.ensure_future(app.cancel(task.id))
        await wait_for_task(app.engine.store, task.id, lambda t: t.cancel_requested)
        # When the write lands after the worker was told to stop
        store.gate.set()
        await cancelling
        done = await wait_for_status(app.engine.store, task.id, *FINAL)
        events = await app.engine.store.events(task_id=task.id)
    # Then the attempt ends CANCELLED from the status it really left, not by lease expiry
    assert done.status is Status.CANCELLED
    assert [e.event for e in events][-2:] == [Event.ACQUIRE, Event.STOPPED]
