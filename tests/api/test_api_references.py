"""Inputs by reference: a submission names an input by its content hash ("sha256:<hex>"),
an earlier upload or an output of the tenant's tasks, instead of sending the bytes again.
A reference and an upload of the same bytes are alike (record, dedup, retention); unknown,
malformed and other tenants' content is 422 and stores nothing."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from api_support import (
    ALICE_KEY,
    BOB_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    make_kiln,
    running_api,
    with_keys,
)

import kiln
from images import opened, png
from kiln import transform
from kiln.config import Settings
from kiln.inputs import input_key, reference
from kiln.storage import sha256_hex

THUMB = {"op": "thumbnail", "width": 20, "height": 20}


def kiln_with_transform(settings: Settings) -> kiln.App:
    app = make_kiln(settings)
    transform.register(app)
    return app


@pytest.fixture
async def keyed(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API with image.generate and image.transform, keys for alice and bob, calling as
    alice, no workers."""
    keyed = with_keys(settings)
    async with running_api(keyed, key=ALICE_KEY, kiln_app=kiln_with_transform(keyed)) as api:
        yield api


async def upload(
    api: ApiUnderTest, data: bytes, params: dict[str, Any], key: str | None = None
) -> httpx.Response:
    request = {"kind": "image.transform", "params": params}
    return await api.client.post(
        "/v1/tasks",
        data={"request": json.dumps(request)},
        files={"image": ("in.png", data, "image/png")},
        headers=bearer(key) if key else None,
    )


def by_reference(params: dict[str, Any], ref: str, **fields: Any) -> dict[str, Any]:
    return {"kind": "image.transform", "params": params, "inputs": {"image": ref}, **fields}


async def stored_keys(api: ApiUnderTest) -> list[str]:
    return sorted([info.key async for info in api.kiln.storage.list("")])


async def pins(api: ApiUnderTest) -> list[tuple[str, int]]:
    """Every input the store knows, with its pin count."""
    store = api.kiln.engine.store
    return sorted(await store._rows(store.q.sql("SELECT sha256, pins FROM inputs"), (), tuple))


async def test_a_reference_to_an_upload_is_the_same_input_and_dedups_alike(
    keyed: ApiUnderTest,
) -> None:
    # Given an image uploaded once for a thumbnail
    data = png(40, 30)
    first = await upload(keyed, data, THUMB)
    assert first.status_code == 201, first.text
    ref = reference(data)
    assert ref == "sha256:" + hashlib.sha256(data).hexdigest()

    # When the same thumbnail is asked for by reference, and a resize of the same image too
    same = await keyed.submit(by_reference(THUMB, ref))
    resize = await keyed.submit(by_reference({"op": "resize", "width": 8, "height": 8}, ref))

    # Then the first is the uploaded task (content dedup), and the second a new task whose
    # input record is exactly the upload's (width and height included), with one object
    assert same.status_code == 200 and same.json()["deduplicated"] is True
    assert same.json()["id"] == first.json()["id"]
    assert resize.status_code == 201, resize.text
    assert resize.json()["inputs"] == first.json()["inputs"]
    uploaded = await keyed.kiln.get(first.json()["id"])
    referred = await keyed.kiln.get(resize.json()["id"])
    assert referred.inputs == uploaded.inputs
    assert referred.inputs[0]["width"] == 40 and referred.inputs[0]["height"] == 30
    assert await stored_keys(keyed) == [input_key(sha256_hex(data))]
    # ... which retention counts as used by both tasks, with no pin left
    assert await keyed.kiln.engine.store.inputs.known([sha256_hex(data)]) == {sha256_hex(data)}
    assert await pins(keyed) == [(sha256_hex(data), 0)]


async def test_an_idempotency_key_replays_across_upload_and_reference(
    keyed: ApiUnderTest,
) -> None:
    data = png(24, 24)
    first = await upload(keyed, data, THUMB, key=None)
    assert first.status_code == 201
    # An Idempotency-Key first used with an upload replays for the same content by reference
    headers = {"Idempotency-Key": "thumb-1"}
    keyed_upload = await keyed.client.post(
        "/v1/tasks",
        data={"request": json.dumps({"kind": "image.transform", "params": THUMB,
                                     "dedup": False})},
        files={"image": ("x.png", data, "image/png")},
        headers=headers,
    )  # fmt: skip
    replay = await keyed.submit(by_reference(THUMB, reference(data), dedup=False), headers=headers)
    assert keyed_upload.status_code == 201
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == keyed_upload.json()["id"]


@pytest.mark.parametrize(
    ("inputs", "why"),
    [
        ({"image": "sha256:" + "0" * 64}, "unknown"),
        ({"image": "sha256:" + "0" * 63}, "malformed"),
        ({"image": "md5:" + "0" * 32}, "malformed"),
        ({"image": 7}, "malformed"),
        ({"mask": None}, "malformed"),
        ({"mask": "sha256:" + "0" * 64}, "not taken"),
    ],
    ids=["unknown", "short", "other-hash", "not-a-string", "null", "name-not-taken"],
)
async def test_bad_references_are_422_and_store_nothing(
    keyed: ApiUnderTest, inputs: dict[str, Any], why: str
) -> None:
    body = {"kind": "image.transform", "params": THUMB, "inputs": inputs}

    response = await keyed.submit(body)

    error = assert_error(response, 422, "invalid_request")
    assert error["details"], why
    assert await keyed.task_count() == 0
    assert await stored_keys(keyed) == [] and await pins(keyed) == []


