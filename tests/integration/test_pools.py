"""Shared resource pools across worker processes: the capacity holds for the whole cluster,
and a killed holder's slot comes back by itself (its lease lapses; no one releases it)."""

from __future__ import annotations

from typing import Any

import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.models import TaskEvent
from kiln.states import Event, Status

from .conftest import (
    AdvancingClock,
    WorkerProcesses,
    assert_one_final_state,
    demo_params,
    most_at_once,
    wait_for_status,
    wait_for_task,
    wait_until,
)

pytestmark = pytest.mark.slow

SLOW = {"steps": 12, "step_ms": 60}


def generating_spans(events: list[TaskEvent]) -> list[tuple[float, float]]:
    """(acquire, generated) times of each attempt that finished generating."""
    spans, started = [], None
    for event in events:
        if event.event is Event.ACQUIRE:
            started = event.at
        elif event.event is Event.GENERATED and started is not None:
            spans.append((started, event.at))
            started = None
    return spans


async def test_the_pool_capacity_holds_across_worker_processes(
    crash_app: kiln.App, worker_processes: WorkerProcesses
) -> None:
    # Given three worker processes, each able to run three tasks at once on local GPUs,
    # sharing one pool of two slots
    tasks = [
        (await crash_app.submit("image.generate", demo_params(f"fox {i}", **SLOW))).task
        for i in range(8)
    ]
    for _ in range(3):
        worker_processes.start("--pools", "gpu-a100:2", "--gpu", "3", "--concurrency", "3")

    # Then some task waits in the pool's line, with its place shown
    seen_waiting = []

    async def someone_waits_in_line() -> bool:
        for task in tasks:
            wait = await crash_app.engine.store.pools.wait(task.id)
            if wait is not None:
                seen_waiting.append(wait)
                return True
        return False

    await wait_until(someone_waits_in_line, timeout_s=20, what="a task waiting for a slot")
    assert seen_waiting[0].pool == "gpu-a100" and seen_waiting[0].capacity == 2
    async with running(crash_app.supervisor(interval_s=0.05).run()):
        for task in tasks:
            await wait_for_status(crash_app.engine.store, task.id, Status.SUCCESS, timeout_s=60)

    # And never more than two generated at once, across the three processes
    spans = []
    for task in tasks:
        events = await assert_one_final_state(crash_app.engine.store, task.id)
        spans += generating_spans(events)
    assert len(spans) == len(tasks)
    assert most_at_once(spans) == 2


async def test_a_killed_holders_slot_comes_back_by_itself(
    crash_app: kiln.App, worker_processes: WorkerProcesses
) -> None:
    # Given worker A generating the only slot's task, and worker B's task waiting in line
    store = crash_app.engine.store
    first = (await crash_app.submit("image.generate", demo_params("a heron", steps=150,
                                                                  step_ms=60))).task  # fmt: skip
    holder = worker_processes.start("--pools", "gpu-a100:1", "--gpu", "2", "--concurrency", "1")
    await wait_for_status(store, first.id, Status.GENERATING, timeout_s=20)
    second = (await crash_app.submit("image.generate", demo_params("an owl", **SLOW))).task
    worker_processes.start("--pools", "gpu-a100:1", "--gpu", "2", "--concurrency", "2")

    async def second_waits_first_in_line() -> bool:
        wait = await store.pools.wait(second.id)
        return wait is not None and wait.position == 1 and wait.held == 1

    await wait_until(second_waits_first_in_line, timeout_s=20, what="the owl first in line")

    # When A is killed, with no supervisor running to expire anything
    worker_processes.sigkill(holder)

    # Then B's task gets the slot once A's lease lapses, while A's task still shows GENERATING
    await wait_for_task(
        store, second.id, lambda t: t.status in (Status.GENERATING, Status.UPLOADING,
                                                 Status.SUCCESS),
        timeout_s=20, what="the owl past the pool",
    )  # fmt: skip
    stuck = await crash_app.get(first.id)
    assert stuck.status is Status.GENERATING and stuck.attempt == 1
    # And with the supervisor back, the killed attempt is retried and everything finishes
    async with running(crash_app.supervisor(interval_s=0.05).run()):
        for task in (first, second):
            await wait_for_status(store, task.id, Status.SUCCESS, timeout_s=60)
    heron = await assert_one_final_state(store, first.id)
    assert [e.event for e in heron if e.event is Event.EXPIRE] == [Event.EXPIRE]
    usage = {p.name: (p.held, p.waiting) for p in await store.pools.usage()}
    assert usage == {"gpu-a100": (0, 0)}


async def test_an_attempt_whose_lease_lapsed_stops_instead_of_renewing_it(
    settings: Settings, clock: AdvancingClock
) -> None:
    # Given a task generating with the only slot of a pool, on the fake clock
    pooled = settings.with_(pools={"gpu-a100": 1},
                            kind_resources={"image.generate": {"gpu-a100": 1}})  # fmt: skip
    async with kiln.App(settings=pooled, clock=clock) as app:
        demo.register(app)
        params = demo_params("a heron", steps=150, step_ms=60)
        task = (await app.submit("image.generate", params)).task
        worker = app.worker(concurrency=1)
        async with running(worker.run()):
            generating = await wait_for_status(app.engine.store, task.id, Status.GENERATING)
            assert generating.lease_expires_at is not None
            # When its lease lapses without a heartbeat landing (a paused process): another
            # task may hold the slot now
            clock.advance(pooled.lease_ttl_s + 1)
            # Then the attempt stops at its next heartbeat instead of renewing the lease
            await wait_until(lambda: _no_attempts(worker), timeout_s=10, what="the attempt to stop")
        after = await app.get(task.id)
        assert (after.status, after.epoch) == (Status.GENERATING, generating.epoch)
        assert after.lease_expires_at is not None and after.lease_expires_at <= clock()
        usage = {p.name: p.held for p in await app.engine.store.pools.usage()}
        assert usage == {"gpu-a100": 0}  # the lapsed lease already gave the slot back


async def _no_attempts(worker: Any) -> bool:
    return not worker.attempts
