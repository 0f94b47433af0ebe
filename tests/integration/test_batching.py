"""Durable dynamic batching (docs/scheduling.md): a worker claims compatible tasks
together and calls the handler once; each task keeps its own transitions, lease, outputs,
retries and cancel; a worker killed in the middle of a batch loses and repeats nothing."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import kiln
from kiln import BatchPolicy, Output
from kiln.app import running
from kiln.config import Settings
from kiln.errors import Permanent, Retryable
from kiln.states import Event, Status
from kiln.worker import Context

from .cli_workers import CliWorkers
from .conftest import wait_for_status

KIND = "test.batch"


class Recorder:
    """A batching handler: records each call's tasks; what it does per task is asked of
    ``behave`` (a params dict → outputs, or an exception for that task)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.fail_calls = 0

    async def __call__(
        self, ctxs: Sequence[Context], params: Sequence[dict[str, Any]]
    ) -> list[Any]:
        self.calls.append([c.task_id for c in ctxs])
        for ctx in ctxs:
            await ctx.progress(1, 2, stage="denoise")
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_calls:
            self.fail_calls -= 1
            raise Retryable("the GPU fell over", code="gpu_reset")
        results: list[Any] = []
        for ctx, p in zip(ctxs, params, strict=True):
            if p.get("bad"):
                results.append(Permanent("this prompt is refused", code="refused"))
            else:
                results.append(Output("out.txt", f"{p['n']}@{ctx.attempt}".encode(), "text/plain"))
        return results


async def batch_app(settings: Settings, recorder: Recorder, *, wait_ms: float = 300) -> kiln.App:
    app = kiln.App(settings=settings)
    policy = BatchPolicy(max_size=4, max_wait_ms=wait_ms, key=("model",))
    app.task(KIND, batch=policy)(recorder)
    return app


def ledger_shares(settings: Settings) -> dict[str, float]:
    """Each task's share of its call, as the GPU-second ledger holds it."""
    path = settings.resolved_database_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return dict(conn.execute("SELECT task_id, share FROM usage_ledger"))


async def submit(app: kiln.App, model: str, n: int, **extra: Any) -> str:
    return (await app.submit(KIND, {"model": model, "n": n, **extra})).task.id


async def test_compatible_tasks_run_in_one_call_each_with_its_own_lifecycle(
    settings: Settings,
) -> None:
    recorder = Recorder()
    async with await batch_app(settings, recorder) as app:
        # Given five tasks of model a and two of model b
        a = [await submit(app, "a", n) for n in range(5)]
        b = [await submit(app, "b", n) for n in range(2)]
        # When one worker with one place runs them
        async with running(app.worker(concurrency=1, idle_poll_s=(0.01, 0.05)).run()):
            done = [await app.wait(t, timeout_s=30) for t in a + b]
        # Then the handler was called with batches of one key, four at most
        assert all(t.status is Status.SUCCESS and t.attempt == 1 for t in done)
        groups = [set(call) for call in recorder.calls]
        assert sorted(map(len, groups)) == [1, 2, 4]
        assert set(a[:4]) in groups and set(b) in groups
        # And each task has its own events, lease and verified output
        for task in done:
            events = [e.event for e in await app.engine.store.events(task_id=task.id)]
            assert events == [Event.SUBMIT, Event.CLAIM, Event.ACQUIRE, Event.GENERATED,
                              Event.UPLOADED]  # fmt: skip
            [output] = task.result["outputs"]  # type: ignore[index]
            assert await app.storage.get(output["key"]) == f"{task.params['n']}@1".encode()
    # And each member's ledger row counts its share of its call's GPU time
    shares = ledger_shares(settings)
    assert [shares[t] for t in a[:4]] == [0.25] * 4 and [shares[t] for t in b] == [0.5] * 2
    assert shares[a[4]] == 1.0


