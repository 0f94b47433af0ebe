"""Pipelines over HTTP (docs/pipelines.md): a bad pipeline is a 422 envelope that stores
nothing; a good one runs generate -> upscale -> thumbnail on an in-process worker, its
stream carries its steps' events, and GET shows the steps; cancel and retry."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import ApiUnderTest, assert_error, running_api, sse_events
from PIL import Image

import kiln
from images import png
from kiln import demo, transform
from kiln.api.schemas import TaskOut
from kiln.config import Settings
from kiln.models import Output

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


def sheet_of(repeat: int, tile: int, columns: int) -> dict[str, Any]:
    return {
        "kind": "pipeline",
        "params": {
            "steps": [
                {"name": "generate", "kind": "image.generate", "repeat": repeat,
                 "params": {"prompt": "a fox", "seed": 1, **FAST}},
                {"name": "sheet", "kind": "image.contact_sheet",
                 "params": {"tile": tile, "columns": columns},
                 "inputs": {"images": "step:generate/*"}},
            ]
        },
    }  # fmt: skip


async def test_a_contact_sheet_over_the_pixel_limit_is_a_422_naming_its_size(
    pipeline_api: ApiUnderTest,
) -> None:
    # Given a sheet of 100 pictures in tiles of 1024, 20 a row: 20480×5120 pixels
    response = await pipeline_api.submit(sheet_of(100, 1024, 20))
    # Then it is refused at submit (KILN_MAX_IMAGE_PIXELS is 40,000,000), nothing stored
    error = assert_error(response, 422, "invalid_request")
    assert error["details"][0]["loc"] == ["params", "steps", 1, "params", "tile"]
    assert "20480×5120 = 104857600 pixels" in error["message"]
    assert await pipeline_api.task_count() == 0
    # And a sheet within the limit is taken
    fits = await pipeline_api.submit(sheet_of(100, 256, 20))
    assert fits.status_code == 201, fits.text


async def test_a_contact_sheet_too_large_for_inputs_unknown_at_submit_fails_for_good(
    settings: Settings,
) -> None:
    # Given a kind whose number of outputs the submit cannot know (here, three), and a
    # pixel limit a sheet of its three outputs in tiles of 1024 goes past
    app = kiln.App(settings=dataclasses.replace(settings, max_image_pixels=3_000_000))
    transform.register(app)

    @app.task("test.triple")
    async def triple(ctx: Any, params: Any) -> list[Output]:
        return [Output(f"{n}.png", png(8, 8), "image/png") for n in ("a", "b", "c")]

    steps = [
        {"name": "make", "kind": "test.triple", "params": {}},
        {"name": "sheet", "kind": "image.contact_sheet", "params": {"tile": 1024},
         "inputs": {"images": "step:make/*"}},
    ]  # fmt: skip
    async with running_api(settings, workers=1, kiln_app=app) as api:
        response = await api.submit({"kind": "pipeline", "params": {"steps": steps}})
        assert response.status_code == 201, response.text
        # When it runs
        ended = await api.kiln.wait(response.json()["id"], timeout_s=30)
        # Then the sheet's step failed for good, naming the size, before drawing anything
        assert str(ended.status) == "FAILED"
        sheet = (await api.kiln.pipeline_steps(ended))["sheet/0"]
        assert str(sheet.status) == "FAILED" and sheet.attempt == 1
        assert sheet.error is not None and sheet.error["code"] == "sheet_too_large"
        assert "3072×1024 = 3145728 pixels" in sheet.error["message"]


@pytest.fixture
async def idle_pipeline_api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The pipeline kinds with no worker: nothing made but by the requests."""
    app = kiln.App(settings=settings)
    demo.register(app)
    transform.register(app)
    async with running_api(settings, kiln_app=app) as under_test:
        yield under_test


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"bogus": 1}, ["params", "steps", 0, "bogus"]),
        (
            {"copies": [{"params": {"prompt": "changed", "seed": 7}}]},
            ["params", "steps", 0, "copies"],
        ),
        ({"timeouts": [1, 1, 1]}, ["params", "steps", 0, "timeouts"]),
    ],
    ids=["unknown-field", "changed-copies", "changed-timeouts"],
)
async def test_a_pipeline_rerun_refuses_what_a_submit_refuses(
    idle_pipeline_api: ApiUnderTest, change: dict[str, Any], loc: list[Any]
) -> None:
    api = idle_pipeline_api
    # Given a pipeline, and its stored steps with one field changed or added
    created = (await api.submit(chain())).json()
    steps = [{**created["params"]["steps"][0], **change}, *created["params"]["steps"][1:]]
    before = await api.task_count()
    # When that is submitted, and sent as a rerun of the pipeline
    submitted = await api.submit({"kind": "pipeline", "params": {"steps": steps}})
    rerun = await api.client.post(
        f"/v1/tasks/{created['id']}/rerun", json={"params": {"steps": steps}, "dedup": False}
    )
    # Then both are the same 422 naming the field, and nothing is stored
    for answer in (submitted, rerun):
        error = assert_error(answer, 422, "invalid_request")
        assert error["details"][0]["loc"] == loc
    assert await api.task_count() == before


async def test_a_pipeline_rerun_plans_its_stored_steps_sent_back_unchanged(
    idle_pipeline_api: ApiUnderTest,
) -> None:
    api = idle_pipeline_api
    created = (await api.submit(chain())).json()
    url = f"/v1/tasks/{created['id']}/rerun"
    # A rerun with no change, with its stored steps sent back, and with one step changed
    # (its planned fields left out) each make a pipeline planned from its steps
    same = await api.client.post(url, json={"dedup": False})
    sent_back = await api.client.post(url, json={"params": created["params"], "dedup": False})
    changed = [
        {"name": "generate", "kind": "image.generate", "params": {"prompt": "other", **FAST}},
        *chain()["params"]["steps"][1:],
    ]
    other = await api.client.post(url, json={"params": {"steps": changed}})
    for answer in (same, sent_back, other):
        assert answer.status_code == 201, answer.text
    assert same.json()["params"] == sent_back.json()["params"] == created["params"]
    first = other.json()["params"]["steps"][0]
    assert first["copies"][0]["params"]["prompt"] == "other"
