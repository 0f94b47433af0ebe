"""What only S3 storage does: URLs, multipart uploads, presigned URLs, credentials, and
bounded failure when the endpoint is down. The protocol itself is tested for every backend
in test_storage.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import obstore
import pytest

from kiln.errors import StorageError
from kiln.storage import open_storage
from kiln.storage.local import LocalStorage
from kiln.storage.s3 import MIB, S3Options, S3Storage
from services.seaweed import S3Server, closed_port

KEY = "tasks/t1/1-1/image.png"


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A port whose connections are accepted by the kernel but never answered."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


@pytest.fixture
def s3(s3_server: S3Server) -> S3Storage:
    return S3Storage.from_url(s3_server.url())


# URLs --------------------------------------------------------------------------------------


def test_open_storage_reads_bucket_prefix_and_endpoint_from_the_url() -> None:
    url = "s3://outputs/kiln/prod?endpoint_url=http://127.0.0.1:9000"
    storage = open_storage(url)
    assert isinstance(storage, S3Storage)
    assert (storage.bucket, storage.prefix, storage.endpoint_url) == (
        "outputs", "kiln/prod", "http://127.0.0.1:9000",
    )  # fmt: skip
    assert storage.url == url
    bare = open_storage("s3://outputs")
    assert isinstance(bare, S3Storage) and bare.prefix == "" and bare.endpoint_url is None


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("s3://", "names no bucket"),
        ("s3:///only/a/prefix", "names no bucket"),
        ("s3://b/p?endpoint=http://h", "unknown option 'endpoint'"),
        ("s3://b/p?endpoint_url=", "with a value"),
        ("s3://b/p?endpoint_url=ftp://h", "http:// or https://"),
        ("s3://b/a/../c", "invalid object key"),
    ],
)
def test_a_malformed_s3_url_is_refused_with_a_reason(url: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        open_storage(url)


def test_parts_smaller_than_s3_allows_are_refused() -> None:
    with pytest.raises(ValueError, match="part_size_bytes"):
        S3Options(part_size_bytes=MIB)


# Objects -----------------------------------------------------------------------------------


async def test_objects_live_under_the_prefix_and_keys_are_relative_to_it(
    s3_server: S3Server,
) -> None:
    # Given two storages on the same bucket with different prefixes, and one on the bucket
    first, second = (S3Storage.from_url(s3_server.url()) for _ in range(2))
    whole_bucket = S3Storage(s3_server.bucket, endpoint_url=s3_server.endpoint_url)

    # When one writes an object
    await first.put(KEY, b"pixels")

    # Then the other does not see it, and the bucket holds it under the first one's prefix
    assert [i.key async for i in first.list("")] == [KEY]
    assert [i.key async for i in second.list("")] == []
    assert await second.stat(KEY) is None
    assert await whole_bucket.get(f"{first.prefix}/{KEY}") == b"pixels"


async def test_objects_above_the_threshold_go_up_in_parts_and_read_back_whole(
    s3_server: S3Server,
) -> None:
    # Given a 1 MiB multipart threshold and 5 MiB parts
    options = S3Options(multipart_threshold_bytes=MIB, part_size_bytes=5 * MIB)
    storage = S3Storage.from_url(s3_server.url(), options)
    big = os.urandom(12 * MIB)
    small = os.urandom(MIB)

    # When a 12 MiB and a 1 MiB object are written
    await storage.put("tasks/t1/1-1/big.bin", big)
    await storage.put("tasks/t1/1-1/small.bin", small)

    # Then the big one was a three-part upload (S3 ETags of those end in -<parts>) that
    # reads back byte for byte, and the small one a single PUT
    big_meta = await obstore.head_async(storage.store, "tasks/t1/1-1/big.bin")
    small_meta = await obstore.head_async(storage.store, "tasks/t1/1-1/small.bin")
    assert big_meta["e_tag"] is not None and big_meta["e_tag"].strip('"').endswith("-3")
    assert small_meta["e_tag"] is not None and "-" not in small_meta["e_tag"]
    got = await storage.get("tasks/t1/1-1/big.bin")
    assert hashlib.sha256(got).digest() == hashlib.sha256(big).digest()
    info = await storage.stat("tasks/t1/1-1/big.bin")
    assert info is not None and info.size == 12 * MIB
    assert await storage.get("tasks/t1/1-1/small.bin") == small


async def test_objects_carry_a_content_type_from_their_name(s3: S3Storage) -> None:
    for key in (KEY, "tasks/t1/1-1/image.jpg", "tasks/t1/1-1/manifest.json", "a/noext"):
        await s3.put(key, b"x")
    types = {
        key: (await obstore.get_async(s3.store, key)).attributes.get("Content-Type")
        for key in (KEY, "tasks/t1/1-1/image.jpg", "tasks/t1/1-1/manifest.json", "a/noext")
    }
    assert types == {
        KEY: "image/png",
        "tasks/t1/1-1/image.jpg": "image/jpeg",
        "tasks/t1/1-1/manifest.json": "application/json",
        "a/noext": "application/octet-stream",
    }


# Presigned URLs ----------------------------------------------------------------------------


async def test_a_presigned_url_fetches_the_bytes_without_credentials(s3: S3Storage) -> None:
    # Given an object
    data = os.urandom(4096)
    await s3.put(KEY, data)

    # When it is presigned for two minutes and fetched by a plain HTTP client
    url = await s3.presign(KEY, 120)
    assert url is not None
    async with httpx.AsyncClient() as client:
        response = await client.get(url)
        unsigned = await client.get(url.split("?", 1)[0])

    # Then the signed URL serves the bytes; the same URL without its signature is refused
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["content-type"] == "image/png"
    assert parse_qs(urlparse(url).query)["X-Amz-Expires"] == ["120"]
    assert unsigned.status_code == 403


async def test_a_local_folder_cannot_presign(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    await storage.put(KEY, b"x")
    assert await storage.presign(KEY, 60) is None
    with pytest.raises(ValueError):
        await storage.presign("../x", 60)


async def test_presign_refuses_keys_that_could_leave_the_storage(s3: S3Storage) -> None:
    with pytest.raises(ValueError):
        await s3.presign("../other-prefix/x", 60)


# Failures ----------------------------------------------------------------------------------


async def test_wrong_credentials_fail_as_a_storage_error(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a storage opened with a secret the server does not know
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    storage = S3Storage.from_url(s3_server.url())

    # When it writes, Then the server's refusal surfaces as a StorageError
    with pytest.raises(StorageError, match="S3 put of"):
        await storage.put(KEY, b"x")


@pytest.mark.parametrize("operation", ["put", "get", "stat", "list"])
async def test_an_unreachable_endpoint_fails_quickly_with_the_default_options(
    operation: str,
) -> None:
    # Given a storage whose endpoint refuses connections, with the default retry budget
    storage = S3Storage.from_url(f"s3://kiln/p?endpoint_url=http://127.0.0.1:{closed_port()}")
    calls = {
        "put": lambda: storage.put(KEY, b"x"),
        "get": lambda: storage.get(KEY),
        "stat": lambda: storage.stat(KEY),
        "list": lambda: _drain(storage),
    }

    # When an operation runs, Then it raises StorageError within a bounded time
    started = time.monotonic()
    with pytest.raises(StorageError, match=f"S3 {operation} of"):
        async with asyncio.timeout(30):
            await calls[operation]()
    assert time.monotonic() - started < 10


async def test_a_server_that_never_answers_hits_the_request_timeout() -> None:
    # Given an endpoint that accepts connections and never answers, and a 0.5 s timeout
    options = S3Options(request_timeout_s=0.5, max_retries=1, retry_timeout_s=1.0)
    with silent_server() as port:
        storage = S3Storage.from_url(f"s3://kiln/p?endpoint_url=http://127.0.0.1:{port}", options)

        # When a put runs, Then it fails after the timeout and one retry, not never
        started = time.monotonic()
        with pytest.raises(StorageError):
            async with asyncio.timeout(30):
                await storage.put(KEY, b"x")
        elapsed_s = time.monotonic() - started
    assert 0.5 <= elapsed_s < 5


async def _drain(storage: S3Storage) -> None:
    async for _ in storage.list(""):
        pass
