"""The comfyui backend end to end: a kiln worker against a fake ComfyUI prompt server."""

from __future__ import annotations

import hashlib
import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from backend_support import kiln_on, kiln_settings, run_task
from PIL import Image
from upstream_fakes import WORKFLOW, FakeComfyUI

from kiln.bus import ProgressEvent
from kiln.errors import InvalidRequest
from kiln.states import Event, Status

PARAMS: dict[str, Any] = {"prompt": "a red fox in snow", "width": 512, "height": 384,
                          "steps": 8, "seed": 1234}  # fmt: skip


def comfyui_env(url: str, workflow: Path, **extra: str) -> dict[str, str]:
    return {
        "KILN_BACKEND": "comfyui",
        "KILN_COMFYUI_URL": url,
        "KILN_COMFYUI_WORKFLOW": str(workflow),
        **extra,
    }


async def test_a_workflow_runs_with_the_task_params_and_its_image_is_stored(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    fake, url = comfyui_fake
    # Given kiln configured with KILN_BACKEND=comfyui and a workflow with placeholders
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        # When a task runs
        task, seen = await run_task(app, PARAMS)
        stored = await app.storage.get(task.result["outputs"][0]["key"])

    # Then the prompt was queued with the placeholders filled in, typed as ComfyUI wants
    assert task.status is Status.SUCCESS, task.error
    [queued] = fake.prompts
    graph = queued["prompt"]
    assert graph["6"]["inputs"]["text"] == "a red fox in snow, highly detailed"
    assert graph["7"]["inputs"]["text"] == ""
    assert (graph["3"]["inputs"]["seed"], graph["3"]["inputs"]["steps"]) == (1234, 8)
    assert (graph["5"]["inputs"]["width"], graph["5"]["inputs"]["height"]) == (512, 384)
    assert graph["3"]["inputs"]["latent_image"] == ["5", 0]  # links untouched
    # And under the client id of the socket the progress came on
    assert fake.clients == [queued["client_id"]]
    # And the stored output is the SaveImage image (not the temp preview), byte for byte
    assert hashlib.sha256(stored).hexdigest() == task.result["outputs"][0]["sha256"]
    assert stored == next(iter(fake.images.values()))
    # And progress went queued, steps 1..8 of 8, download
    progress = [(m.stage, m.progress) for m in seen if isinstance(m, ProgressEvent)]
    assert progress[0] == ("queued", None)
    steps = [(p["step"], p["total"]) for stage, p in progress if stage == "generate" and p]
    assert steps == [(n, 8) for n in range(1, 9)]
    assert progress[-1] == ("download", None)


async def test_previews_reach_the_progress_events(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    fake, url = comfyui_fake
    fake.script = ["preview"]
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        task, seen = await run_task(app, PARAMS)
    assert task.status is Status.SUCCESS, task.error
    previews = [m.preview for m in seen if isinstance(m, ProgressEvent) and m.preview]
    assert 1 <= len(previews) <= 6
    assert all(p.startswith("data:image/jpeg;base64,") for p in previews)


async def test_the_image_is_converted_to_the_format_asked(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    _, url = comfyui_fake
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        task, _ = await run_task(app, {**PARAMS, "format": "jpeg"})
        stored = await app.storage.get(task.result["outputs"][0]["key"])
    assert task.result["outputs"][0]["name"] == "image.jpg"
    with Image.open(io.BytesIO(stored)) as image:
        assert (image.format, image.size) == ("JPEG", (512, 384))


async def test_a_server_error_on_queueing_is_retried(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    fake, url = comfyui_fake
    fake.script = ["500"]
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        task, _ = await run_task(app, PARAMS, max_attempts=2)
        events = await app.engine.store.events(task_id=task.id, after=0, limit=100)
    assert (task.status, task.attempt, fake.calls) == (Status.SUCCESS, 2, 2)
    [failure] = [e for e in events if e.event is Event.FAIL]
    assert failure.error is not None and failure.error["code"] == "upstream_unavailable"


async def test_an_invalid_workflow_fails_for_good_with_comfyuis_node_errors(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    fake, url = comfyui_fake
    fake.script = ["400"]
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        task, _ = await run_task(app, PARAMS, max_attempts=3)
    assert (task.status, task.attempt) == (Status.FAILED, 1)
    assert task.error is not None
    assert (task.error["code"], task.error["retryable"]) == ("upstream_rejected", False)
    assert "Prompt outputs failed validation" in task.error["message"]
    assert "node 4 (CheckpointLoaderSimple): Value not in list" in task.error["message"]


@pytest.mark.parametrize(
    ("behaviour", "code", "retryable", "words"),
    [
        ("error", "upstream_rejected", False, "RuntimeError: mat1 and mat2 shapes"),
        ("oom", "upstream_unavailable", True, "torch.OutOfMemoryError"),
        ("no_image", "upstream_rejected", False, "produced no image"),
    ],
)
async def test_a_failed_execution_is_classified(
    comfyui_fake: tuple[FakeComfyUI, str],
    workflow_path: Path,
    tmp_path: Path,
    behaviour: str,
    code: str,
    retryable: bool,
    words: str,
) -> None:
    fake, url = comfyui_fake
    fake.script = [behaviour]
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        task, _ = await run_task(app, PARAMS, max_attempts=1)
    assert task.status is Status.FAILED
    assert task.error is not None
    assert (task.error["code"], task.error["retryable"]) == (code, retryable)
    assert words in task.error["message"]
    assert fake.deleted == []  # ComfyUI was done with it: nothing to clean up


async def test_a_prompt_that_runs_too_long_is_interrupted_and_taken_off_the_queue(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    fake, url = comfyui_fake
    # Given a prompt that never finishes, and a 3 s timeout (time enough to queue it)
    fake.script = ["hang"]
    env = comfyui_env(url, workflow_path, KILN_COMFYUI_TIMEOUT_S="3")
    async with kiln_on(kiln_settings(tmp_path, env)) as (app, _):
        # When the task runs
        task, _ = await run_task(app, PARAMS, max_attempts=1)

    # Then it failed as unavailable, after deleting the prompt and interrupting it
    assert task.error is not None
    assert task.error["code"] == "upstream_unavailable"
    assert task.error["message"] == "comfyui gave no answer within 3 s"
    assert len(fake.history) == 0
    [queued] = fake.prompts
    [prompt_id] = fake.deleted
    assert fake.interrupted == [prompt_id]
    assert queued["client_id"] == fake.clients[0]


async def test_a_lost_socket_fails_the_attempt_and_abandons_the_prompt(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    fake, url = comfyui_fake
    fake.script = ["drop"]
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        task, _ = await run_task(app, PARAMS, max_attempts=1)
    assert task.error is not None
    assert task.error["code"] == "upstream_unavailable"
    assert "closed the progress socket" in task.error["message"]
    assert len(fake.deleted) == 1
    assert fake.interrupted == []  # it had not started a node yet


async def test_an_unreachable_server_is_unavailable(workflow_path: Path, tmp_path: Path) -> None:
    # Given a URL where nothing listens
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(closed_url, workflow_path))) as (
        app,
        _,
    ):
        task, _ = await run_task(app, PARAMS, max_attempts=1)
    assert task.error is not None
    assert task.error["code"] == "upstream_unavailable"
    assert task.error["message"].startswith("comfyui could not be reached")


async def test_a_task_runs_on_the_checkpoint_it_names_and_the_worker_says_it_holds_it(
    comfyui_fake: tuple[FakeComfyUI, str], tmp_path: Path
) -> None:
    # Given a workflow whose checkpoint loader reads {{model}}
    graph = json.loads(json.dumps(WORKFLOW))
    graph["4"]["inputs"]["ckpt_name"] = "{{model}}"
    path = tmp_path / "by_model.json"
    path.write_text(json.dumps(graph), encoding="utf-8")
    fake, url = comfyui_fake
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, path))) as (app, _):
        handler = app.kinds["image.generate"].handler
        # A task that names none is refused at submission, and nothing is stored
        with pytest.raises(InvalidRequest, match=r"params\.model"):
            await app.submit("image.generate", PARAMS)
        # When a task names its checkpoint
        task, _ = await run_task(app, {**PARAMS, "model": "sdxl-base.safetensors"})
        # Then the task records it, ComfyUI loaded it, and the worker holds it now
        assert task.status is Status.SUCCESS, task.error
        assert task.model == "sdxl-base.safetensors"
        assert fake.prompts[-1]["prompt"]["4"]["inputs"]["ckpt_name"] == "sdxl-base.safetensors"
        assert handler.loaded_models() == ["sdxl-base.safetensors"]


async def test_a_workflow_with_a_fixed_checkpoint_names_it_and_refuses_another(
    comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path, tmp_path: Path
) -> None:
    _, url = comfyui_fake
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        submitted = await app.submit("image.generate", PARAMS)
        assert submitted.task.model == "v1-5-pruned-emaonly.safetensors"
        with pytest.raises(InvalidRequest, match="no \\{\\{model\\}\\} placeholder"):
            await app.submit("image.generate", {**PARAMS, "model": "other.safetensors"})
