"""POST /v1/tasks as multipart/form-data: inputs stored once by sha256, deduplicated by
content, every limit enforced while the body streams in, and nothing kept on a refusal."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest
from api_support import (
    ApiUnderTest,
    assert_error,
    image_body,
    make_kiln,
    raw_request,
    running_api,
)
from fastapi import FastAPI

import kiln
from images import jpeg, png, png_header_claiming, webp
from kiln import transform
from kiln.api.schemas import TaskOut
from kiln.config import Settings
from kiln.inputs import input_key

#: Small limits, so that going past them stays cheap: 256 KiB a request, 4 KiB of JSON,
#: one megapixel.
LIMITS = {"max_upload_bytes": 256 * 1024, "max_body_bytes": 4096, "max_image_pixels": 1_000_000}
BOUNDARY = "kiln-test-boundary"
RESIZE = {"kind": "image.transform", "params": {"op": "resize", "width": 20, "height": 10}}
INPUT_FIELDS = {"name", "content_type", "size", "sha256"}


def kiln_with_transform(settings: Settings) -> kiln.App:
    app = make_kiln(settings)
    transform.register(app)
    return app


@pytest.fixture
def limited(settings: Settings) -> Settings:
    return settings.with_(**LIMITS)


@pytest.fixture
async def api(limited: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API with image.generate and image.transform, small upload limits, no workers."""
    async with running_api(limited, kiln_app=kiln_with_transform(limited)) as under_test:
        yield under_test


@pytest.fixture
async def working(limited: Settings) -> AsyncIterator[ApiUnderTest]:
    """The same API with one in-process worker."""
    app = kiln_with_transform(limited)
    async with running_api(limited, kiln_app=app, workers=1) as under_test:
        yield under_test


