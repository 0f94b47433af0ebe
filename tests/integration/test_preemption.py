"""Preemption at step boundaries (KILN_PREEMPT_AFTER_S), with real workers on each store: a
full pool of long low-priority work, and a task of higher priority waiting in its line past
the threshold: the leading supervisor asks one holder to yield; it stops between two demo
steps, goes back to the queue uncounted (``release``), queues again behind the waiter, and
finishes later as attempt 1. With the setting off, nothing yields."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

import kiln
from kiln import backends, counters, demo
from kiln.app import running
from kiln.config import Settings
from kiln.models import Task, TaskEvent
from kiln.states import Event, Status

from .cli_workers import CliWorkers
from .conftest import assert_one_final_state, demo_params, task_events, wait_for_task

pytestmark = pytest.mark.slow

#: A low-priority task long enough to be preempted (about 3 s of 50 ms steps).
LONG = {"steps": 60, "step_ms": 50}
#: A short task of higher priority.
SHORT = {"steps": 4, "step_ms": 20}

MakeApp = Callable[..., contextlib.AbstractAsyncContextManager[kiln.App]]


@pytest.fixture(params=["sqlite", "postgres"])
def make_app(request: pytest.FixtureRequest, settings: Settings) -> MakeApp:
    """An App (real clock) on each store with a shared pool ``gpu`` of some capacity and
    KILN_PREEMPT_AFTER_S as given; the demo backend serves ``image.generate``."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        settings = settings.with_(database_url=server.new_database())

    @contextlib.asynccontextmanager
    async def make(
        capacity: int, preempt_after_s: float | None, batch: tuple[int, float] | None = None
    ) -> AsyncIterator[kiln.App]:
        app = kiln.App(
            settings=settings.with_(
                pools={"gpu": capacity}, preempt_after_s=preempt_after_s, lease_ttl_s=3.0,
                supervisor_interval_s=0.1, generate_batch=batch,
            )
        )  # fmt: skip
        if batch is None:
            demo.register(app)
        else:
            backends.register(app)  # the demo backend, in batches
        async with app:
            yield app

    return make


async def submit(app: kiln.App, name: str, priority: int, shape: dict[str, int]) -> Task:
    params = demo_params(name, **shape)  # type: ignore[arg-type]
    return (await app.submit("image.generate", params, priority=priority)).task


async def generating(app: kiln.App, task: Task) -> Task:
    return await wait_for_task(
        app.engine.store,
        task.id,
        lambda t: t.status is Status.GENERATING,
        what=f"{task.id} generating",
    )


async def done(app: kiln.App, task: Task, timeout_s: float = 30.0) -> Task:
    return await wait_for_task(
        app.engine.store, task.id, lambda t: t.status is Status.SUCCESS, timeout_s=timeout_s,
        what=f"{task.id} done",
    )  # fmt: skip


def first(events: list[TaskEvent], event: Event) -> TaskEvent:
    return next(e for e in events if e.event is event)


async def test_a_long_low_priority_task_yields_to_a_high_one_and_resumes_uncounted(
    make_app: MakeApp,
) -> None:
    async with make_app(1, 0.3) as app:
        # Given one GPU slot held by a long task of priority 0 on one worker
        low = await submit(app, "a long fox", 0, LONG)
        first_worker = app.worker(concurrency=1)
        async with running(first_worker.run(), app.supervisor().run()):
            await generating(app, low)
            # When a task of priority 5 arrives on another worker and waits past 0.3 s
            high = await submit(app, "an urgent fox", 5, SHORT)
            async with running(app.worker(concurrency=1).run()):
                # Then the low one yields at a step, the high one runs, the low one resumes
                high_done = await done(app, high)
                low_done = await done(app, low)
        assert low_done.attempt == 1 and high_done.attempt == 1  # the yield did not count
        assert low_done.yield_requested_at is None
        low_events = await assert_one_final_state(app.engine.store, low.id)
        high_events = await assert_one_final_state(app.engine.store, high.id)
        released = first(low_events, Event.RELEASE)
        assert released.from_status is Status.GENERATING and released.status is Status.PENDING
        assert [e.event for e in low_events].count(Event.CLAIM) == 2
        assert [e.event for e in low_events].count(Event.RELEASE) == 1
        # The high one took the slot the yield freed, before the low one took it again
        acquires = [e for e in low_events if e.event is Event.ACQUIRE]
        assert released.at <= first(high_events, Event.ACQUIRE).at <= acquires[1].at
        stepped = low_events[low_events.index(released) - 1]
        assert stepped.event is Event.ACQUIRE  # it had been generating, then yielded
        assert (await app.engine.store.counters())[(counters.PREEMPTIONS, "gpu")] == 1


