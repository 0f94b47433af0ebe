"""The `comfy.workflow` driver end to end: a kiln worker (in this process) driving the
stand-in ComfyUI as its own process: outputs, assets, progress, previews, each kind of
failure, cancel and timeout (docs/comfy.md, "Workers and ComfyUI instances")."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from backend_support import TASK_TIMEOUT_S, kiln_settings
from PIL import Image
from tests.services.comfyui_nodes import txt2img
from tests.services.comfyui_standin import Process

import kiln
from kiln import inputs
from kiln.app import running
from kiln.backends import comfy_workflow
from kiln.bus import Message, ProgressEvent
from kiln.models import Task, TaskEvent
from kiln.states import Status

pytestmark = pytest.mark.slow
CKPT = "v1-5-pruned-emaonly.safetensors"


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Process]:
    process = Process(tmp_path / "comfy", "--step-s", "0.02", "--load-s", "0.05")
    yield process
    process.stop()


@contextlib.asynccontextmanager
async def kiln_for(
    tmp_path: Path, url: str, **env: str
) -> AsyncIterator[tuple[kiln.App, comfy_workflow.ComfyWorkflow]]:
    app = kiln.App(settings=kiln_settings(tmp_path, {"KILN_COMFYUI_URL": url, **env}))
    handler = comfy_workflow.register(app)
    async with app:
        yield app, handler


async def run_job(
    app: kiln.App,
    params: dict[str, Any],
    *,
    max_attempts: int = 3,
    items: list[dict[str, Any]] | None = None,
    cancel_at_step: int | None = None,
) -> tuple[Task, list[Message]]:
    """Submit one job and run a worker until it is final; the task and what was published
    for it. ``cancel_at_step``: cancel it once it reports that step."""
    seen: list[Message] = []
    async with app.hub.subscribe() as feed:
        job = (
            await app.submit(comfy_workflow.KIND, params, max_attempts=max_attempts, inputs=items)
        ).task
        worker = app.worker(concurrency=1, kinds=[comfy_workflow.KIND], resources={"gpu": 1})
        async with running(worker.run()), asyncio.timeout(TASK_TIMEOUT_S):
            while not (seen and isinstance(seen[-1], TaskEvent) and seen[-1].final):
                message = await feed.queue.get()
                if message.task_id != job.id:
                    continue
                seen.append(message)
                step = isinstance(message, ProgressEvent) and (message.progress or {}).get("step")
                if cancel_at_step is not None and step == cancel_at_step:
                    await app.cancel(job.id)
    return await app.get(job.id), seen


async def standin_log(standin: Process) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        answer: dict[str, Any] = (await http.get(f"{standin.url}/standin/log")).json()
        return answer


async def set_faults(standin: Process, faults: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as http:
        await http.post(f"{standin.url}/standin/faults", json=faults)


async def test_a_workflow_runs_and_every_saved_image_is_an_output(
    standin: Process, tmp_path: Path
) -> None:
    # Given a workflow with a LoRA, saving a batch of two pictures
    graph = txt2img(CKPT, steps=3, batch=2, lora="detail.safetensors", prefix="fox")
    async with kiln_for(tmp_path, standin.url) as (app, handler):
        # When it runs as a comfy.workflow job
        task, seen = await run_job(app, {"workflow": graph})
        stored = [await app.storage.get(o["key"]) for o in task.result["outputs"]]
        held = handler.loaded_models()
    # Then both saved images are its outputs, named by node and file, byte for byte
    assert task.status is Status.SUCCESS, task.error
    outputs = task.result["outputs"]
    assert [o["name"] for o in outputs] == ["9-fox_00001_.png", "9-fox_00002_.png"]
    for output, data in zip(outputs, stored, strict=True):
        on_disk = (standin.root / "output" / output["name"].split("-", 1)[1]).read_bytes()
        assert data == on_disk
        assert output["sha256"] == hashlib.sha256(data).hexdigest()
        assert output["content_type"] == "image/png" and output["size"] == len(data)
    # And the task's model is the checkpoint, which the worker now says it holds
    assert task.model == CKPT and held == [CKPT]
    # And progress named each node as it ran, the sampler's steps with previews
    stages = [m.stage for m in seen if isinstance(m, ProgressEvent)]
    assert stages[0] == "queued" and stages[-1] == "download"
    assert "node:4:CheckpointLoaderSimple" in stages and "node:9:SaveImage" in stages
    steps = [
        (m.progress["step"], m.progress["total"])
        for m in seen
        if isinstance(m, ProgressEvent) and m.stage == "node:3:KSampler" and m.progress
    ]
    assert steps == [(1, 3), (2, 3), (3, 3)]
    previews = [m.preview for m in seen if isinstance(m, ProgressEvent) and m.preview]
    assert previews and all(p.startswith("data:image/jpeg;base64,") for p in previews)


async def test_an_asset_is_uploaded_to_the_instance_and_the_graph_points_at_it(
    standin: Process, tmp_path: Path
) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 10)).save(buffer, format="PNG")
    placeholder = "kiln-asset://a1/green.png"
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": placeholder}},
        "2": {
            "class_type": "ImageScale",
            "inputs": {
                "image": ["1", 0],
                "upscale_method": "nearest-exact",
                "width": 20,
                "height": 15,
                "crop": "disabled",
            },
        },
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "up"}},
    }
    async with kiln_for(tmp_path, standin.url) as (app, _):
        item = await inputs.store(app.storage, "a1-green.png", buffer.getvalue(), max_pixels=10**6)
        params = {"workflow": graph, "assets": {placeholder: "a1-green.png"}}
        task, _ = await run_job(app, params, items=[item])
        [output] = task.result["outputs"]
        data = await app.storage.get(output["key"])
    assert task.status is Status.SUCCESS, task.error
    uploaded = standin.root / "input" / f"kiln-{item['sha256']}.png"
    assert uploaded.read_bytes() == buffer.getvalue()
    picture = Image.open(io.BytesIO(data))
    assert picture.size == (20, 15) and picture.getpixel((3, 3)) == (10, 200, 10)


async def test_a_failing_node_fails_the_job_for_good_with_the_node_in_the_details(
    standin: Process, tmp_path: Path
) -> None:
    await set_faults(
        standin,
        {
            "raise": {
                "class_type": "VAEDecode",
                "exception_type": "RuntimeError",
                "exception_message": "bad latent",
            }
        },
    )
    async with kiln_for(tmp_path, standin.url) as (app, _):
        task, _ = await run_job(app, {"workflow": txt2img(CKPT)})
    assert task.status is Status.FAILED and task.attempt == 1
    assert task.error is not None
    assert (task.error["code"], task.error["retryable"]) == ("node_execution_error", False)
    assert task.error["details"] == [
        {
            "node_id": "8",
            "node_type": "VAEDecode",
            "exception_type": "RuntimeError",
            "exception_message": "bad latent",
        }
    ]
    assert (await standin_log(standin))["deleted"] == []  # ended there: nothing to clean up


async def test_out_of_gpu_memory_is_retried(standin: Process, tmp_path: Path) -> None:
    await set_faults(
        standin,
        {
            "raise": {
                "class_type": "KSampler",
                "times": 1,
                "exception_type": "torch.OutOfMemoryError",
                "exception_message": "CUDA out of memory",
            }
        },
    )
    async with kiln_for(tmp_path, standin.url) as (app, _):
        task, seen = await run_job(app, {"workflow": txt2img(CKPT)})
    assert task.status is Status.SUCCESS and task.attempt == 2
    failures = [m.error for m in seen if isinstance(m, TaskEvent) and m.error]
    assert failures[0]["code"] == "comfyui_out_of_memory" and failures[0]["retryable"]


async def test_a_workflow_comfyui_refuses_fails_with_its_node_errors(
    standin: Process, tmp_path: Path
) -> None:
    async with kiln_for(tmp_path, standin.url) as (app, _):
        task, _ = await run_job(app, {"workflow": txt2img("missing.safetensors")})
    assert task.status is Status.FAILED and task.attempt == 1
    assert task.error is not None and task.error["code"] == "invalid_prompt"
    [details] = task.error["details"]
    assert details["error"]["type"] == "prompt_outputs_failed_validation"
    assert details["node_errors"]["4"]["errors"][0]["type"] == "value_not_in_list"
    # the node refused is named, as a node's failure is
    assert (details["node_id"], details["node_type"]) == ("4", "CheckpointLoaderSimple")
    assert "node 4 (CheckpointLoaderSimple): Value not in list" in task.error["message"]
    assert "'missing.safetensors' not in" in task.error["message"]


async def test_an_instance_that_cannot_be_reached_is_retryable_and_stops_claims(
    tmp_path: Path,
) -> None:
    async with kiln_for(tmp_path, "http://127.0.0.1:9") as (app, handler):
        task, _ = await run_job(app, {"workflow": txt2img(CKPT)}, max_attempts=1)
        # Then the instance's breaker opened: this worker claims no job while it is
        name = handler.backend.name
        closed = app.breakers.closed(comfy_workflow.KIND)
    assert task.status is Status.FAILED and task.error is not None
    assert (task.error["code"], task.error["retryable"]) == ("comfyui_unavailable", True)
    assert name == f"comfyui@{socket.gethostname()}:9"
    assert handler.breaker.state == "open" and not closed


async def test_an_instance_that_dies_mid_run_is_retryable(standin: Process, tmp_path: Path) -> None:
    await set_faults(standin, {"exit_at_step": 2})
    async with kiln_for(tmp_path, standin.url) as (app, _):
        task, _ = await run_job(app, {"workflow": txt2img(CKPT, steps=5)}, max_attempts=1)
    assert not standin.alive()
    assert task.status is Status.FAILED and task.error is not None
    assert (task.error["code"], task.error["retryable"]) == ("comfyui_unavailable", True)


async def test_a_cancel_interrupts_the_running_prompt_and_takes_it_off_the_queue(
    standin: Process, tmp_path: Path
) -> None:
    async with kiln_for(tmp_path, standin.url) as (app, _):
        task, _ = await run_job(app, {"workflow": txt2img(CKPT, steps=400)}, cancel_at_step=2)
    assert task.status is Status.CANCELLED
    log = await standin_log(standin)
    [prompt_id] = log["deleted"]
    assert log["interrupts"] == [{"prompt_id": prompt_id, "running": prompt_id}]
    async with httpx.AsyncClient() as http:
        for _ in range(100):  # the instance stops it at its next step
            history = (await http.get(f"{standin.url}/history/{prompt_id}")).json()
            if history:
                break
            await asyncio.sleep(0.05)
        queue = (await http.get(f"{standin.url}/queue")).json()
    assert history[prompt_id]["status"]["status_str"] == "error"
    assert queue == {"queue_running": [], "queue_pending": []}


async def test_a_job_past_its_timeout_is_interrupted(standin: Process, tmp_path: Path) -> None:
    async with kiln_for(tmp_path, standin.url, KILN_COMFYUI_TIMEOUT_S="2") as (app, _):
        task, _ = await run_job(app, {"workflow": txt2img(CKPT, steps=1000)}, max_attempts=1)
    assert task.error is not None and task.error["code"] == "comfyui_timeout"
    log = await standin_log(standin)
    assert len(log["deleted"]) == 1 and log["interrupts"][0]["prompt_id"] == log["deleted"][0]


async def test_a_prompt_cleared_from_the_queue_is_lost_and_retryable(
    standin: Process, tmp_path: Path
) -> None:
    async with httpx.AsyncClient(base_url=standin.url) as http:
        # Given the instance busy with a long prompt of someone else's
        busy = await http.post("/prompt", json={"prompt": txt2img(CKPT, steps=2000, seed=1)})
        other = busy.json()["prompt_id"]
        async with kiln_for(tmp_path, standin.url) as (app, _):
            job = asyncio.ensure_future(run_job(app, {"workflow": txt2img(CKPT)}, max_attempts=1))

            async def queued() -> bool:
                return bool((await http.get("/queue")).json()["queue_pending"])

            while not await queued():
                assert not job.done(), job.result()
                await asyncio.sleep(0.05)
            # When someone clears the queue, our prompt with it
            await http.post("/queue", json={"clear": True})
            task, _ = await job
        await http.post("/interrupt", json={"prompt_id": other})
    # Then the attempt failed as a lost prompt, retryable
    assert task.status is Status.FAILED and task.error is not None
    assert (task.error["code"], task.error["retryable"]) == ("comfyui_prompt_lost", True)


def test_the_model_of_a_job_is_its_checkpoint_before_any_lora() -> None:
    graph = txt2img(CKPT, lora="detail.safetensors")
    lora_first = {"10": graph.pop("10"), **graph}
    assert comfy_workflow.model_of({"workflow": lora_first}) == CKPT
    unet = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "flux1-dev.safetensors"}}}
    assert comfy_workflow.model_of({"workflow": unet}) == "flux1-dev.safetensors"
    vae = {"1": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}}}
    assert comfy_workflow.model_of({"workflow": vae}) == "ae.safetensors"
    assert comfy_workflow.model_of({"workflow": {}}) is None


async def test_a_job_stopped_while_comfyui_answers_its_prompt_takes_the_prompt_back(
    standin: Process, tmp_path: Path
) -> None:
    # Given an instance that runs a prompt at once but answers POST /prompt late
    await set_faults(standin, {"prompt_answer_s": 30})
    async with kiln_for(tmp_path, standin.url) as (app, _), httpx.AsyncClient() as http:
        job = (await app.submit(comfy_workflow.KIND, {"workflow": txt2img(CKPT, steps=400)})).task
        worker = app.worker(concurrency=1, kinds=[comfy_workflow.KIND], resources={"gpu": 1})
        async with running(worker.run()), asyncio.timeout(TASK_TIMEOUT_S):
            # When the job is cancelled while its prompt runs and the answer is not back
            running_now: list[Any] = []
            while not running_now:
                running_now = (await http.get(f"{standin.url}/queue")).json()["queue_running"]
                await asyncio.sleep(0.02)
            prompt_id = running_now[0][1]
            await app.cancel(job.id)
            done = await app.wait(job.id, timeout_s=TASK_TIMEOUT_S)
            # Then the instance is told to stop that prompt, which ends without its pictures
            history: dict[str, Any] = {}
            while not history:
                history = (await http.get(f"{standin.url}/history/{prompt_id}")).json()
                await asyncio.sleep(0.02)
    assert done.status is Status.CANCELLED
    log = await standin_log(standin)
    assert {"prompt_id": prompt_id, "running": prompt_id} in log["interrupts"]
    assert history[prompt_id]["status"]["status_str"] == "error"
