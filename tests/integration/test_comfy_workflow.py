"""`comfy.workflow` jobs with real processes: two stand-in ComfyUI instances
(tests/services/comfyui_standin.py), two `kiln worker --kinds comfy.workflow` processes
each driving its own instance, a `kiln supervisor`, and jobs submitted through an App on
the same database and storage: a workflow's outputs land verified in storage, a failing
node fails its job with the node, a cancel interrupts the instance, a killed worker's
job and a dead instance's job succeed on the other pair, and jobs of two checkpoints go
mostly to the instance that holds theirs (docs/comfy.md, "Workers and ComfyUI
instances")."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.services.comfyui_nodes import txt2img
from tests.services.comfyui_standin import Process
from tests.services.seaweed import CREDENTIALS

import kiln
from kiln.backends import comfy_workflow
from kiln.models import Task
from kiln.states import Event, Status

from .cli_workers import CliWorkers
from .conftest import task_events, wait_for_status, wait_until

pytestmark = pytest.mark.slow
KIND = comfy_workflow.KIND
CKPTS = ["v1-5-pruned-emaonly.safetensors", "sd_xl_base_1.0.safetensors"]
MakeWorkers = Callable[..., CliWorkers]


class Pairs:
    """Two ComfyUI stand-ins, each with its own `kiln worker`, and a supervisor."""

    def __init__(self, root: Path, workers: CliWorkers) -> None:
        self.workers = workers
        self.instances = [
            Process(root / f"comfy-{n}", "--step-s", "0.05", "--load-s", "0.3") for n in range(2)
        ]
        self.procs: list[subprocess.Popen[bytes]] = []
        for instance in self.instances:
            workers.env["KILN_COMFYUI_URL"] = instance.url
            self.procs.append(workers.start("--kinds", KIND))  # one job at a time: the default
        workers.start_supervisor()

    def app(self) -> kiln.App:
        """An App on the same database and storage that knows the kind, to submit with."""
        app = self.workers.app()
        comfy_workflow.register(app, url="http://127.0.0.1:9")  # it never runs a job
        return app

    def index_of(self, task: Task) -> int:
        """Which pair (0 or 1) holds the task's lease: its worker id names the pid."""
        pid = int(str(task.lease_owner).split(":")[1])
        return [proc.pid for proc in self.procs].index(pid)

    def events(self, index: int, event: str) -> list[str]:
        """The task ids of pair ``index``'s worker's ``event`` log lines, in order."""
        log = self.workers.procs[index][1]
        lines = [
            json.loads(line)
            for line in log.read_text(errors="replace").splitlines()
            if line.startswith("{") and f'"{event}"' in line
        ]
        return [str(line["task_id"]) for line in lines if line.get("event") == event]

    async def ran(self, task_id: str) -> int:
        """The pair whose worker stored the job's outputs (its ``uploaded`` log line,
        written within a tenth of a second)."""
        found: list[int] = []

        async def logged() -> bool:
            found[:] = [n for n in (0, 1) if task_id in self.events(n, "uploaded")]
            return bool(found)

        await wait_until(logged, timeout_s=10, what=f"the uploaded line of {task_id}")
        [index] = found
        return index

    def stop(self) -> None:
        for instance in self.instances:
            instance.stop()


@pytest.fixture
def pairs(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    new_database: Callable[[], str],
    cli_workers: MakeWorkers,
) -> Iterator[Pairs]:
    """The pairs on the test's database, and on S3 storage when its ``s3`` param says so."""
    workers = cli_workers(
        tmp_path / "kiln",
        new_database(),
        KILN_RETRY_BASE_S="0.05",
        KILN_RETRY_MAX_S="0.2",
        KILN_SUPERVISOR_INTERVAL_S="0.5",
        KILN_BREAKER_OPEN_S="120",
    )
    if request.node.callspec.params.get("s3"):
        workers.storage_url = request.getfixturevalue("s3_server").url("comfy")
        workers.env.update({**CREDENTIALS, "KILN_STORAGE_URL": workers.storage_url})
    made = Pairs(tmp_path, workers)
    yield made
    workers.stop()
    made.stop()


