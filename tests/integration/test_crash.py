"""I2, I8 and exactly-once effect: worker processes killed with SIGKILL at chosen points.

Each test runs real worker processes (worker_process.py) on one SQLite file and one
results folder, kills one with SIGKILL, and lets the Supervisor of the test process
sweep with the real clock.
"""

from __future__ import annotations

import subprocess

import pytest

import kiln
from kiln.app import running
from kiln.models import StoredOutput, Task
from kiln.states import Event, Status
from kiln.storage import verify

from .conftest import (
    WorkerProcesses,
    assert_one_final_state,
    demo_params,
    object_keys,
    successes,
    wait_for_status,
    wait_for_task,
    wait_until,
)

pytestmark = pytest.mark.slow

SLOW_STEPS = {"steps": 20, "step_ms": 50}


async def assert_succeeded_once(app: kiln.App, task_id: str) -> Task:
    """One final state, one SUCCESS event, and outputs verified at the final attempt's place."""
    task = await app.get(task_id)
    assert task.status is Status.SUCCESS
    events = await assert_one_final_state(app.engine.store, task_id)
    done = successes(events)
    assert len(done) == 1
    assert done[0].event in (Event.UPLOADED, Event.RECOVER)
    assert task.result is not None and task.result_prefix is not None
    outputs = [StoredOutput.from_json(o) for o in task.result["outputs"]]
    assert outputs
    for output in outputs:
        assert output.key.startswith(task.result_prefix + "/")
        assert await verify(app.storage, output)
    assert task.attempt <= task.max_attempts
    return task


async def assert_only_final_attempt_stored(app: kiln.App, task: Task) -> None:
    """Exactly-once effect: the task's objects all lie in the final attempt's location."""
    keys = await object_keys(app.storage, f"tasks/{task.id}/")
    assert keys
    assert all(key.startswith(f"{task.result_prefix}/") for key in keys), keys


async def assert_store_consistent(app: kiln.App, tasks: list[Task]) -> None:
    """The per-status counts the store keeps agree with the tasks themselves; no ghosts."""
    stats = await app.engine.store.stats(tenant=None, ghost_after_s=0.0)
    expected = {str(status): 0 for status in Status}
    for task in tasks:
        expected[str(task.status)] += 1
    assert stats.counts == expected
    assert stats.ghosts == 0


def expiries(events: list[kiln.TaskEvent]) -> list[kiln.TaskEvent]:
    return [e for e in events if e.event is Event.EXPIRE]


async def test_worker_killed_while_waiting_for_resource_loses_no_task(
    crash_app: kiln.App, worker_processes: WorkerProcesses
) -> None:
    # Given a worker process with one gpu slot holding two tasks: one runs, one waits for it
    store = crash_app.engine.store
    first = (await crash_app.submit("image.generate", demo_params("a fox", **SLOW_STEPS))).task
    second = (await crash_app.submit("image.generate", demo_params("a heron", **SLOW_STEPS))).task
    victim = worker_processes.start("--gpu", "1", "--concurrency", "2")

    async def one_waits_one_runs() -> bool:
        statuses = {(await crash_app.get(t.id)).status for t in (first, second)}
        return statuses == {Status.GENERATING, Status.WAITING_FOR_RESOURCE}

    await wait_until(one_waits_one_runs, timeout_s=15, what="one GENERATING, one WAITING")

    # When the worker is killed and a fresh one starts beside the supervisor
    worker_processes.sigkill(victim)
    worker_processes.start("--gpu", "2", "--concurrency", "2")
    async with running(crash_app.supervisor(interval_s=0.05).run()):
        for task in (first, second):
            await wait_for_status(store, task.id, Status.SUCCESS, timeout_s=20)

    # Then both tasks finish once, from their second attempt, after an expiry each
    finished = []
    for task in (first, second):
        done = await assert_succeeded_once(crash_app, task.id)
        events = await store.events(task_id=task.id)
        expired = expiries(events)
        assert len(expired) == 1
        assert expired[0].from_status in (Status.GENERATING, Status.WAITING_FOR_RESOURCE)
        assert expired[0].error is not None and expired[0].error["code"] == "lease_expired"
        assert done.attempt == 2
        await assert_only_final_attempt_stored(crash_app, done)
        finished.append(done)
    await assert_store_consistent(crash_app, finished)


async def test_worker_killed_while_generating_is_retried_in_a_new_attempt(
    crash_app: kiln.App, worker_processes: WorkerProcesses
) -> None:
    # Given a worker process that is GENERATING a task and has persisted some progress
    store = crash_app.engine.store
    task = (await crash_app.submit("image.generate", demo_params("an owl", **SLOW_STEPS))).task
    victim = worker_processes.start()
    running_task = await wait_for_task(
        store,
        task.id,
        lambda t: t.status is Status.GENERATING and (t.progress_step or 0) > 0,
        timeout_s=15,
        what="GENERATING with progress",
    )
    assert running_task.attempt == 1

    # When it is killed, and a fresh worker runs beside the supervisor
    worker_processes.sigkill(victim)
    worker_processes.start()
    async with running(crash_app.supervisor(interval_s=0.05).run()):
        await wait_for_status(store, task.id, Status.SUCCESS, timeout_s=20)

    # Then the lapsed lease ended attempt 1 and attempt 2 alone produced the output
    done = await assert_succeeded_once(crash_app, task.id)
    events = await store.events(task_id=task.id)
    expired = expiries(events)
    assert [e.from_status for e in expired] == [Status.GENERATING]
    assert [e.event for e in events if e.attempt == 1][-2:] == [
        Event.EXPIRE,
        Event.SCHEDULE_RETRY,
    ]
    assert done.attempt == 2
    assert done.epoch > running_task.epoch
    await assert_only_final_attempt_stored(crash_app, done)
    await assert_store_consistent(crash_app, [done])


