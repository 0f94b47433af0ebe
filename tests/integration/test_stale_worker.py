"""I3 (fencing): a worker paused past its lease cannot change the task or its outputs.

Two Worker objects share one store on a fake clock. The first worker's lease is long in
real time (its heartbeat never fires during the test) but the fake clock is moved past
it, so the supervisor expires the attempt while the first worker is still paused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import kiln
from kiln.app import running
from kiln.config import Settings
from kiln.models import Output, Task
from kiln.states import Event, Status
from kiln.storage import StorageWrapper
from kiln.storage.local import LocalStorage

from .conftest import (
    AdvancingClock,
    assert_one_final_state,
    object_keys,
    wait_for_status,
    wait_for_task,
    wait_until,
)

KIND = "stale.generate"
PAUSED_LEASE_S = 300.0


class GatedStorage(StorageWrapper):
    """LocalStorage whose puts under ``gated_prefix`` wait for ``opened`` to be set."""

    def __init__(self, root: Path) -> None:
        super().__init__(LocalStorage(root))
        self.gated_prefix: str | None = None
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()
        self.written: list[str] = []

    async def put(self, key: str, data: bytes) -> None:
        if self.gated_prefix and key.startswith(self.gated_prefix):
            self.entered.set()
            await self.opened.wait()
        await self.inner.put(key, data)
        self.written.append(key)


class Stage:
    """Pauses the handler of each attempt number in ``paused`` until that one is released."""

    def __init__(self, *, paused: tuple[int, ...] = (), late_progress: bool = False) -> None:
        self.late_progress = late_progress
        self.entered = {n: asyncio.Event() for n in paused}
        self.release = {n: asyncio.Event() for n in paused}

    async def handler(self, ctx: Any, params: dict[str, Any]) -> Output:
        if ctx.attempt in self.release:
            self.entered[ctx.attempt].set()
            await self.release[ctx.attempt].wait()
            if self.late_progress:
                await ctx.progress(1, 1, stage="late")
        return Output("out.bin", f"attempt {ctx.attempt}".encode())


def make_app(
    settings: Settings, clock: AdvancingClock, storage: GatedStorage, stage: Stage
) -> kiln.App:
    app = kiln.App(
        settings=settings.with_(retry_base_s=0.01, retry_max_s=0.01),
        clock=clock,
        storage_backend=storage,
    )
    app.task(KIND)(stage.handler)
    return app


async def take_over(app: kiln.App, clock: AdvancingClock, task_id: str) -> Task:
    """Expire the paused attempt and let a second, healthy worker finish attempt 2."""
    clock.advance(PAUSED_LEASE_S + 1)
    report = await app.supervisor().sweep()
    assert report.expired == 1
    expired = await app.get(task_id)
    assert expired.status is Status.RETRYING
    clock.advance(1.0)
    second = app.worker(concurrency=1, lease_ttl_s=5.0, idle_poll_s=(0.01, 0.05))
    async with running(second.run()):
        return await wait_for_status(app.engine.store, task_id, Status.SUCCESS)


async def assert_second_attempt_stands(
    app: kiln.App, storage: GatedStorage, done: Task, stale_before: int
) -> None:
    task = await app.get(done.id)
    assert task.status is Status.SUCCESS
    assert (task.attempt, task.epoch, task.version) == (done.attempt, done.epoch, done.version)
    assert task.result == done.result
    assert task.result is not None
    [output] = task.result["outputs"]
    assert output["key"] == f"{done.result_prefix}/out.bin"
    assert await storage.get(output["key"]) == b"attempt 2"
    events = await assert_one_final_state(app.engine.store, done.id)
    assert [e.event for e in events if e.status is Status.SUCCESS] == [Event.UPLOADED]
    assert all(e.attempt == 2 for e in events if e.status is Status.SUCCESS)
    second_keys = await object_keys(storage, f"{done.result_prefix}/")
    assert sorted(second_keys) == [f"{done.result_prefix}/manifest.json",
                                   f"{done.result_prefix}/out.bin"]  # fmt: skip
    counters = await app.engine.store.counters()
    assert counters.get(("stale_writes", ""), 0) > stale_before


async def stale_writes(app: kiln.App) -> int:
    return (await app.engine.store.counters()).get(("stale_writes", ""), 0)


@pytest.mark.parametrize("late_progress", [False, True], ids=["returns", "reports-progress"])
async def test_stale_worker_cannot_finish_task_after_its_lease_expired(
    settings: Settings, clock: AdvancingClock, tmp_path: Path, late_progress: bool
) -> None:
    # Given a worker whose handler is paused in GENERATING on attempt 1
    storage = GatedStorage(tmp_path / "objects")
    stage = Stage(paused=(1,), late_progress=late_progress)
    app = make_app(settings, clock, storage, stage)
    async with app:
        task = (await app.submit(KIND, {"n": 1})).task
        first = app.worker(concurrency=1, lease_ttl_s=PAUSED_LEASE_S, idle_poll_s=(0.01, 0.05))
        async with running(first.run()):
            await asyncio.wait_for(stage.entered[1].wait(), 10)
            paused = await app.get(task.id)
            assert (paused.status, paused.attempt) == (Status.GENERATING, 1)

            # When its lease expires and a second worker completes attempt 2
            done = await take_over(app, clock, task.id)
            assert done.attempt == 2
            stale_before = await stale_writes(app)

            # And the paused worker wakes up and tries to go on
            stage.release[1].set()
            await wait_until(lambda: _idle(first), timeout_s=10, what="the stale worker to abandon")

        # Then its writes were refused: the task, result and outputs are attempt 2's
        await assert_second_attempt_stands(app, storage, done, stale_before)
        assert await object_keys(storage, f"{paused.result_prefix}/") == []
        assert not [k for k in storage.written if k.startswith(f"{paused.result_prefix}/")]


@pytest.mark.parametrize("late_progress", [False, True], ids=["returns", "reports-progress"])
async def test_stale_worker_cannot_touch_the_new_attempt_in_the_same_status(
    settings: Settings, clock: AdvancingClock, tmp_path: Path, late_progress: bool
) -> None:
    # Given attempt 1 paused in GENERATING and expired, and attempt 2 GENERATING elsewhere
    storage = GatedStorage(tmp_path / "objects")
    stage = Stage(paused=(1, 2), late_progress=late_progress)
    app = make_app(settings, clock, storage, stage)
    async with app:
        task = (await app.submit(KIND, {"n": 4})).task
        first = app.worker(concurrency=1, lease_ttl_s=PAUSED_LEASE_S, idle_poll_s=(0.01, 0.05))
        second = app.worker(concurrency=1, lease_ttl_s=PAUSED_LEASE_S, idle_poll_s=(0.01, 0.05))
        async with running(first.run()):
            await asyncio.wait_for(stage.entered[1].wait(), 10)
            clock.advance(PAUSED_LEASE_S + 1)
            assert (await app.supervisor().sweep()).expired == 1
            clock.advance(1.0)
            async with running(second.run()):
                await asyncio.wait_for(stage.entered[2].wait(), 10)
                current = await app.get(task.id)
                assert (current.status, current.attempt) == (Status.GENERATING, 2)
                stale_before = await stale_writes(app)

                # When the first worker wakes up and goes on from the very same status
                stage.release[1].set()
                await wait_until(lambda: _idle(first), timeout_s=10, what="the stale worker")

                # Then only its lease epoch told it apart, and it was refused: nothing changed
                after = await app.get(task.id)
                assert (after.status, after.attempt, after.epoch, after.version) == (
                    current.status, current.attempt, current.epoch, current.version)  # fmt: skip
                assert storage.written == []
                assert await stale_writes(app) > stale_before

                # And the second attempt finishes with its own output
                stage.release[2].set()
                done = await wait_for_status(app.engine.store, task.id, Status.SUCCESS)

        await assert_second_attempt_stands(app, storage, done, stale_before)
        assert done.result_prefix is not None
        assert all(k.startswith(done.result_prefix + "/") for k in storage.written)


async def test_stale_worker_paused_mid_upload_cannot_overwrite_the_new_result(
    settings: Settings, clock: AdvancingClock, tmp_path: Path
) -> None:
    # Given a worker paused inside the upload of attempt 1
    storage = GatedStorage(tmp_path / "objects")
    stage = Stage()
    app = make_app(settings, clock, storage, stage)
    async with app:
        task = (await app.submit(KIND, {"n": 2})).task
        storage.gated_prefix = f"tasks/{task.id}/1-1/"
        first = app.worker(concurrency=1, lease_ttl_s=PAUSED_LEASE_S, idle_poll_s=(0.01, 0.05))
        async with running(first.run()):
            await asyncio.wait_for(storage.entered.wait(), 10)
            paused = await app.get(task.id)
            assert (paused.status, paused.attempt) == (Status.UPLOADING, 1)

            # When its lease expires and a second worker completes attempt 2
            done = await take_over(app, clock, task.id)
            assert done.result_prefix != paused.result_prefix
            stale_before = await stale_writes(app)

            # And the paused upload resumes
            storage.opened.set()
            await wait_until(lambda: _idle(first), timeout_s=10, what="the stale worker to abandon")

        # Then the stale attempt wrote only into its own location, and changed nothing else
        await assert_second_attempt_stands(app, storage, done, stale_before)
        assert done.result_prefix is not None
        stale_keys = [k for k in storage.written if not k.startswith(done.result_prefix + "/")]
        assert stale_keys and all(k.startswith(f"{paused.result_prefix}/") for k in stale_keys)


async def test_stale_heartbeat_is_refused_and_halts_the_attempt(
    settings: Settings, clock: AdvancingClock, tmp_path: Path
) -> None:
    # Given a task claimed at epoch 1 and then expired by the supervisor
    storage = GatedStorage(tmp_path / "objects")
    app = make_app(settings, clock, storage, Stage())
    async with app:
        task = (await app.submit(KIND, {"n": 3})).task
        claimed = (await app.engine.store.claim(worker_id="w1", kinds=[KIND], limit=1,
                                         lease_ttl_s=1.0))[0]  # fmt: skip
        clock.advance(2.0)
        await app.supervisor().sweep()
        expired = await app.get(task.id)
        stale_before = await stale_writes(app)

        # When the old holder heartbeats or reports with its old epoch
        with pytest.raises(kiln.LeaseLost):
            await app.engine.store.heartbeat(task.id, claimed.epoch, 5.0, None)
        with pytest.raises(kiln.LeaseLost):
            await app.apply(claimed, Event.ACQUIRE, fenced=True)

        # Then nothing changed, and both refusals were counted
        after = await app.get(task.id)
        assert (after.status, after.epoch, after.version, after.lease_expires_at) == (
            expired.status, expired.epoch, expired.version, expired.lease_expires_at)  # fmt: skip
        assert await stale_writes(app) == stale_before + 2
        await wait_for_task(app.engine.store, task.id, lambda t: t.status is Status.RETRYING)


async def _idle(worker: Any) -> bool:
    return not worker.attempts