async def upload(
    api: ApiUnderTest,
    request: dict[str, Any] | None = RESIZE,
    files: dict[str, tuple[str, bytes, str]] | None = None,
    *,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """A multipart submission: the ``request`` form field plus file parts."""
    data = {} if request is None else {"request": json.dumps(request)}
    files = {"image": ("fox.png", png(), "image/png")} if files is None else files
    return await api.client.post("/v1/tasks", data=data, files=files, headers=headers or {})


async def stored_keys(api: ApiUnderTest) -> list[str]:
    return [info.key async for info in api.kiln.storage.list("")]


def multipart(*parts: tuple[str, str | None, str | None, bytes]) -> bytes:
    """A multipart/form-data body of (name, filename, content type, bytes) parts."""
    body = b""
    for name, filename, content_type, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n".encode()
        if content_type:
            body += f"Content-Type: {content_type}\r\n".encode()
        body += b"\r\n" + data + b"\r\n"
    return body + f"--{BOUNDARY}--\r\n".encode()


def multipart_headers(length: int | None) -> dict[str, str]:
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    if length is not None:
        headers["content-length"] = str(length)
    return headers


async def streamed(
    http: FastAPI, headers: dict[str, str], chunks: list[bytes]
) -> tuple[int, dict[str, Any], int]:
    """Send ``chunks`` one by one into the ASGI app: (status, body, chunks it read)."""
    pending = list(chunks)
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    raw = [(b"host", b"kiln.test")] + [(k.encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/tasks", "raw_path": b"/v1/tasks",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("kiln.test", 80), "headers": raw}  # fmt: skip
    await http(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return int(status), json.loads(body), len(chunks) - len(pending)


# Accepted uploads -----------------------------------------------------------------------


async def test_upload_creates_a_task_whose_inputs_are_stored_once_by_sha256(
    api: ApiUnderTest,
) -> None:
    # Given a PNG
    data = png(40, 30)
    digest = hashlib.sha256(data).hexdigest()

    # When it is uploaded with an image.transform request
    response = await upload(api, files={"image": ("fox.png", data, "image/png")})

    # Then the task is new, its inputs say exactly what API.md shows, and the bytes are in
    # storage under their sha256
    assert response.status_code == 201, response.text
    task = response.json()
    TaskOut.model_validate(task)
    assert response.headers["location"] == f"/v1/tasks/{task['id']}"
    assert task["kind"] == "image.transform" and task["deduplicated"] is False
    assert task["inputs"] == [
        {"name": "image", "content_type": "image/png", "size": len(data), "sha256": digest}
    ]
    assert set(task["inputs"][0]) == INPUT_FIELDS
    assert await stored_keys(api) == [input_key(digest)]
    assert input_key(digest) == f"inputs/{digest[:2]}/{digest}"
    assert await api.kiln.storage.get(input_key(digest)) == data
    fetched = await api.client.get(f"/v1/tasks/{task['id']}")
    assert fetched.json()["inputs"] == task["inputs"]


@pytest.mark.parametrize(
    ("data", "content_type"),
    [(jpeg(), "image/jpeg"), (webp(), "image/webp"), (png(), "image/png")],
    ids=["jpeg", "webp", "png"],
)
async def test_the_content_type_is_the_one_the_bytes_say(
    api: ApiUnderTest, data: bytes, content_type: str
) -> None:
    # Given an image sent with a misleading name and declared type
    files = {"image": ("picture.gif", data, "application/octet-stream")}

    # When it is uploaded
    response = await upload(api, files=files)

    # Then the input's content type is detected from its bytes
    assert response.status_code == 201, response.text
    assert response.json()["inputs"][0]["content_type"] == content_type


async def test_the_request_part_may_be_a_json_file_part(api: ApiUnderTest) -> None:
    files = {
        "request": ("request.json", json.dumps(RESIZE).encode(), "application/json"),
        "image": ("fox.png", png(), "image/png"),
    }

    response = await upload(api, request=None, files=files)

    assert response.status_code == 201, response.text
    assert response.json()["params"] == RESIZE["params"]


async def test_the_same_file_and_params_again_return_the_existing_task(api: ApiUnderTest) -> None:
    # Given an uploaded file
    data = png(32, 32)
    first = await upload(api, files={"image": ("a.png", data, "image/png")})

    # When the same bytes come again under another file name, with the same params
    again = await upload(api, files={"image": ("another-name.png", data, "image/png")})
    other_params = await upload(
        api,
        {"kind": "image.transform", "params": {"op": "convert", "format": "webp"}},
        files={"image": ("a.png", data, "image/png")},
    )

    # Then the second answer is that task (200, deduplicated, no replay header), other params
    # make another task, and the bytes are stored once
    assert first.status_code == 201
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["deduplicated"] is True
    assert "idempotent-replayed" not in again.headers
    assert other_params.status_code == 201
    assert await api.task_count() == 2
    assert await stored_keys(api) == [input_key(hashlib.sha256(data).hexdigest())]


async def test_a_duplicate_of_a_finished_upload_answers_at_once_with_its_result(
    working: ApiUnderTest,
) -> None:
    # Given an upload whose task has succeeded
    data = png(64, 48)
    first = await upload(working, files={"image": ("fox.png", data, "image/png")})
    done = await working.kiln.wait(first.json()["id"], timeout_s=30)
    assert done.status == "SUCCESS", done.error

    # When the same file is uploaded again with the same params
    started = time.perf_counter()
    again = await upload(working, files={"image": ("fox.png", data, "image/png")})
    elapsed_s = time.perf_counter() - started

    # Then the answer is the finished task, result included, and no new work was queued
    assert again.status_code == 200, again.text
    body = again.json()
    assert body["id"] == first.json()["id"] and body["deduplicated"] is True
    assert body["status"] == "SUCCESS"
    [output] = body["result"]["outputs"]
    assert output["name"] == "image.png" and output["url"].endswith("/outputs/image.png")
    assert await working.task_count() == 1
    print(f"duplicate upload of a finished task answered in {elapsed_s * 1000:.1f} ms")


async def test_twenty_simultaneous_identical_uploads_make_one_task_and_one_input(
    api: ApiUnderTest,
) -> None:
    # Given one file
    data = png(50, 50)

    # When 20 clients upload it at the same moment with the same params
    answers = await asyncio.gather(
        *(upload(api, files={"image": (f"copy-{n}.png", data, "image/png")}) for n in range(20))
    )

    # Then exactly one answer created the task, the others got it deduplicated
    assert sorted(a.status_code for a in answers) == [200] * 19 + [201]
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum(a.json()["deduplicated"] for a in answers) == 19
    assert await api.task_count() == 1
    assert await stored_keys(api) == [input_key(hashlib.sha256(data).hexdigest())]


async def test_an_idempotency_key_replays_an_upload_and_refuses_another_file(
    api: ApiUnderTest,
) -> None:
    # Given an upload made with an Idempotency-Key
    key = {"Idempotency-Key": "upload-1"}
    first = await upload(api, files={"image": ("a.png", png(30, 30), "image/png")}, headers=key)

    # When the same request is retried, and the key is reused for another file
    replay = await upload(api, files={"image": ("a.png", png(30, 30), "image/png")}, headers=key)
    reused = await upload(api, files={"image": ("b.png", png(31, 30), "image/png")}, headers=key)

    # Then the retry replays the task, the reuse is refused and its file is not kept
    assert first.status_code == 201
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.json()["id"] == first.json()["id"]
    assert replay.json()["idempotency_key"] == "upload-1"
    assert_error(reused, 422, "idempotency_key_reused")
    assert await api.task_count() == 1
    assert await stored_keys(api) == [input_key(hashlib.sha256(png(30, 30)).hexdigest())]


# Refused uploads: the right error, nothing stored, the server still serving -------------


Part = tuple[str, str | None, str | None, bytes]


def _refusals() -> dict[str, tuple[list[Part], int, str]]:
    """case → (the parts of the multipart body, status, code)."""
    text = b"this is not a picture, whatever its name says\n" * 10

    def request(body: Any) -> Part:
        return (
            "request",
            None,
            None,
            body if isinstance(body, bytes) else json.dumps(body).encode(),
        )

    def image(data: bytes, filename: str = "fox.png") -> Part:
        return ("image", filename, "image/png", data)

    good, fox = request(RESIZE), image(png())
    crop = {"kind": "image.transform", "params": {"op": "crop", "box": [0, 0, 41, 30]}}
    return {
        "text-renamed-png": ([good, image(text, "notes.png")], 415, "unsupported_media_type"),
        "empty-file": ([good, image(b"")], 415, "unsupported_media_type"),
        "png-signature-then-garbage": ([good, image(b"\x89PNG\r\n\x1a\n" + text)],
                                       415, "unsupported_media_type"),
        "header-claims-50000x50000": ([good, image(png_header_claiming(50_000, 50_000))],
                                      413, "payload_too_large"),
        "one-pixel-past-the-limit": ([good, image(png(1001, 1000))], 413, "payload_too_large"),
        "missing-image-part": ([good], 422, "invalid_request"),
        "missing-request-part": ([fox], 422, "invalid_request"),
        "request-not-json": ([request(b"{kind: image.transform"), fox], 422, "invalid_request"),
        "request-empty": ([request(b""), fox], 422, "invalid_request"),
        "request-not-an-object": ([request([1, 2]), fox], 422, "invalid_request"),
        "bad-params": ([request({"kind": "image.transform", "params": {"op": "resize"}}), fox],
                       422, "invalid_request"),
        "crop-box-outside-the-image": ([request(crop), fox], 422, "invalid_request"),
        "unknown-kind": ([request({"kind": "video.render", "params": {}}), fox],
                         422, "unknown_kind"),
        "input-the-kind-does-not-take": ([request(image_body()), fox], 422, "invalid_request"),
        "an-unexpected-second-input": ([good, fox, ("mask", "m.png", "image/png", png())],
                                       422, "invalid_request"),
        "request-part-over-max-body-bytes": (
            [request({**RESIZE, "metadata": {"note": "x" * 5000}}), fox],
            413, "payload_too_large"),
        "upload-over-max-upload-bytes": ([good, image(png() + b"\0" * 300_000)],
                                         413, "payload_too_large"),
    }  # fmt: skip


REFUSALS = _refusals()


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_a_refused_upload_stores_nothing_and_the_server_keeps_serving(
    api: ApiUnderTest, case: str
) -> None:
    # Given one of the ways an upload is refused
    parts, status, code = REFUSALS[case]
    body = multipart(*parts)

    # When it is sent
    response = await api.client.post("/v1/tasks", content=body, headers=multipart_headers(None))

    # Then it is answered with its error in the envelope (a limit names the setting that
    # allows more), nothing is stored, no task exists, and the next good upload is served
    error = assert_error(response, status, code)
    if status == 413:
        assert "KILN_MAX_" in error["message"], error["message"]
    assert await stored_keys(api) == []
    assert await api.task_count() == 0
    assert (await upload(api)).status_code == 201


async def test_image_transform_sent_as_plain_json_is_422(api: ApiUnderTest) -> None:
    response = await api.client.post("/v1/tasks", json=RESIZE)

    error = assert_error(response, 422, "invalid_request")
    assert "multipart/form-data" in error["message"]
    assert error["details"][0]["loc"] == ["image"]
    assert await api.task_count() == 0


async def test_a_decompression_bomb_header_is_refused_quickly(api: ApiUnderTest) -> None:
    # Given a 300-byte PNG whose header claims 50,000×50,000 pixels (7.5 GB decoded)
    bomb = png_header_claiming(50_000, 50_000)
    assert len(bomb) < 400

    # When it is uploaded
    started = time.perf_counter()
    response = await upload(api, files={"image": ("bomb.png", bomb, "image/png")})
    elapsed_s = time.perf_counter() - started

    # Then it is refused from its header, in far less time than decoding would take
    error = assert_error(response, 413, "payload_too_large")
    assert "pixels" in error["message"]
    assert elapsed_s < 2.0
    print(f"50000x50000 header refused in {elapsed_s * 1000:.1f} ms")


async def test_a_bomb_is_refused_before_the_rest_of_its_body_is_read(api: ApiUnderTest) -> None:
    # Given a bomb header padded to 200 KiB (under the upload limit), sent in 4 KiB chunks
    bomb = png_header_claiming(50_000, 50_000, padding=200 * 1024)
    body = multipart(
        ("request", None, None, json.dumps(RESIZE).encode()), ("image", "b.png", "image/png", bomb)
    )
    chunks = [body[i : i + 4096] for i in range(0, len(body), 4096)]

    # When it streams in
    status, answer, read = await streamed(api.http, multipart_headers(len(body)), chunks)

    # Then the header was enough: 413 after about 64 KiB of the file, not all 200 KiB
    assert (status, answer["error"]["code"]) == (413, "payload_too_large")
    assert read * 4096 < 80 * 1024 < len(body)
    assert await stored_keys(api) == [] and await api.task_count() == 0


async def test_a_text_file_is_refused_from_its_first_bytes(api: ApiUnderTest) -> None:
    # Given a text file of 200 KiB sent in 4 KiB chunks
    body = multipart(
        ("request", None, None, json.dumps(RESIZE).encode()),
        ("image", "notes.png", "image/png", b"plain text, not an image\n" * 8000),
    )
    chunks = [body[i : i + 4096] for i in range(0, len(body), 4096)]

    # When it streams in
    status, answer, read = await streamed(api.http, multipart_headers(len(body)), chunks)

    # Then the first chunk of it was enough
    assert (status, answer["error"]["code"]) == (415, "unsupported_media_type")
    assert read <= 2
    assert await stored_keys(api) == [] and await api.task_count() == 0


@pytest.mark.parametrize("declared", ["1000", None], ids=["lying-content-length", "no-length"])
async def test_a_body_past_the_upload_limit_is_counted_as_it_streams(
    api: ApiUnderTest, declared: str | None
) -> None:
    # Given a body of about 400 KiB (limit 256 KiB) that declares 1000 bytes, or no length
    padding = png(40, 30) + b"\0" * (400 * 1024)
    body = multipart(
        ("request", None, None, json.dumps(RESIZE).encode()),
        ("image", "big.png", "image/png", padding),
    )
    chunks = [body[i : i + 16384] for i in range(0, len(body), 16384)]
    headers = multipart_headers(None)
    if declared is not None:
        headers["content-length"] = declared

    # When it streams in
    status, answer, read = await streamed(api.http, headers, chunks)

    # Then it is refused once the limit is passed, without reading the rest
    assert (status, answer["error"]["code"]) == (413, "payload_too_large")
    assert 256 * 1024 <= read * 16384 < len(body)
    assert await stored_keys(api) == [] and await api.task_count() == 0
    assert (await upload(api)).status_code == 201


async def test_a_declared_length_past_the_limit_is_refused_before_reading(
    api: ApiUnderTest,
) -> None:
    body = multipart(("request", None, None, json.dumps(RESIZE).encode()))

    status, answer, read = await streamed(
        api.http, multipart_headers(LIMITS["max_upload_bytes"] + 1), [body]
    )

    assert (status, answer["error"]["code"]) == (413, "payload_too_large")
    assert read == 0


@pytest.mark.parametrize(
    "body",
    [
        multipart(("request", None, None, json.dumps(RESIZE).encode()))[:-20],
        b"not multipart at all",
        multipart(("request", None, None, b"{}"), ("request", None, None, b"{}")),
    ],
    ids=["truncated", "garbage", "request-twice"],
)
async def test_a_malformed_multipart_body_is_422(api: ApiUnderTest, body: bytes) -> None:
    status, content = await raw_request(
        api.http, "POST", "/v1/tasks", headers=multipart_headers(len(body)), body_parts=[body]
    )

    assert status == 422, content
    assert json.loads(content)["error"]["code"] == "invalid_request"
    assert await stored_keys(api) == [] and await api.task_count() == 0


async def test_a_multipart_type_without_boundary_is_422(api: ApiUnderTest) -> None:
    response = await api.client.post(
        "/v1/tasks", content=b"x", headers={"content-type": "multipart/form-data"}
    )

    assert_error(response, 422, "invalid_request")
