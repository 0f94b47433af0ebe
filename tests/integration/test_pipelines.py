"""Pipelines with real `kiln worker` and `kiln supervisor` processes, on SQLite and
PostgreSQL (docs/pipelines.md): a generate -> upscale -> thumbnail pipeline through a
SIGKILL of a worker inside a step and another between steps, each step done exactly once
with its outputs passed by reference; a fan-out of ten into a contact sheet; and a cancel
then a retry that reruns only the step that did not succeed."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import kiln
from kiln import transform
from kiln.models import Task
from kiln.states import Event, Status

from .cli_workers import CliWorkers
from .conftest import task_events, wait_for_status, wait_for_task

pytestmark = pytest.mark.slow

MakeWorkers = Callable[..., CliWorkers]
SMALL = {"width": 64, "height": 64}


def three_steps() -> dict[str, Any]:
    return {"steps": [
        {"name": "generate", "kind": "image.generate",
         "params": {"prompt": "a lighthouse at dusk", "seed": 3, "steps": 12,
                    "simulate": {"step_ms": 80}, **SMALL}},
        {"name": "upscale", "kind": "image.transform",
         "params": {"op": "resize", "width": 128, "height": 128},
         "inputs": {"image": "step:generate/image.png"}},
        {"name": "thumbnail", "kind": "image.transform",
         "params": {"op": "thumbnail", "width": 32, "height": 32},
         "inputs": {"image": "step:upscale/image.png"}},
    ]}  # fmt: skip


def app_of(workers: CliWorkers) -> kiln.App:
    app = workers.app()
    transform.register(app)
    return app


async def step(app: kiln.App, pipeline_id: str, key: str) -> Task | None:
    return (await app.pipeline_steps(await app.get(pipeline_id))).get(key)


async def test_a_pipeline_survives_sigkills_inside_and_between_steps(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: MakeWorkers
) -> None:
    workers = cli_workers(tmp_path, new_database(), KILN_LEASE_TTL_S="1",
                          KILN_SUPERVISOR_INTERVAL_S="0.2")  # fmt: skip
    async with app_of(workers) as app:
        pipeline = (await app.submit("pipeline", three_steps())).task
        workers.start_supervisor()
        # When the worker running the first step is killed inside it (generating)
        inside = workers.start("--concurrency", "1")
        generate = await step(app, pipeline.id, "generate/0")
        assert generate is not None
        await wait_for_task(app.engine.store, generate.id,
                            lambda t: (t.progress_step or 0) >= 2 and t.status is Status.GENERATING,
                            timeout_s=30, what="the first step generating")  # fmt: skip
        workers.kill(inside)
        # And a worker that serves only that step's kind is killed right after it succeeds
        between = workers.start("--concurrency", "1", "--kinds", "image.generate")
        await wait_for_status(app.engine.store, generate.id, Status.SUCCESS, timeout_s=30)
        workers.kill(between)
        # Then the next step already exists, made with the step's SUCCESS
        upscale = await step(app, pipeline.id, "upscale/0")
        assert upscale is not None and upscale.status is Status.PENDING
        # When a worker takes over
        workers.start("--concurrency", "1")
        done = await wait_for_status(app.engine.store, pipeline.id, Status.SUCCESS, timeout_s=60)
        steps = await app.pipeline_steps(done)
        # Then every step succeeded exactly once (one uploaded event each)
        for task in steps.values():
            events = await task_events(app.engine.store, task.id)
            uploads = [e for e in events if e.event is Event.UPLOADED]
            assert (task.status, len(uploads)) == (Status.SUCCESS, 1), task.id
        assert steps["generate/0"].attempt == 2  # the attempt killed inside it, then one
        # And each step read the previous step's stored object by its key (no copy)
        for earlier, later in (("generate/0", "upscale/0"), ("upscale/0", "thumbnail/0")):
            output = steps[earlier].result["outputs"][0] if steps[earlier].result else {}
            assert [i["key"] for i in steps[later].inputs] == [output["key"]]
        last = steps["thumbnail/0"].result["outputs"][0] if steps["thumbnail/0"].result else {}
        picture = Image.open(io.BytesIO(await app.storage.get(last["key"])))
        assert picture.size == (32, 32)


async def test_fan_out_of_ten_then_a_contact_sheet(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: MakeWorkers
) -> None:
    workers = cli_workers(tmp_path, new_database())
    params = {"steps": [
        {"name": "generate", "kind": "image.generate", "repeat": 10,
         "params": {"prompt": "a red fox", "seed": 100, "steps": 2,
                    "simulate": {"step_ms": 0}, **SMALL}},
        {"name": "sheet", "kind": "image.contact_sheet", "params": {"columns": 5, "tile": 32},
         "inputs": {"images": "step:generate/*"}},
    ]}  # fmt: skip
    async with app_of(workers) as app:
        pipeline = (await app.submit("pipeline", params)).task
        workers.start("--concurrency", "4")
        done = await wait_for_status(app.engine.store, pipeline.id, Status.SUCCESS, timeout_s=60)
        steps = await app.pipeline_steps(done)
        copies = [steps[f"generate/{i}"] for i in range(10)]
        # Then ten copies ran, each with its own seed, and the sheet read all ten by key
        assert [t.params["seed"] for t in copies] == list(range(100, 110))
        keys = [t.result["outputs"][0]["key"] for t in copies if t.result]
        assert [i["key"] for i in steps["sheet/0"].inputs] == keys
        assert len(set(keys)) == 10
        sheet = steps["sheet/0"].result["outputs"][0] if steps["sheet/0"].result else {}
        picture = Image.open(io.BytesIO(await app.storage.get(sheet["key"])))
        assert picture.size == (5 * 32, 2 * 32)


async def test_cancel_then_retry_reruns_only_the_steps_that_did_not_succeed(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: MakeWorkers
) -> None:
    workers = cli_workers(tmp_path, new_database(), KILN_LEASE_TTL_S="1")
    params = {"steps": [
        {"name": "quick", "kind": "image.generate",
         "params": {"prompt": "a quick fox", "steps": 2, "simulate": {"step_ms": 0}, **SMALL}},
        {"name": "slow", "kind": "image.generate",
         "params": {"prompt": "a slow fox", "steps": 20, "simulate": {"step_ms": 100}, **SMALL}},
    ]}  # fmt: skip
    async with app_of(workers) as app:
        pipeline = (await app.submit("pipeline", params)).task
        workers.start("--concurrency", "2")
        # Given one step done and the other generating in a `kiln worker` process
        quick = await step(app, pipeline.id, "quick/0")
        slow = await step(app, pipeline.id, "slow/0")
        assert quick is not None and slow is not None
        await wait_for_status(app.engine.store, quick.id, Status.SUCCESS, timeout_s=30)
        await wait_for_status(app.engine.store, slow.id, Status.GENERATING, timeout_s=30)
        # When the pipeline is cancelled
        cancelled = await app.cancel(pipeline.id)
        # Then it is CANCELLED at once, and the worker stops the running step
        assert cancelled.status is Status.CANCELLED
        stopped = await wait_for_status(app.engine.store, slow.id, Status.CANCELLED, timeout_s=30)
        assert stopped.result is None
        # When it is retried
        assert (await app.retry(pipeline.id)).status is Status.GENERATING
        done = await wait_for_status(app.engine.store, pipeline.id, Status.SUCCESS, timeout_s=60)
        steps = await app.pipeline_steps(done)
        # Then only the step that had not succeeded ran again; each succeeded once
        assert steps["quick/0"].attempt == 1 and steps["slow/0"].attempt == 2
        for task in steps.values():
            events = await task_events(app.engine.store, task.id)
            assert [e.event for e in events].count(Event.UPLOADED) == 1, task.id
        log = [e.event for e in await task_events(app.engine.store, pipeline.id)]
        assert log == [Event.SUBMIT, Event.RUN_STEPS, Event.STEPS_CANCELLED, Event.RETRY,
                       Event.RUN_STEPS, Event.STEPS_DONE]  # fmt: skip
