"""One submission, one validation: every face that submits (``POST /v1/tasks`` as JSON and
as multipart, a batch's item, a rerun, the Comfy API v2's ``POST /api/v2/jobs``) makes
one :class:`kiln.submission.Submission` and hands it down; the kind's params model runs
once per submission, with a tenant rate limit in force (the rate check counts the tasks
of the same checked value)."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pydantic
import pytest
from api_support import ApiUnderTest, make_kiln, running_api
from PIL import Image

from kiln.backends.comfy_workflow_params import KIND as COMFY
from kiln.backends.comfy_workflow_params import ComfyWorkflowParams, models_of
from kiln.config import Settings
from kiln.kinds import ANY_INPUTS
from kiln.limits import Rate

VALIDATIONS: list[str] = []


class Counted(pydantic.BaseModel):
    """Params whose every validation is counted."""

    prompt: str

    @pydantic.model_validator(mode="before")
    @classmethod
    def _count(cls, data: Any) -> Any:
        VALIDATIONS.append(cls.__name__)
        return data


class CountedWorkflow(ComfyWorkflowParams):
    """The Comfy workflow's params, each validation counted."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _count(cls, data: Any) -> Any:
        VALIDATIONS.append(cls.__name__)
        return data


@pytest.fixture
async def counted(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    limited = settings.with_(tenant_rate=Rate(1000, 1000))
    app = make_kiln(limited)
    app.task("count.plain", params=Counted)(_never)
    app.task("count.image", params=Counted, inputs=("image",))(_never)
    app.task(COMFY, params=CountedWorkflow, inputs=(ANY_INPUTS,), model=models_of)(_never)
    async with running_api(limited, kiln_app=app) as under_test:
        yield under_test


async def _never(ctx: Any, params: Any) -> None:
    raise AssertionError("no worker runs here")


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code in (200, 201), response.text
    body: dict[str, Any] = response.json()
    return body


async def _json(api: ApiUnderTest) -> None:
    _ok(await api.client.post("/v1/tasks", json={"kind": "count.plain", "params": {"prompt": "a"}}))


async def _multipart(api: ApiUnderTest) -> None:
    request = json.dumps({"kind": "count.image", "params": {"prompt": "b"}})
    files = {"image": ("fox.png", _png(), "image/png")}
    _ok(await api.client.post("/v1/tasks", data={"request": request}, files=files))


async def _batch_item(api: ApiUnderTest) -> None:
    item = {"kind": "count.plain", "params": {"prompt": "c"}}
    body = _ok(await api.client.post("/v1/tasks/batch", json={"tasks": [item]}))
    assert body["items"][0]["status"] == "created"


async def _comfy(api: ApiUnderTest) -> None:
    graph = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd15.safetensors"}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["4", 0]}},
    }
    _ok(await api.client.post("/api/v2/jobs", json={"workflow": graph}))


FACES = {"json": _json, "multipart": _multipart, "batch_item": _batch_item, "comfy_v2": _comfy}


@pytest.mark.parametrize("face", sorted(FACES))
async def test_a_submission_validates_its_params_once(counted: ApiUnderTest, face: str) -> None:
    VALIDATIONS.clear()
    await FACES[face](counted)
    assert len(VALIDATIONS) == 1, VALIDATIONS
    assert await counted.task_count() == 1


async def test_a_rerun_validates_its_params_once(counted: ApiUnderTest) -> None:
    await _json(counted)
    tasks, _ = await counted.kiln.list_tasks(tenant=None)
    VALIDATIONS.clear()
    rerun = f"/v1/tasks/{tasks[0].id}/rerun"
    body = _ok(await counted.client.post(rerun, json={"params": {"prompt": "d"}}))
    assert body["rerun_of"] == tasks[0].id
    assert len(VALIDATIONS) == 1, VALIDATIONS