async def test_another_tenants_upload_or_output_is_422_and_stores_nothing(
    settings: Settings,
) -> None:
    keyed = with_keys(settings)
    app = kiln_with_transform(keyed)
    async with running_api(keyed, key=ALICE_KEY, kiln_app=app, workers=1) as api:
        # Given bob's upload, and bob's transform of it that succeeded
        data = png(30, 20)
        bobs = await upload(api, data, THUMB, key=BOB_KEY)
        assert bobs.status_code == 201
        done = await api.kiln.wait(bobs.json()["id"], timeout_s=30)
        assert done.result is not None
        [output] = done.result["outputs"]
        before = (await api.task_count(), await stored_keys(api), await pins(api))

        # When alice names either by its hash
        for ref in (reference(data), f"sha256:{output['sha256']}"):
            response = await api.submit(by_reference(THUMB, ref))
            # Then it is 422, as for content nobody has, and nothing is stored
            error = assert_error(response, 422, "invalid_request")
            assert error["details"][0]["loc"] == ["inputs", "image"]
        assert (await api.task_count(), await stored_keys(api), await pins(api)) == before
        # while bob may
        again = await api.submit(by_reference({"op": "convert"}, reference(data)), key=BOB_KEY)
        assert again.status_code == 201, again.text


async def test_image_generate_takes_no_input_by_reference(keyed: ApiUnderTest) -> None:
    data = png(16, 16)
    assert (await upload(keyed, data, THUMB)).status_code == 201

    response = await keyed.submit(image_body(inputs={"image": reference(data)}))

    error = assert_error(response, 422, "invalid_request")
    assert error["details"][0]["loc"] == ["inputs", "image"]
    assert await keyed.task_count() == 1 and await pins(keyed) == [(sha256_hex(data), 0)]


async def test_a_file_part_and_a_reference_for_one_input_are_422(keyed: ApiUnderTest) -> None:
    data = png(16, 16)
    assert (await upload(keyed, data, THUMB)).status_code == 201
    request = by_reference({"op": "convert"}, reference(data))

    response = await keyed.client.post(
        "/v1/tasks",
        data={"request": json.dumps(request)},
        files={"image": ("in.png", data, "image/png")},
    )

    assert_error(response, 422, "invalid_request")
    assert await keyed.task_count() == 1


async def test_a_multipart_request_part_may_name_its_input_by_reference(
    keyed: ApiUnderTest,
) -> None:
    data = png(16, 16)
    assert (await upload(keyed, data, THUMB)).status_code == 201
    request = by_reference({"op": "convert", "format": "webp"}, reference(data))

    response = await keyed.client.post("/v1/tasks", files={"request": (None, json.dumps(request))})

    assert response.status_code == 201, response.text
    assert response.json()["inputs"][0]["sha256"] == sha256_hex(data)


async def test_a_params_check_against_the_referenced_image_is_422_and_unpins(
    keyed: ApiUnderTest,
) -> None:
    data = png(40, 30)
    assert (await upload(keyed, data, THUMB)).status_code == 201

    response = await keyed.submit(
        by_reference({"op": "crop", "box": [0, 0, 41, 30]}, reference(data))
    )

    error = assert_error(response, 422, "invalid_request")
    assert error["details"][0]["loc"] == ["params", "box"]
    assert await keyed.task_count() == 1 and await pins(keyed) == [(sha256_hex(data), 0)]


async def test_batch_items_may_reference_inputs_each_answered_alone(keyed: ApiUnderTest) -> None:
    data = png(20, 20)
    assert (await upload(keyed, data, THUMB)).status_code == 201
    items = [
        by_reference({"op": "convert", "format": "jpeg"}, reference(data)),
        by_reference({"op": "convert"}, "sha256:" + "f" * 64),
        by_reference(THUMB, reference(data)),
    ]

    response = await keyed.client.post("/v1/tasks/batch", json={"tasks": items})

    assert response.status_code == 200, response.text
    answers = [(i["status"], (i["error"] or {}).get("code")) for i in response.json()["items"]]
    assert answers == [("created", None), ("refused", "invalid_request"), ("deduplicated", None)]
    assert await keyed.task_count() == 2 and await pins(keyed) == [(sha256_hex(data), 0)]


async def test_a_schedule_takes_no_input_by_reference(keyed: ApiUnderTest) -> None:
    body = {"cron": "0 * * * *", "task": by_reference(THUMB, "sha256:" + "0" * 64)}

    response = await keyed.client.post("/v1/schedules", json=body)

    assert_error(response, 422, "invalid_request")