async def test_worker_killed_mid_upload_is_regenerated_without_a_torn_result(
    crash_app: kiln.App, worker_processes: WorkerProcesses
) -> None:
    # Given a worker process that kills itself just before writing the image
    store = crash_app.engine.store
    task = (await crash_app.submit("image.generate", demo_params("a lighthouse"))).task
    victim = worker_processes.start("--kill-before-put", "image.png")

    # When it dies in UPLOADING
    await wait_until(
        lambda: _returned(victim), timeout_s=15, what="the worker to kill itself mid-upload"
    )
    assert victim.returncode == -9
    killed = await crash_app.get(task.id)
    assert killed.status is Status.UPLOADING
    assert killed.result_prefix is not None
    assert await object_keys(crash_app.storage, killed.result_prefix + "/") == []

    # And a fresh worker runs beside the supervisor
    worker_processes.start()
    async with running(crash_app.supervisor(interval_s=0.05).run()):
        await wait_for_status(store, task.id, Status.SUCCESS, timeout_s=20)

    # Then nothing was found to recover: attempt 1 expired and attempt 2 uploaded the result
    done = await assert_succeeded_once(crash_app, task.id)
    events = await store.events(task_id=task.id)
    assert [e.from_status for e in expiries(events)] == [Status.UPLOADING]
    assert successes(events)[0].event is Event.UPLOADED
    assert done.attempt == 2
    assert done.result_prefix != killed.result_prefix
    assert (await store.counters()).get(("recovered", ""), 0) == 0
    await assert_only_final_attempt_stored(crash_app, done)
    await assert_store_consistent(crash_app, [done])


async def test_worker_killed_after_manifest_is_recovered_without_regeneration(
    crash_app: kiln.App, worker_processes: WorkerProcesses
) -> None:
    # Given a worker process that kills itself right after writing the manifest
    store = crash_app.engine.store
    task = (await crash_app.submit("image.generate", demo_params("a windmill"))).task
    victim = worker_processes.start("--kill-after-put", "manifest.json")
    await wait_until(
        lambda: _returned(victim), timeout_s=15, what="the worker to kill itself after upload"
    )
    assert victim.returncode == -9
    killed = await crash_app.get(task.id)
    assert killed.status is Status.UPLOADING
    assert killed.result_prefix == f"tasks/{task.id}/1-1"
    image_key = f"{killed.result_prefix}/image.png"
    written = await crash_app.storage.get(image_key)

    # When only the supervisor runs (no worker at all)
    async with running(crash_app.supervisor(interval_s=0.05).run()):
        await wait_for_status(store, task.id, Status.SUCCESS, timeout_s=20)

    # Then the upload of the killed attempt is the result: recovered, not generated again
    done = await assert_succeeded_once(crash_app, task.id)
    events = await store.events(task_id=task.id)
    assert [e.event for e in events] == [
        Event.SUBMIT,
        Event.CLAIM,
        Event.ACQUIRE,
        Event.GENERATED,
        Event.RECOVER,
    ]
    assert done.attempt == killed.attempt == 1
    assert done.epoch == killed.epoch + 1
    assert (await store.counters()).get(("recovered", "")) == 1
    assert done.result is not None
    [output] = [StoredOutput.from_json(o) for o in done.result["outputs"]]
    assert output.key == image_key
    assert await crash_app.storage.get(output.key) == written
    await assert_only_final_attempt_stored(crash_app, done)
    await assert_store_consistent(crash_app, [done])


async def _returned(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is not None


async def test_worker_killed_mid_batch_leaves_every_task_finishing_exactly_once(
    crash_app: kiln.App, worker_processes: WorkerProcesses
) -> None:
    # Given eight tasks on a worker process running three at a time
    store = crash_app.engine.store
    params = {"steps": 10, "step_ms": 30}
    ids = [
        (await crash_app.submit("image.generate", demo_params(f"a reef {n}", **params))).task.id
        for n in range(8)
    ]
    victim = worker_processes.start("--gpu", "3", "--concurrency", "3")

    async def some_done_some_running() -> bool:
        statuses = [(await crash_app.get(i)).status for i in ids]
        return Status.SUCCESS in statuses and Status.GENERATING in statuses

    await wait_until(some_done_some_running, timeout_s=20, what="a batch half done")

    # When the worker is killed and two fresh workers take over beside the supervisor
    worker_processes.sigkill(victim)
    worker_processes.start("--gpu", "3", "--concurrency", "3")
    worker_processes.start("--gpu", "3", "--concurrency", "3")
    async with running(crash_app.supervisor(interval_s=0.05).run()):
        for task_id in ids:
            await wait_for_status(store, task_id, Status.SUCCESS, timeout_s=30)

    # Then every task succeeded exactly once, its result from one attempt only
    finished = [await assert_succeeded_once(crash_app, task_id) for task_id in ids]
    swept = [e for i in ids for e in await store.events(task_id=i)
             if e.event in (Event.EXPIRE, Event.RECOVER)]  # fmt: skip
    assert swept, "the killed worker held no task"
    await assert_store_consistent(crash_app, finished)