async def test_preemption_order_the_lowest_priority_latest_started_holder_yields(
    make_app: MakeApp,
) -> None:
    async with make_app(2, 0.3) as app:
        # Given a pool of two held by two long tasks of priority 0, b started after a
        a = await submit(app, "fox a", 0, LONG)
        async with running(app.worker(concurrency=1).run(), app.supervisor().run()):
            await generating(app, a)
            b = await submit(app, "fox b", 0, LONG)
            async with running(app.worker(concurrency=1).run()):
                await generating(app, b)
                # When a task of priority 3 waits on a third worker past the threshold
                high = await submit(app, "urgent fox", 3, SHORT)
                async with running(app.worker(concurrency=1).run()):
                    await done(app, high)
                    a_done, b_done = await done(app, a), await done(app, b)
        # Then b yielded, a ran on; both finished as attempt 1
        a_events = await assert_one_final_state(app.engine.store, a.id)
        b_events = await assert_one_final_state(app.engine.store, b.id)
        assert Event.RELEASE not in [e.event for e in a_events]
        assert [e.event for e in b_events].count(Event.RELEASE) == 1
        assert a_done.attempt == 1 and b_done.attempt == 1
        assert (await app.engine.store.counters())[(counters.PREEMPTIONS, "gpu")] == 1


async def test_a_batch_yields_as_a_whole_when_its_slot_holder_is_asked(
    make_app: MakeApp,
) -> None:
    async with make_app(2, 0.3, (2, 500.0)) as app:
        # Given a batch of two long tasks holding both units of the pool through its leader
        lows = [await submit(app, f"fox {n}", 0, LONG) for n in range(2)]
        async with running(app.worker(concurrency=1).run(), app.supervisor().run()):
            for low in lows:
                await generating(app, low)
            # When a task of higher priority waits past the threshold on another worker
            high = await submit(app, "urgent fox", 5, SHORT)
            async with running(app.worker(concurrency=1).run()):
                await done(app, high)
                finished = [await done(app, low) for low in lows]
        # Then every member yielded (one request, to the leader), uncounted
        assert [t.attempt for t in finished] == [1, 1]
        for low in lows:
            events = await assert_one_final_state(app.engine.store, low.id)
            assert [e.event for e in events].count(Event.RELEASE) == 1
        assert (await app.engine.store.counters())[(counters.PREEMPTIONS, "gpu")] == 1


async def test_with_the_setting_off_nothing_yields(
    make_app: MakeApp,
) -> None:
    async with make_app(1, None) as app:
        low = await submit(app, "a fox", 0, {"steps": 20, "step_ms": 50})
        async with running(app.worker(concurrency=1).run(), app.supervisor().run()):
            await generating(app, low)
            high = await submit(app, "an urgent fox", 5, SHORT)
            async with running(app.worker(concurrency=1).run()):
                await done(app, high)
        # The low one ran to its end first, in one attempt; the high one waited for it
        events = await task_events(app.engine.store, low.id)
        assert Event.RELEASE not in [e.event for e in events]
        high_events = await task_events(app.engine.store, high.id)
        assert first(events, Event.GENERATED).at <= first(high_events, Event.ACQUIRE).at
        assert (counters.PREEMPTIONS, "gpu") not in await app.engine.store.counters()


async def test_kiln_worker_processes_yield_and_resume_across_processes(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: Callable[..., CliWorkers]
) -> None:
    # Given `kiln worker` and `kiln supervisor` processes sharing a pool of one GPU
    workers = cli_workers(tmp_path, new_database(), KILN_POOLS="gpu:1",
                          KILN_PREEMPT_AFTER_S="0.3", KILN_SUPERVISOR_INTERVAL_S="0.2")  # fmt: skip
    async with workers.app() as app:
        low = await submit(app, "a long fox", 0, LONG)
        workers.start_supervisor()
        workers.start("--concurrency", "1", "--gpus", "1")
        await wait_for_task(app.engine.store, low.id, lambda t: t.status is Status.GENERATING,
                            timeout_s=30, what="the low task generating")  # fmt: skip
        # When a task of higher priority waits in the pool's line on a second worker
        high = await submit(app, "an urgent fox", 5, SHORT)
        workers.start("--concurrency", "1", "--gpus", "1")
        high_done = await done(app, high, timeout_s=60)
        low_done = await done(app, low, timeout_s=60)
        low_events = await assert_one_final_state(app.engine.store, low.id)
        high_events = await assert_one_final_state(app.engine.store, high.id)
    # Then the low one yielded once, uncounted, and the high one took the slot first
    assert low_done.attempt == 1 and high_done.attempt == 1
    released = first(low_events, Event.RELEASE)
    assert released.from_status is Status.GENERATING
    assert released.at <= first(high_events, Event.ACQUIRE).at
    assert sum(workers.count("attempt_yielded")) == 1
    assert [line["task_id"] for line in workers.lines("preempt_requested")] == [low.id]
