"""I4 (verified success) under storage faults: failed, corrupted and lost writes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.models import StoredOutput, Task
from kiln.states import Event, Status
from kiln.storage import StorageWrapper, verify
from kiln.storage.local import LocalStorage
from kiln.storage.s3 import S3Storage
from services.seaweed import S3Server, closed_port

from .conftest import assert_one_final_state, demo_params, wait_for_status

Fault = Literal["raise", "corrupt", "drop"]


class FaultyStorage(StorageWrapper):
    """LocalStorage whose first ``failing`` puts go wrong the way ``fault`` says.

    ``raise``: OSError, nothing written. ``corrupt``: the object is written with one byte
    flipped (same size, other sha256). ``drop``: the put returns but nothing is written.
    """

    def __init__(self, root: Path, *, fault: Fault, failing: int) -> None:
        super().__init__(LocalStorage(root))
        self.fault = fault
        self.failing = failing
        self.puts = 0
        self.faulted: list[str] = []

    async def put(self, key: str, data: bytes) -> None:
        self.puts += 1
        if self.puts > self.failing:
            await self.inner.put(key, data)
            return
        self.faulted.append(key)
        if self.fault == "raise":
            raise OSError(28, "No space left on device")
        if self.fault == "corrupt":
            await self.inner.put(key, bytes([data[0] ^ 0xFF]) + data[1:])


class UnreachableS3(StorageWrapper):
    """S3 storage whose first ``failing`` puts go to an endpoint that refuses connections,
    as when the bucket's server is down or cut off; everything else reaches the bucket."""

    def __init__(self, inner: S3Storage, *, failing: int) -> None:
        super().__init__(inner)
        down = f"http://127.0.0.1:{closed_port()}"
        self.down = S3Storage(inner.bucket, inner.prefix, endpoint_url=down)
        self.failing = failing
        self.puts = 0
        self.faulted: list[str] = []

    async def put(self, key: str, data: bytes) -> None:
        self.puts += 1
        if self.puts > self.failing:
            await self.inner.put(key, data)
            return
        self.faulted.append(key)
        await self.down.put(key, data)


def fault_settings(settings: Settings) -> Settings:
    # Half the writes failing trips the storage circuit breaker: a short open period keeps
    # these tests about verification, not about the pause (tests/backends covers it).
    return settings.with_(retry_base_s=0.01, retry_max_s=0.02, breaker_open_s=0.1)


async def run_to_final(app: kiln.App, task_id: str) -> Task:
    worker = app.worker(concurrency=1, resources={"gpu": 1}, idle_poll_s=(0.01, 0.05))
    async with running(worker.run()):
        return await wait_for_status(
            app.engine.store, task_id, Status.SUCCESS, Status.FAILED, Status.TIMEOUT, timeout_s=15
        )


async def assert_every_success_verified(app: kiln.App) -> None:
    tasks, _ = await app.engine.store.list_tasks(tenant=None, limit=1000)
    for task in tasks:
        if task.status is Status.SUCCESS:
            assert task.result is not None
            outputs = [StoredOutput.from_json(o) for o in task.result["outputs"]]
            assert outputs
            for output in outputs:
                assert await verify(app.storage, output), output


@pytest.mark.parametrize("fault", ["raise", "corrupt", "drop"])
async def test_faulty_first_write_is_retried_and_succeeds(
    settings: Settings, tmp_path: Path, fault: Fault
) -> None:
    # Given storage whose first write fails, is corrupted, or is silently lost
    storage = FaultyStorage(tmp_path / "faulty", fault=fault, failing=1)
    app = kiln.App(settings=fault_settings(settings), storage_backend=storage)
    demo.register(app)
    async with app:
        task = (await app.submit("image.generate", demo_params("a glacier"))).task

        # When a worker runs it
        done = await run_to_final(app, task.id)

        # Then attempt 1 failed on the fault, attempt 2 succeeded with verified outputs
        assert done.status is Status.SUCCESS
        assert done.attempt == 2
        assert storage.faulted == [f"tasks/{task.id}/1-1/image.png"]
        events = await assert_one_final_state(app.engine.store, task.id)
        failed = [e for e in events if e.event is Event.FAIL]
        assert len(failed) == 1 and failed[0].attempt == 1
        expected = "internal_error" if fault == "raise" else "storage_verify_failed"
        assert failed[0].error is not None and failed[0].error["code"] == expected
        assert done.result is not None
        assert all(o["key"].startswith(f"tasks/{task.id}/2-") for o in done.result["outputs"])
        await assert_every_success_verified(app)