@pytest.mark.parametrize("backend", ["sqlite-local", "postgres-s3"])
async def test_a_worker_runs_a_task_that_references_an_output(
    request: pytest.FixtureRequest, settings: Settings, backend: str
) -> None:
    if backend == "postgres-s3":
        settings = settings.with_(
            database_url=request.getfixturevalue("postgres_server").new_database(),
            storage_url=request.getfixturevalue("s3_server").url("refs"),
        )
    app = kiln_with_transform(settings)
    async with running_api(settings, kiln_app=app, workers=1) as api:
        # Given a generated image (a SUCCESS task's output)
        generated = await api.submit(image_body("a kiln at dusk"))
        done = await api.kiln.wait(generated.json()["id"], timeout_s=30)
        assert done.result is not None
        [output] = done.result["outputs"]
        made = await api.kiln.storage.get(output["key"])

        # When a thumbnail of it is asked for by its hash, never sending the bytes
        response = await api.submit(by_reference(THUMB, f"sha256:{output['sha256']}"))
        assert response.status_code == 201, response.text
        task = await api.kiln.wait(response.json()["id"], timeout_s=30)

        # Then the output became an input like an upload (its own object under inputs/,
        # its header read), and the worker made the thumbnail from those bytes
        assert task.status.value == "SUCCESS", task.error
        [item] = task.inputs
        width, height = opened(made).size
        assert item == {"name": "image", "content_type": output["content_type"],
                        "size": len(made), "sha256": output["sha256"], "width": width,
                        "height": height}  # fmt: skip
        assert await api.kiln.storage.get(input_key(output["sha256"])) == made
        assert task.result is not None
        [thumb] = task.result["outputs"]
        thumb_bytes = (await api.client.get(f"/v1/tasks/{task.id}/outputs/{thumb['name']}")).content
        assert sha256_hex(thumb_bytes) == thumb["sha256"]
        assert max(opened(thumb_bytes).size) == 20
        # and the same thumbnail asked again by reference is that task
        again = await api.submit(by_reference(THUMB, f"sha256:{output['sha256']}"))
        assert again.status_code == 200 and again.json()["id"] == task.id
        assert await pins(api) == [(output["sha256"], 0)]


async def test_openapi_documents_inputs_by_reference_for_kinds_that_take_inputs(
    keyed: ApiUnderTest,
) -> None:
    schema = (await keyed.client.get("/openapi.json")).json()["components"]["schemas"]

    def variants(name: str) -> dict[str, Any]:
        refs = schema[name]["oneOf"]
        found = [schema[ref["$ref"].rsplit("/", 1)[1]] for ref in refs]
        return {v["properties"]["kind"]["const"]: v for v in found}

    uploads, by_kind = variants("SubmitUploadRequest"), variants("SubmitRequest")
    assert {"image.transform", "image.contact_sheet"} <= set(uploads)
    for upload in uploads.values():  # every kind that takes uploads takes references too
        inputs = upload["properties"]["inputs"]["anyOf"][0]
        assert inputs["additionalProperties"]["pattern"] == "^sha256:[0-9a-fA-F]{64}$"
    for kind, name in (("image.transform", "image"), ("image.contact_sheet", "images")):
        # the JSON variant names its inputs by reference, and needs them
        inputs = by_kind[kind]["properties"]["inputs"]
        assert inputs["properties"][name]["pattern"] == "^sha256:[0-9a-fA-F]{64}$"
        assert inputs["required"] == [name] and "inputs" in by_kind[kind]["required"]
    assert "inputs" not in by_kind["image.generate"]["properties"]
    assert all("inputs" not in v["properties"] for v in variants("ScheduleTask").values())


async def test_file_parts_and_references_mix_and_dedup_as_uploads_alike(
    settings: Settings,
) -> None:
    # Given a kind of two inputs, both uploaded once
    app = kiln_with_transform(settings)

    @app.task("image.pair", inputs=("image", "mask"))
    async def pair(ctx: Any, params: Any) -> None:
        return None

    async with running_api(settings, kiln_app=app) as api:
        image, mask = png(20, 10), png(10, 20)
        request = {"kind": "image.pair", "params": {}}
        first = await api.client.post(
            "/v1/tasks",
            data={"request": json.dumps(request)},
            files=[
                ("mask", ("m.png", mask, "image/png")),
                ("image", ("i.png", image, "image/png")),
            ],
        )
        assert first.status_code == 201, first.text
        # When the image is named by reference and the mask sent again as a file
        mixed = await api.client.post(
            "/v1/tasks",
            data={"request": json.dumps({**request, "inputs": {"image": reference(image)}})},
            files={"mask": ("m2.png", mask, "image/png")},
        )
        # and when both are named by reference
        both = await api.submit(
            {**request, "inputs": {"mask": reference(mask), "image": reference(image)}}
        )

    # Then both are the uploaded task: the inputs in the kind's order, however they came
    assert [i["name"] for i in first.json()["inputs"]] == ["image", "mask"]
    for again in (mixed, both):
        assert again.status_code == 200, again.text
        assert again.json()["deduplicated"] is True and again.json()["id"] == first.json()["id"]
