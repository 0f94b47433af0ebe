"""image.transform end to end over HTTP: upload, a worker runs it, the output downloads; on
local storage and on S3."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from api_support import ApiUnderTest, assert_error, make_kiln, running_api

import kiln
from images import jpeg, opened, png, webp
from kiln import transform
from kiln.config import Settings
from kiln.inputs import input_key
from kiln.storage.s3 import S3Storage
from services.seaweed import S3Server


def kiln_with_transform(settings: Settings) -> kiln.App:
    app = make_kiln(settings)
    transform.register(app)
    return app


@pytest.fixture
async def working(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    async with running_api(settings, kiln_app=kiln_with_transform(settings), workers=1) as api:
        yield api


async def run(
    api: ApiUnderTest, params: dict[str, Any], data: bytes, filename: str = "in"
) -> tuple[dict[str, Any], httpx.Response]:
    """Upload, wait until final, and fetch the task and its one output."""
    request = {"kind": "image.transform", "params": params}
    response = await api.client.post(
        "/v1/tasks",
        data={"request": json.dumps(request)},
        files={"image": (filename, data, "application/octet-stream")},
    )
    assert response.status_code == 201, response.text
    await api.kiln.wait(response.json()["id"], timeout_s=30)
    task: dict[str, Any] = (await api.client.get(f"/v1/tasks/{response.json()['id']}")).json()
    assert task["status"] == "SUCCESS", task["error"]
    [output] = task["result"]["outputs"]
    return task, await api.client.get(output["url"])


@pytest.mark.parametrize(
    ("data", "params", "name", "fmt", "size"),
    [
        (png(40, 30), {"op": "resize", "width": 13, "height": 77}, "image.png", "PNG", (13, 77)),
        (jpeg(40, 30), {"op": "thumbnail", "width": 20, "height": 20}, "image.jpg", "JPEG",
         (20, 15)),
        (png(40, 30), {"op": "crop", "box": [20, 15, 40, 30]}, "image.png", "PNG", (20, 15)),
        (png(40, 30), {"op": "convert", "format": "webp"}, "image.webp", "WEBP", (40, 30)),
        (webp(40, 30), {"op": "convert", "format": "jpeg"}, "image.jpg", "JPEG", (40, 30)),
        (jpeg(40, 30), {"op": "resize", "width": 8, "height": 8, "format": "png"}, "image.png",
         "PNG", (8, 8)),
    ],
    ids=["resize", "thumbnail", "crop", "convert-to-webp", "webp-to-jpeg", "resize-to-png"],
)  # fmt: skip
async def test_each_operation_gives_the_asked_size_and_format(
    working: ApiUnderTest,
    data: bytes,
    params: dict[str, Any],
    name: str,
    fmt: str,
    size: tuple[int, int],
) -> None:
    # When an image is uploaded for the operation and the task runs
    task, output = await run(working, params, data)

    # Then its one output has the name, type, size and bytes the record promises
    [recorded] = task["result"]["outputs"]
    assert recorded["name"] == name
    assert output.status_code == 200
    assert output.headers["content-type"] == recorded["content_type"]
    assert hashlib.sha256(output.content).hexdigest() == recorded["sha256"]
    image = opened(output.content)
    assert (image.format, image.size) == (fmt, size)
    assert task["progress"] == {"step": 3, "total": 3, "fraction": 1.0}


async def test_the_crop_output_holds_the_boxed_pixels(working: ApiUnderTest) -> None:
    # Given a picture whose bottom-right quadrant is yellow, cropped to that quadrant
    _, output = await run(working, {"op": "crop", "box": [20, 15, 40, 30]}, png(40, 30))

    # Then every pixel of the output is yellow
    image = opened(output.content).convert("RGB")
    assert [colour for _, colour in image.getcolors() or []] == [(255, 255, 0)]


async def test_a_crop_box_outside_the_image_is_422_and_stores_nothing(
    working: ApiUnderTest,
) -> None:
    request = {"kind": "image.transform", "params": {"op": "crop", "box": [10, 10, 40, 31]}}

    response = await working.client.post(
        "/v1/tasks",
        data={"request": json.dumps(request)},
        files={"image": ("in.png", png(40, 30), "image/png")},
    )

    error = assert_error(response, 422, "invalid_request")
    assert error["details"][0]["loc"] == ["params", "box"]
    assert [info async for info in working.kiln.storage.list("")] == []
    assert await working.task_count() == 0


async def test_uploads_and_transforms_on_s3_storage(
    settings: Settings, s3_server: S3Server
) -> None:
    # Given the API with one worker, keeping inputs and outputs on S3
    on_s3 = settings.with_(storage_url=s3_server.url("uploads"))
    async with running_api(on_s3, kiln_app=kiln_with_transform(on_s3), workers=1) as api:
        assert isinstance(api.kiln.storage, S3Storage)
        data = png(60, 40)
        digest = hashlib.sha256(data).hexdigest()

        # When an image is uploaded and transformed, a bomb is refused, and the image is
        # uploaded again
        task, output = await run(api, {"op": "thumbnail", "width": 30, "height": 30}, data)
        refused = await api.client.post(
            "/v1/tasks",
            data={"request": json.dumps({"kind": "image.transform", "params": {"op": "convert"}})},
            files={"image": ("notes.png", b"not an image at all", "image/png")},
        )
        again = await api.client.post(
            "/v1/tasks",
            data={"request": json.dumps(
                {"kind": "image.transform",
                 "params": {"op": "thumbnail", "width": 30, "height": 30}})},
            files={"image": ("copy.png", data, "image/png")},
        )  # fmt: skip
        inputs_in_bucket = [info.key async for info in api.kiln.storage.list("inputs/")]

    # Then the input is in the bucket once, by sha256; the output came back; the refusal
    # left nothing; and the second upload is the finished task, with its result
    assert inputs_in_bucket == [input_key(digest)]
    assert opened(output.content).size == (30, 20)
    assert task["inputs"] == [
        {"name": "image", "content_type": "image/png", "size": len(data), "sha256": digest}
    ]
    assert_error(refused, 415, "unsupported_media_type")
    assert again.status_code == 200 and again.json()["deduplicated"] is True
    assert again.json()["id"] == task["id"] and again.json()["result"] == task["result"]


async def test_openapi_documents_the_upload_form(working: ApiUnderTest) -> None:
    schema = (await working.client.get("/openapi.json")).json()

    body = schema["paths"]["/v1/tasks"]["post"]["requestBody"]["content"]
    form = body["multipart/form-data"]["schema"]
    assert form["required"] == ["request"]
    assert form["properties"]["image"]["format"] == "binary"
    components = schema["components"]["schemas"]
    upload_kinds = sorted(components["SubmitUploadRequest"]["discriminator"]["mapping"])
    assert upload_kinds == ["image.contact_sheet", "image.transform"]
    json_kinds = sorted(components["SubmitRequest"]["discriminator"]["mapping"])
    assert json_kinds == ["image.contact_sheet", "image.generate", "image.transform", "pipeline"]