def get(url: str) -> Any:
    return httpx.get(url, timeout=10).json()


async def running_on(pairs: Pairs, app: kiln.App, task_id: str) -> tuple[int, str]:
    """Wait until the job's prompt runs on its instance: (pair index, prompt id)."""
    found: list[tuple[int, str]] = []

    async def runs() -> bool:
        task = await app.get(task_id)
        if task.status is not Status.GENERATING or task.lease_owner is None:
            return False
        index = pairs.index_of(task)
        rows = get(f"{pairs.instances[index].url}/queue")["queue_running"]
        found[:] = [(index, rows[0][1])] if rows else []
        return bool(found)

    await wait_until(runs, timeout_s=60, interval_s=0.1, what="the prompt running")
    return found[0]


@pytest.mark.parametrize(
    ("new_database", "s3"), [("sqlite", False), ("postgres", True)], indirect=["new_database"]
)
async def test_a_workflow_runs_a_failing_node_fails_and_a_cancel_interrupts(
    pairs: Pairs, s3: bool
) -> None:
    async with pairs.app() as app:
        assert app.storage.url.startswith("s3://" if s3 else "file://")
        await a_workflow_runs(pairs, app)
        await a_failing_node_fails(pairs, app)
        await a_cancel_interrupts(pairs, app)


async def a_workflow_runs(pairs: Pairs, app: kiln.App) -> None:
    # When a workflow runs
    done = (await app.submit(KIND, {"workflow": txt2img(CKPTS[0], steps=3)})).task
    task = await wait_for_status(app.engine.store, done.id, Status.SUCCESS, timeout_s=60)
    # Then its saved image is in storage as the instance wrote it, sha256 verified
    [output] = task.result["outputs"]
    data = await app.storage.get(output["key"])
    assert output["name"] == "9-kiln_00001_.png"
    assert hashlib.sha256(data).hexdigest() == output["sha256"]
    saved = pairs.instances[await pairs.ran(task.id)].root / "output" / "kiln_00001_.png"
    assert saved.read_bytes() == data


async def a_failing_node_fails(pairs: Pairs, app: kiln.App) -> None:
    # When a workflow's ImageScale node raises, on either instance
    fault = {
        "class_type": "ImageScale",
        "exception_type": "ValueError",
        "exception_message": "width must be positive",
    }
    for instance in pairs.instances:
        httpx.post(f"{instance.url}/standin/faults", json={"raise": fault})
    graph = txt2img(CKPTS[0], seed=11)
    graph["10"] = {
        "class_type": "ImageScale",
        "inputs": {
            "image": ["8", 0],
            "upscale_method": "bilinear",
            "width": 32,
            "height": 32,
            "crop": "disabled",
        },
    }
    graph["9"]["inputs"]["images"] = ["10", 0]
    bad = (await app.submit(KIND, {"workflow": graph})).task
    failed = await wait_for_status(app.engine.store, bad.id, Status.FAILED, timeout_s=60)
    # Then it failed for good with the node's id, type and message
    assert failed.attempt == 1 and failed.error is not None
    assert failed.error["code"] == "node_execution_error"
    assert failed.error["details"][0] == {
        "node_id": "10",
        "node_type": "ImageScale",
        **{k: fault[k] for k in ("exception_type", "exception_message")},
    }


async def a_cancel_interrupts(pairs: Pairs, app: kiln.App) -> None:
    # When a long job is cancelled while its prompt runs
    long = (await app.submit(KIND, {"workflow": txt2img(CKPTS[0], steps=2000)})).task
    index, prompt_id = await running_on(pairs, app, long.id)
    await app.cancel(long.id)
    await wait_for_status(app.engine.store, long.id, Status.CANCELLED, timeout_s=60)
    # Then its instance was told to interrupt it and take it off the queue: it is gone
    url = pairs.instances[index].url
    await wait_until(lambda: _true(get(f"{url}/history/{prompt_id}")), timeout_s=30)
    log = get(f"{url}/standin/log")
    assert {"prompt_id": prompt_id, "running": prompt_id} in log["interrupts"]
    assert prompt_id in log["deleted"]
    assert get(f"{url}/history/{prompt_id}")[prompt_id]["status"]["status_str"] == "error"
    assert get(f"{url}/queue") == {"queue_running": [], "queue_pending": []}