@pytest.mark.parametrize(
    ("fault", "code"),
    [("raise", "internal_error"), ("corrupt", "storage_verify_failed"),
     ("drop", "storage_verify_failed")],
)  # fmt: skip
async def test_every_write_failing_ends_failed_never_success(
    settings: Settings, tmp_path: Path, fault: Fault, code: str
) -> None:
    # Given storage where every write goes wrong, and a task allowed two attempts
    storage = FaultyStorage(tmp_path / "faulty", fault=fault, failing=10**6)
    app = kiln.App(settings=fault_settings(settings), storage_backend=storage)
    demo.register(app)
    async with app:
        task = (await app.submit("image.generate", demo_params("a canyon"), max_attempts=2)).task

        # When a worker runs it
        done = await run_to_final(app, task.id)

        # Then it ends FAILED with the fault's code after exactly two attempts, never SUCCESS
        assert done.status is Status.FAILED
        assert done.attempt == done.max_attempts == 2
        assert done.error is not None and done.error["code"] == code
        assert done.result is None
        events = await assert_one_final_state(app.engine.store, task.id)
        assert not [e for e in events if e.status in (Status.SUCCESS, Status.NEEDS_REVIEW)]
        assert [e.attempt for e in events if e.event is Event.FAIL] == [1, 2]
        counters = await app.engine.store.counters()
        assert counters.get(("failures", f"default:{code}")) == 2
        await assert_every_success_verified(app)


async def test_many_tasks_with_intermittent_faults_never_commit_an_unverified_success(
    settings: Settings, tmp_path: Path
) -> None:
    # Given storage that corrupts its first five writes, and eight tasks
    storage = FaultyStorage(tmp_path / "faulty", fault="corrupt", failing=5)
    app = kiln.App(settings=fault_settings(settings), storage_backend=storage)
    demo.register(app)
    async with app:
        ids = [
            (await app.submit("image.generate", demo_params(f"a dune {n}"), max_attempts=8)).task.id
            for n in range(8)
        ]

        # When two workers run them
        workers = [
            app.worker(concurrency=2, resources={"gpu": 2}, idle_poll_s=(0.01, 0.05))
            for _ in range(2)
        ]
        async with running(*(w.run() for w in workers)):
            for task_id in ids:
                await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=20)

        # Then every task succeeded once with verified outputs, and the faults cost retries
        for task_id in ids:
            events = await assert_one_final_state(app.engine.store, task_id)
            assert len([e for e in events if e.status is Status.SUCCESS]) == 1
        await assert_every_success_verified(app)
        tasks = [await app.get(task_id) for task_id in ids]
        images = [key for key in storage.faulted if key.endswith("/image.png")]
        assert sum(t.attempt - 1 for t in tasks) == len(images)
        assert len(storage.faulted) == 5


async def test_an_unreachable_bucket_fails_the_attempt_and_the_retry_succeeds(
    settings: Settings, s3_server: S3Server
) -> None:
    # Given S3 storage whose first upload finds the server unreachable
    storage = UnreachableS3(S3Storage.from_url(s3_server.url("faults")), failing=1)
    app = kiln.App(settings=fault_settings(settings), storage_backend=storage)
    demo.register(app)
    async with app:
        task = (await app.submit("image.generate", demo_params("a fjord"))).task

        # When a worker runs it
        done = await run_to_final(app, task.id)

        # Then attempt 1 failed on the connection error, retryable, and nothing of it is in
        # the bucket; attempt 2 succeeded with outputs verified in the bucket
        assert done.status is Status.SUCCESS and done.attempt == 2
        assert storage.faulted == [f"tasks/{task.id}/1-1/image.png"]
        events = await assert_one_final_state(app.engine.store, task.id)
        failed = [e for e in events if e.event is Event.FAIL]
        assert len(failed) == 1 and failed[0].attempt == 1 and failed[0].error is not None
        assert failed[0].error["code"] == "storage_error" and failed[0].error["retryable"]
        assert failed[0].error["message"].startswith("S3 put of")
        assert [i.key async for i in storage.list(f"tasks/{task.id}/1-")] == []
        await assert_every_success_verified(app)


async def test_a_bucket_that_stays_unreachable_ends_failed_never_success(
    settings: Settings,
) -> None:
    # Given S3 storage on a port nothing listens on, and a task allowed two attempts
    storage = S3Storage.from_url(f"s3://kiln/x?endpoint_url=http://127.0.0.1:{closed_port()}")
    app = kiln.App(settings=fault_settings(settings), storage_backend=storage)
    demo.register(app)
    async with app:
        task = (await app.submit("image.generate", demo_params("a delta"), max_attempts=2)).task

        # When a worker runs it
        done = await run_to_final(app, task.id)

        # Then both uploads failed within the storage's timeouts: FAILED, never SUCCESS
        assert done.status is Status.FAILED
        assert done.attempt == done.max_attempts == 2
        assert done.error is not None and done.error["code"] == "storage_error"
        assert "S3 put of" in done.error["message"]
        assert done.result is None
        events = await assert_one_final_state(app.engine.store, task.id)
        assert not [e for e in events if e.status in (Status.SUCCESS, Status.NEEDS_REVIEW)]
        assert [e.attempt for e in events if e.event is Event.FAIL] == [1, 2]