async def test_a_member_cancelled_and_a_member_failing_leave_the_others_alone(
    settings: Settings,
) -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    async with await batch_app(settings, recorder) as app:
        ids = [await submit(app, "a", 0), await submit(app, "a", 1, bad=True),
               await submit(app, "a", 2), await submit(app, "a", 3)]  # fmt: skip
        async with running(app.worker(concurrency=1, idle_poll_s=(0.01, 0.05)).run()):
            # Given the four in one call, generating
            for task_id in ids:
                await wait_for_status(app.engine.store, task_id, Status.GENERATING, timeout_s=10)
            # When one is cancelled while the call runs, then the call ends
            await app.cancel(ids[2])
            cancelled = await wait_for_status(app.engine.store, ids[2], Status.CANCELLED)
            recorder.gate.set()
            done = [await app.wait(t, timeout_s=30) for t in ids]
    # Then the cancelled one stopped at once, the refused one failed for good, and the
    # others succeeded, all from one call
    assert cancelled.status is Status.CANCELLED
    assert [t.status for t in done] == [Status.SUCCESS, Status.FAILED, Status.CANCELLED,
                                        Status.SUCCESS]  # fmt: skip
    assert done[1].error is not None and done[1].error["code"] == "refused"
    assert done[1].attempt == 1
    assert len(recorder.calls) == 1


async def test_a_failed_call_retries_each_member_on_its_own(settings: Settings) -> None:
    recorder = Recorder()
    recorder.fail_calls = 1
    async with await batch_app(settings, recorder, wait_ms=0) as app:
        ids = [await submit(app, "a", n) for n in range(3)]
        async with running(app.worker(concurrency=1, idle_poll_s=(0.01, 0.05)).run()):
            done = [await app.wait(t, timeout_s=30) for t in ids]
        # The first call failed every member; each was retried and succeeded on attempt 2
        assert [t.status for t in done] == [Status.SUCCESS] * 3
        assert [t.attempt for t in done] == [2, 2, 2]
        assert set(recorder.calls[0]) == set(ids)
        for task in done:
            events = [e.event for e in await app.engine.store.events(task_id=task.id)]
            assert events.count(Event.FAIL) == 1, events


# Real processes ---------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_worker_killed_in_the_middle_of_a_batch_loses_and_repeats_nothing(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: Callable[..., CliWorkers]
) -> None:
    # Given a worker process running image.generate in batches of 4, and a supervisor
    workers = cli_workers(tmp_path, new_database(), KILN_GENERATE_BATCH="4/200",
                          KILN_LEASE_TTL_S="2", KILN_SUPERVISOR_INTERVAL_S="0.2",
                          KILN_RETRY_BASE_S="0.05", KILN_RETRY_MAX_S="0.1")  # fmt: skip
    async with workers.app(generate_batch=(4, 200.0)) as app:
        params = {"width": 64, "height": 64, "steps": 30, "simulate": {"step_ms": 50}}
        ids = [(await app.submit("image.generate", {**params, "prompt": f"a gull {uuid.uuid4()}"})
                ).task.id for _ in range(8)]  # fmt: skip
        victim = workers.start("--concurrency", "1")
        workers.start_supervisor()
        # When it is SIGKILLed while a batch generates
        await wait_for_status(app.engine.store, ids[0], Status.GENERATING, timeout_s=30)
        # (the batch's members reach GENERATING in one claim, but the read may come between
        # their writes: read until the batch shows, within a deadline)
        deadline = asyncio.get_running_loop().time() + 10
        generating: list[str] = []
        while len(generating) < 2 and asyncio.get_running_loop().time() < deadline:
            generating = [t for t in ids if (await app.get(t)).status is Status.GENERATING]
            await asyncio.sleep(0.01)
        workers.kill(victim)
        # And another worker takes over
        workers.start("--concurrency", "1")
        done = [await wait_for_status(app.engine.store, t, Status.SUCCESS, Status.FAILED,
                                      timeout_s=120) for t in ids]  # fmt: skip
        # Then every task succeeded once, those of the killed batch on a second attempt
        assert [t.status for t in done] == [Status.SUCCESS] * 8
        assert len(generating) >= 2
        for task in done:
            events = [e.event for e in await app.engine.store.events(task_id=task.id)]
            assert events.count(Event.UPLOADED) == 1
            assert task.attempt == (2 if task.id in generating else 1), (task.id, events)
            [output] = task.result["outputs"]  # type: ignore[index]
            assert len(await app.storage.get(output["key"])) == output["size"]
    calls = workers.lines("batch_call")
    assert any(call["size"] > 1 for call in calls), calls
