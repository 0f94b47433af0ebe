"""Outputs stored on S3: the API streams them (proxy) or redirects to a presigned URL."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
from api_support import ApiUnderTest, image_body, running_api

from kiln.config import Settings
from kiln.models import StoredOutput
from kiln.storage import verify
from kiln.storage.s3 import S3Storage
from services.seaweed import S3Server


async def _finished(api: ApiUnderTest) -> dict[str, Any]:
    response = await api.submit(image_body("an output on s3"))
    await api.kiln.wait(response.json()["id"], timeout_s=30)
    task: dict[str, Any] = (await api.client.get(f"/v1/tasks/{response.json()['id']}")).json()
    assert task["status"] == "SUCCESS", task
    return task


async def test_proxy_mode_streams_the_bytes_of_an_output_stored_on_s3(
    settings: Settings, s3_server: S3Server
) -> None:
    # Given the API with one worker, storing outputs on S3, in the default proxy mode
    on_s3 = settings.with_(storage_url=s3_server.url("api"))
    async with running_api(on_s3, workers=1) as api:
        assert isinstance(api.kiln.storage, S3Storage)

        # When a task finishes and its output is fetched
        task = await _finished(api)
        output = task["result"]["outputs"][0]
        response = await api.client.get(output["url"])
        again = await api.client.get(
            output["url"], headers={"If-None-Match": response.headers["etag"]}
        )

        # Then the API sends the bytes the record describes, and the object is in the bucket
        assert response.status_code == 200
        digest = hashlib.sha256(response.content).hexdigest()
        assert digest == output["sha256"] and response.headers["etag"] == f'"{digest}"'
        assert response.headers["content-type"] == "image/png"
        assert response.content.startswith(b"\x89PNG")
        assert again.status_code == 304 and again.content == b""
        record = await api.kiln.engine.store.get(task["id"])
        assert record is not None and record.result is not None
        stored = StoredOutput.from_json(record.result["outputs"][0])
        assert stored.key.startswith(f"tasks/{task['id']}/")
        assert await verify(api.kiln.storage, stored)
        listed = [info.key async for info in api.kiln.storage.list(f"tasks/{task['id']}/")]
        assert stored.key in listed


async def test_presigned_mode_redirects_to_a_url_that_serves_the_same_bytes(
    settings: Settings, s3_server: S3Server, tmp_path: Path
) -> None:
    # Given the API configured from the environment for S3 storage and presigned outputs
    presigned = Settings.from_env(
        {
            "KILN_DATA_DIR": str(tmp_path),
            "KILN_DATABASE_URL": settings.resolved_database_url,
            "KILN_STORAGE_URL": s3_server.url("api"),
            "KILN_OUTPUT_URLS": "presigned",
            "KILN_PRESIGN_TTL_S": "120",
        }
    )
    async with running_api(presigned, workers=1) as api:
        task = await _finished(api)
        output = task["result"]["outputs"][0]

        # When the output is fetched, and the redirect followed by a client with no credentials
        response = await api.client.get(output["url"])
        cached = await api.client.get(
            output["url"], headers={"If-None-Match": f'"{output["sha256"]}"'}
        )
        location = response.headers["location"]
        async with httpx.AsyncClient() as outside:
            fetched = await outside.get(location)

    # Then the API answers 307 to a signed URL of the bucket, valid 120 s, that serves
    # the same bytes; a client holding the current ETag still gets 304
    assert response.status_code == 307 and response.content == b""
    assert response.headers["etag"] == f'"{output["sha256"]}"'
    assert response.headers["cache-control"] == "no-store"
    assert location.startswith(f"{s3_server.endpoint_url}/{s3_server.bucket}/")
    assert parse_qs(urlparse(location).query)["X-Amz-Expires"] == ["120"]
    assert fetched.status_code == 200
    assert hashlib.sha256(fetched.content).hexdigest() == output["sha256"]
    assert len(fetched.content) == output["size"]
    assert fetched.headers["content-type"] == "image/png"
    assert cached.status_code == 304


async def test_presigned_mode_on_a_local_folder_streams_the_bytes(settings: Settings) -> None:
    # Given presigned outputs on storage that cannot presign (a local folder)
    async with running_api(settings.with_(output_urls="presigned"), workers=1) as api:
        task = await _finished(api)
        output = task["result"]["outputs"][0]

        # When the output is fetched
        response = await api.client.get(output["url"])

    # Then the API sends the bytes itself
    assert response.status_code == 200
    assert hashlib.sha256(response.content).hexdigest() == output["sha256"]
