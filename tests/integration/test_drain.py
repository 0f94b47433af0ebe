"""I9 (a stop is not a failure), in one process: a draining worker lets its attempts finish
within the grace, gives the rest back uncounted (``release``), and a stopping supervisor
hands its leadership over at once.

Handlers are gated by events, so each test decides when an attempt may end; nothing sleeps
in place of a condition.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

import kiln
from kiln.config import Settings
from kiln.errors import LeaseLost
from kiln.models import Output, Task
from kiln.states import RUNNING, Event, Status
from kiln.store.records import Fence
from kiln.supervisor import LEADER
from kiln.worker import Worker

from .conftest import assert_one_final_state, task_events, wait_for_status, wait_until

KIND = "drain.generate"
GPU_KIND = "drain.gpu"


class Gate:
    """A handler that reports a step, then waits until the test opens its gate."""

    def __init__(self) -> None:
        self.started: dict[str, asyncio.Event] = {}
        self.opened = asyncio.Event()
        self.runs: list[tuple[str, int]] = []

    def entered(self, task_id: str) -> asyncio.Event:
        return self.started.setdefault(task_id, asyncio.Event())

    async def handler(self, ctx: Any, params: dict[str, Any]) -> Output:
        self.runs.append((ctx.task_id, ctx.attempt))
        await ctx.progress(1, 2, stage="gate")
        self.entered(ctx.task_id).set()
        await self.opened.wait()
        return Output("out.bin", f"{ctx.task_id} attempt {ctx.attempt}".encode())


@pytest.fixture
async def gated(settings: Settings) -> AsyncIterator[tuple[kiln.App, Gate]]:
    gate = Gate()
    app = kiln.App(settings=settings.with_(shutdown_grace_s=30.0))
    app.task(KIND)(gate.handler)
    app.task(GPU_KIND, resources={"gpu": 1})(gate.handler)
    async with app:
        yield app, gate


async def submit(app: kiln.App, name: str, kind: str = KIND, **options: Any) -> Task:
    return (await app.submit(kind, {"name": name}, **options)).task


async def status_of(app: kiln.App, task_id: str, *statuses: Status) -> Task:
    return await wait_for_status(app.engine.store, task_id, *statuses)


async def start(worker: Worker) -> asyncio.Task[None]:
    return asyncio.create_task(worker.run())


async def test_a_drained_attempt_that_ends_within_the_grace_succeeds(
    gated: tuple[kiln.App, Gate],
) -> None:
    # Given a worker running a task on its last attempt
    app, gate = gated
    task = await submit(app, "finishes", max_attempts=1)
    worker = app.worker(concurrency=1)
    running = await start(worker)
    await asyncio.wait_for(gate.entered(task.id).wait(), 10)

    # When it is drained with a long grace, and the attempt then ends
    worker.drain(30.0)
    assert worker.draining
    gate.opened.set()
    await asyncio.wait_for(running, 10)

    # Then the task succeeded on its one attempt, and nothing was given back
    done = await app.get(task.id)
    assert (done.status, done.attempt) == (Status.SUCCESS, 1)
    events = await assert_one_final_state(app.engine.store, task.id)
    assert Event.RELEASE not in [e.event for e in events]


async def test_an_attempt_still_running_when_the_grace_ends_goes_back_uncounted(
    gated: tuple[kiln.App, Gate],
) -> None:
    # Given a task on its last attempt, generating under a worker
    app, gate = gated
    task = await submit(app, "released", max_attempts=1)
    worker = app.worker(concurrency=1)
    running = await start(worker)
    await asyncio.wait_for(gate.entered(task.id).wait(), 10)
    claimed = await app.get(task.id)

    # When the worker drains with a grace that ends before the attempt does
    worker.drain(0.05)
    await asyncio.wait_for(running, 10)

    # Then the task is back in the queue: PENDING, attempt back, epoch raised, place kept
    back = await app.get(task.id)
    assert back.status is Status.PENDING
    assert (back.attempt, back.max_attempts) == (0, 1)
    assert back.epoch == claimed.epoch + 1
    assert back.ready_at == task.ready_at
    assert back.lease_owner is None and back.error is None
    assert (back.stage, back.progress_step) == (None, None)
    release = (await task_events(app.engine.store, task.id))[-1]
    assert (release.event, release.from_status, release.status) == (
        Event.RELEASE, Status.GENERATING, Status.PENDING
    )  # fmt: skip
    assert release.error is None

    # And the next worker runs it to SUCCESS on attempt 1 of 1
    gate.opened.set()
    async with kiln.app.running(app.worker(concurrency=1).run()):
        done = await status_of(app, task.id, Status.SUCCESS)
    assert (done.attempt, done.max_attempts) == (1, 1)
    await assert_one_final_state(app.engine.store, task.id)


async def test_attempts_waiting_for_a_resource_are_given_back_at_once(
    gated: tuple[kiln.App, Gate],
) -> None:
    # Given a worker with one GPU slot and two claimed tasks: one runs, one waits for the slot
    app, gate = gated
    first = await submit(app, "runs", GPU_KIND)
    second = await submit(app, "waits", GPU_KIND)
    worker = app.worker(concurrency=2, resources={"gpu": 1})
    running = await start(worker)
    await asyncio.wait_for(gate.entered(first.id).wait(), 10)
    await status_of(app, second.id, Status.WAITING_FOR_RESOURCE)

    # When the worker drains with a long grace
    worker.drain(30.0)

    # Then the waiting one is given back at once, while the running one goes on
    back = await status_of(app, second.id, Status.PENDING)
    assert back.attempt == 0
    assert (await app.get(first.id)).status is Status.GENERATING
    gate.opened.set()
    await asyncio.wait_for(running, 10)
    assert (await app.get(first.id)).status is Status.SUCCESS
    assert (await app.get(second.id)).status is Status.PENDING


async def test_a_cancelled_worker_gives_every_attempt_back_at_once(
    gated: tuple[kiln.App, Gate],
) -> None:
    # Given two running attempts
    app, gate = gated
    tasks = [await submit(app, f"stopped {n}", max_attempts=1) for n in range(2)]
    worker = app.worker(concurrency=2)
    running = await start(worker)
    for task in tasks:
        await asyncio.wait_for(gate.entered(task.id).wait(), 10)

    # When the worker is stopped at once (a second signal, the end of an App)
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)

    # Then both went back to the queue uncounted; none failed
    for task in tasks:
        back = await app.get(task.id)
        assert (back.status, back.attempt) == (Status.PENDING, 0)
        events = [e.event for e in await task_events(app.engine.store, task.id)]
        assert events == [Event.SUBMIT, Event.CLAIM, Event.ACQUIRE, Event.RELEASE]


async def test_a_task_with_a_cancel_asked_is_stopped_not_released(
    gated: tuple[kiln.App, Gate],
) -> None:
    app, gate = gated
    task = await submit(app, "cancel asked")
    worker = app.worker(concurrency=1)
    running = await start(worker)
    await asyncio.wait_for(gate.entered(task.id).wait(), 10)
    # Given a cancel asked from another process (this worker has not heard of it)
    await app.engine.store.request_cancel(task.id)

    worker.drain(0.0)
    await asyncio.wait_for(running, 10)

    assert (await app.get(task.id)).status is Status.CANCELLED


async def test_no_number_of_stops_fails_a_task_on_its_last_attempt(
    gated: tuple[kiln.App, Gate],
) -> None:
    # Given a task with one attempt, stopped mid-run by five workers in turn
    app, gate = gated
    task = await submit(app, "stopped often", max_attempts=1)
    for _ in range(5):
        gate.started.pop(task.id, None)
        worker = app.worker(concurrency=1)
        running = await start(worker)
        await asyncio.wait_for(gate.entered(task.id).wait(), 10)
        worker.drain(0.0)
        await asyncio.wait_for(running, 10)
        stopped = await app.get(task.id)
        assert (stopped.status, stopped.attempt) == (Status.PENDING, 0)

    # When a sixth worker lets it finish
    gate.opened.set()
    async with kiln.app.running(app.worker(concurrency=1).run()):
        done = await status_of(app, task.id, Status.SUCCESS)

    # Then it succeeded on attempt 1 of 1, and every attempt of the log was <= max_attempts
    assert (done.attempt, done.max_attempts) == (1, 1)
    events = await assert_one_final_state(app.engine.store, task.id)
    assert all(e.attempt <= 1 for e in events)
    assert [e.event for e in events].count(Event.RELEASE) == 5
    assert {n for _, n in gate.runs} == {1}


async def test_a_release_from_a_stale_epoch_is_refused(gated: tuple[kiln.App, Gate]) -> None:
    # Given a claimed task whose attempt was then expired by the supervisor (epoch+1)
    app, _ = gated
    task = await submit(app, "stale")
    (claimed,) = await app.engine.claim(worker_id="w1", kinds=[KIND], limit=1, lease_ttl_s=60)
    await app.apply(claimed, Event.EXPIRE, bump_epoch=True)
    requeued = await app.get(task.id)

    # When the old worker tries to give it back (its view: running at the old epoch)
    with pytest.raises(LeaseLost):
        fence = Fence(fenced=True, bump=True)
        await app.engine.apply(claimed, Event.RELEASE, fields={"attempt": 0}, fence=fence)

    # Then nothing changed
    assert await app.get(task.id) == requeued
    assert claimed.status in RUNNING


async def test_a_stopping_supervisor_hands_its_leadership_over_at_once(
    settings: Settings,
) -> None:
    # Given two supervisors with a long leader lease; the first leads
    async with kiln.App(settings=settings) as app:
        first = app.supervisor(owner="first", leader_ttl_s=60)
        second = app.supervisor(owner="second", leader_ttl_s=60)
        sweeping = asyncio.create_task(first.run())

        async def leading() -> bool:
            return first.last.leading

        await wait_until(leading, what="the first supervisor to lead")
        assert not (await second.sweep()).leading

        # When the first one stops
        sweeping.cancel()
        await asyncio.gather(sweeping, return_exceptions=True)

        # Then the second leads at its next sweep, not a lease later, with a new epoch
        report = await second.sweep()
        assert report.leading
        assert second.token is not None and second.token.epoch == 2
        assert await app.engine.store.lead(LEADER, "first", 60) is None