async def _true(value: Any) -> bool:
    return bool(value)


@pytest.mark.parametrize("new_database", ["sqlite"], indirect=True)
async def test_the_job_of_a_killed_worker_succeeds_on_the_other(pairs: Pairs) -> None:
    async with pairs.app() as app:
        job = (await app.submit(KIND, {"workflow": txt2img(CKPTS[0], steps=60)})).task
        index, _ = await running_on(pairs, app, job.id)
        # When the worker running it is killed
        pairs.workers.kill(pairs.procs[index])
        done = await wait_for_status(app.engine.store, job.id, Status.SUCCESS, timeout_s=90)
        events = await task_events(app.engine.store, job.id)
    # Then its lease lapsed and the other worker ran it again, to the end
    assert await pairs.ran(done.id) == 1 - index and done.attempt == 2
    assert [e.event for e in events].count(Event.EXPIRE) == 1


@pytest.mark.parametrize("new_database", ["sqlite"], indirect=True)
async def test_the_job_of_a_dead_instance_is_retried_on_the_other(pairs: Pairs) -> None:
    async with pairs.app() as app:
        job = (await app.submit(KIND, {"workflow": txt2img(CKPTS[0], steps=60)})).task
        index, _ = await running_on(pairs, app, job.id)
        # When the ComfyUI running it dies
        pairs.instances[index].kill()
        done = await wait_for_status(app.engine.store, job.id, Status.SUCCESS, timeout_s=90)
        events = await task_events(app.engine.store, job.id)
        # Then its attempt failed as unavailable, and the other pair ran it again
        failures = [e.error for e in events if e.event is Event.FAIL and e.error]
        assert [f["code"] for f in failures] == ["comfyui_unavailable"]
        assert await pairs.ran(done.id) == 1 - index and done.attempt == 2
        # And the worker of the dead instance claims no more jobs: the next ones all
        # run on the other pair, at their first attempt
        more = [
            (await app.submit(KIND, {"workflow": txt2img(CKPTS[0], seed=n)})).task.id
            for n in range(6)
        ]
        for task_id in more:
            task = await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=60)
            assert task.attempt == 1 and await pairs.ran(task_id) == 1 - index
    assert pairs.events(index, "claim") == [job.id]


@pytest.mark.parametrize("new_database", ["sqlite"], indirect=True)
async def test_jobs_of_two_checkpoints_go_mostly_to_the_instance_that_holds_theirs(
    pairs: Pairs,
) -> None:
    rng = random.Random(5)
    async with pairs.app() as app:
        # When 20 jobs of two checkpoints come in a random order
        ids = []
        for n in range(20):
            graph = txt2img(rng.choice(CKPTS), seed=n, steps=2)
            ids.append((await app.submit(KIND, {"workflow": graph})).task.id)
        done = [
            await wait_for_status(app.engine.store, i, Status.SUCCESS, timeout_s=120) for i in ids
        ]
        live = await app.engine.workers()
        held = {model for worker in live for model in worker.models}
        for task_id in ids:  # each job's uploaded line is in its worker's log
            await pairs.ran(task_id)
    # Then each worker ran mostly jobs of the checkpoint its instance held already
    assert all(t.attempt == 1 for t in done)
    model = {t.id: t.model for t in done}
    warm = cold = 0
    for index in (0, 1):
        models = [model[task_id] for task_id in pairs.events(index, "uploaded")]
        for before, now in zip([None, *models], models, strict=False):
            warm, cold = (warm + 1, cold) if before == now else (warm, cold + 1)
    loads = sum(get(f"{i.url}/standin/log")["loads"] for i in pairs.instances)
    print(f"20 jobs of 2 checkpoints on 2 instances: {warm} warm, {cold} cold, {loads} loads")
    assert cold == loads and warm >= 14, (warm, cold)
    assert held <= set(CKPTS) and held
    # And each worker took one job at a time, as its instance runs one prompt at a time
    assert sorted((w.kinds, w.slots) for w in live) == [((KIND,), 1), ((KIND,), 1)]
