"""Pipelines over HTTP (docs/pipelines.md): a bad pipeline is a 422 envelope that stores
nothing; a good one runs generate -> upscale -> thumbnail on an in-process worker, its
stream carries its steps' events, and GET shows the steps; cancel and retry."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import ApiUnderTest, assert_error, running_api, sse_events
from PIL import Image

import kiln
from kiln import demo, transform
from kiln.api.schemas import TaskOut
from kiln.config import Settings

FAST = {"width": 64, "height": 64, "steps": 2, "simulate": {"step_ms": 0}}


def chain(prompt: str = "a lighthouse") -> dict[str, Any]:
    return {
        "kind": "pipeline",
        "params": {
            "steps": [
                {"name": "generate", "kind": "image.generate",
                 "params": {"prompt": prompt, "seed": 7, **FAST}},
                {"name": "upscale", "kind": "image.transform",
                 "params": {"op": "resize", "width": 128, "height": 128},
                 "inputs": {"image": "step:generate/image.png"}},
                {"name": "thumbnail", "kind": "image.transform",
                 "params": {"op": "thumbnail", "width": 32, "height": 32, "format": "webp"},
                 "inputs": {"image": "step:upscale/image.png"}},
            ]
        },
    }  # fmt: skip


@pytest.fixture
async def pipeline_api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    app = kiln.App(settings=settings)
    demo.register(app)
    transform.register(app)
    async with running_api(settings, workers=1, kiln_app=app) as under_test:
        yield under_test


@pytest.mark.parametrize(
    ("steps", "loc"),
    [
        ([{"name": "a", "kind": "image.nope", "params": {}}], ["params", "steps", 0, "kind"]),
        ([{"name": "a", "kind": "image.generate", "params": {"prompt": ""}}],
         ["params", "steps", 0, "params", "prompt"]),
        ([{"name": "a", "kind": "image.generate", "params": {"prompt": "x"}},
          {"name": "b", "kind": "image.transform", "params": {"op": "convert"},
           "inputs": {"image": "step:a/image.webp"}}],
         ["params", "steps", 1, "inputs", "image"]),
    ],
)  # fmt: skip
async def test_a_bad_pipeline_is_a_422_envelope_and_stores_nothing(
    pipeline_api: ApiUnderTest, steps: list[Any], loc: list[Any]
) -> None:
    response = await pipeline_api.submit({"kind": "pipeline", "params": {"steps": steps}})
    error = assert_error(response, 422, "invalid_request")
    assert error["details"][0]["loc"] == loc
    assert await pipeline_api.task_count() == 0


async def test_generate_upscale_thumbnail_runs_and_streams_its_steps(
    pipeline_api: ApiUnderTest,
) -> None:
    client = pipeline_api.client
    created = await pipeline_api.submit(chain())
    assert created.status_code == 201, created.text
    pipeline_id = created.json()["id"]
    # When its stream is followed to the end
    events = []
    async with client.stream("GET", f"/v1/tasks/{pipeline_id}/events") as response:
        events = [e.json() async for e in sse_events(response) if e.event == "status"]
    # Then it carried every step's status events, and ended with the pipeline's SUCCESS
    body = (await client.get(f"/v1/tasks/{pipeline_id}")).json()
    TaskOut.model_validate(body)
    step_ids = [s["task_id"] for s in body["steps"]]
    uploaded = [e["task_id"] for e in events if e["event"] == "uploaded"]
    assert uploaded == step_ids
    assert events[-1]["task_id"] == pipeline_id and events[-1]["status"] == "SUCCESS"
    # And GET shows each step with its status and outputs
    assert [(s["name"], s["copy"], s["status"]) for s in body["steps"]] == [
        ("generate", 0, "SUCCESS"), ("upscale", 0, "SUCCESS"), ("thumbnail", 0, "SUCCESS"),
    ]  # fmt: skip
    assert body["status"] == "SUCCESS" and body["progress"]["fraction"] == 1.0
    last = body["steps"][-1]
    assert [o["name"] for o in last["outputs"]] == ["image.webp"]
    # And a step names its pipeline
    step = (await client.get(f"/v1/tasks/{last['task_id']}")).json()
    assert step["pipeline_id"] == pipeline_id
    assert step["step"] == {"name": "thumbnail", "copy": 0}
    picture = await client.get(last["outputs"][0]["url"])
    assert Image.open(io.BytesIO(picture.content)).size == (32, 32)


async def test_cancel_then_retry_a_pipeline_over_http(pipeline_api: ApiUnderTest) -> None:
    # Given a pipeline whose first step takes a while
    body = chain("slow")
    body["params"]["steps"][0]["params"]["simulate"] = {"step_ms": 200}
    pipeline_id = (await pipeline_api.submit(body)).json()["id"]
    client = pipeline_api.client
    # When it is cancelled
    cancelled = await client.post(f"/v1/tasks/{pipeline_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "CANCELLED"
    # Then retried, it runs to the end
    retried = await client.post(f"/v1/tasks/{pipeline_id}/retry")
    assert retried.status_code == 200 and retried.json()["status"] == "GENERATING"
    done = await pipeline_api.kiln.wait(pipeline_id, timeout_s=30)
    assert str(done.status) == "SUCCESS"
