"""S3-compatible object storage through obstore.

``s3://bucket/prefix?endpoint_url=http://host:port``: keys live under ``prefix`` (optional)
in ``bucket``. Credentials and region come from the usual ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION`` (default ``us-east-1``), which obstore reads
itself. With ``endpoint_url`` (SeaweedFS, MinIO, Ceph ...) requests use path-style
addressing, and plain HTTP when that URL says ``http://``.

A PUT is atomic on S3, so readers never see a torn object, as with LocalStorage. Objects
above ``multipart_threshold_bytes`` go up as a multipart upload of ``part_size_bytes``
parts. Every request has a connect timeout, a request timeout and a bounded retry budget,
so an unreachable endpoint surfaces as :class:`~kiln.errors.StorageError` instead of
hanging the worker's upload.
"""

from __future__ import annotations

import mimetypes
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

import obstore
from obstore.exceptions import BaseError
from obstore.store import S3Store

from kiln.errors import StorageError
from kiln.storage import ObjectInfo

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from obstore.store import ClientConfig, RetryConfig, S3Config

MIB = 1024 * 1024
MIN_PART_SIZE_BYTES = 5 * MIB  # S3's smallest part (all but the last); SeaweedFS enforces it
QUERY_OPTIONS = frozenset({"endpoint_url"})
LIST_PAGE = 1000  # keys per listing request, the most S3 answers with


def check_key(key: str) -> str:
    """``key`` if it is a relative path of plain segments; ValueError otherwise."""
    parts = key.split("/")
    if not key or any(part in ("", ".", "..") for part in parts) or "\\" in key:
        raise ValueError(f"invalid object key {key!r}")
    return key


def parse_s3_url(url: str) -> tuple[str, str, str | None]:
    """``s3://bucket/prefix?endpoint_url=...`` → (bucket, prefix, endpoint_url)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3":
        raise ValueError(f"not an s3:// URL: {url!r}")
    if not parsed.netloc:
        raise ValueError(f"S3 storage URL {url!r} names no bucket: use s3://bucket/prefix")
    prefix = parsed.path.strip("/")
    if prefix:
        check_key(prefix)
    query = parse_qs(parsed.query, keep_blank_values=True)
    unknown = sorted(set(query) - QUERY_OPTIONS)
    if unknown:
        raise ValueError(f"S3 storage URL {url!r}: unknown option {unknown[0]!r}")
    endpoints = query.get("endpoint_url", [])
    if len(endpoints) > 1 or (endpoints and not endpoints[0]):
        raise ValueError(f"S3 storage URL {url!r}: give endpoint_url once, with a value")
    endpoint = endpoints[0] if endpoints else None
    if endpoint is not None and urlparse(endpoint).scheme not in ("http", "https"):
        raise ValueError(f"S3 endpoint_url {endpoint!r} must be an http:// or https:// URL")
    return parsed.netloc, prefix, endpoint


@dataclass(frozen=True, slots=True)
class S3Options:
    """Tuning of the S3 client; the defaults suit a worker uploading generated images."""

    multipart_threshold_bytes: int = 8 * MIB
    part_size_bytes: int = 8 * MIB
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    max_retries: int = 3
    retry_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.part_size_bytes < MIN_PART_SIZE_BYTES:
            raise ValueError(f"part_size_bytes must be at least {MIN_PART_SIZE_BYTES}")

    def client(self) -> ClientConfig:
        return {
            "connect_timeout": timedelta(seconds=self.connect_timeout_s),
            "timeout": timedelta(seconds=self.request_timeout_s),
        }

    def retry(self) -> RetryConfig:
        return {
            "max_retries": self.max_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(milliseconds=100),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
        }


class S3Storage:
    """Storage in an S3 bucket (AWS or any S3-compatible server)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        options: S3Options | None = None,
        url: str | None = None,
    ) -> None:
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.options = options or S3Options()
        self.url = url or _url(bucket, prefix, endpoint_url)
        client = self.options.client()
        config: S3Config = {}
        if endpoint_url is not None:  # an S3-compatible server: path-style, HTTP if it says so
            config = {"endpoint": endpoint_url, "virtual_hosted_style_request": False}
            client["allow_http"] = endpoint_url.startswith("http://")
        self.store = S3Store(
            bucket,
            prefix=prefix or None,
            config=config,
            client_options=client,
            retry_config=self.options.retry(),
        )

    @classmethod
    def from_url(cls, url: str, options: S3Options | None = None) -> S3Storage:
        """The storage ``s3://bucket/prefix?endpoint_url=...`` names (see the module doc)."""
        bucket, prefix, endpoint = parse_s3_url(url)
        return cls(bucket, prefix, endpoint_url=endpoint, options=options, url=url)

    def local_path(self, key: str) -> Path | None:
        check_key(key)
        return None

    async def put(self, key: str, data: bytes) -> None:
        content_type = mimetypes.guess_type(check_key(key))[0] or "application/octet-stream"
        multipart = len(data) > self.options.multipart_threshold_bytes
        try:
            await obstore.put_async(
                self.store,
                key,
                data,
                attributes={"Content-Type": content_type},
                use_multipart=multipart,
                chunk_size=self.options.part_size_bytes,
                max_concurrency=4,
            )
        except BaseError as exc:
            raise _storage_error("put", key, exc) from exc

    async def get(self, key: str) -> bytes:
        try:
            result = await obstore.get_async(self.store, check_key(key))
            return bytes(await result.bytes_async())
        except BaseError as exc:
            raise _storage_error("get", key, exc) from exc

    async def stat(self, key: str) -> ObjectInfo | None:
        try:
            meta = await obstore.head_async(self.store, check_key(key))
        except FileNotFoundError:
            return None
        except BaseError as exc:
            raise _storage_error("stat", key, exc) from exc
        return ObjectInfo(key, meta["size"], _timestamp(meta))

    async def delete(self, key: str) -> None:
        try:
            await obstore.delete_async(self.store, check_key(key))
        except FileNotFoundError:
            return
        except BaseError as exc:
            raise _storage_error("delete", key, exc) from exc

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (a plain string prefix, as with
        LocalStorage), streamed one listing page (1,000 keys) at a time in the server's
        order, so memory stays at one page whatever the bucket holds. AWS S3 lists in key
        order. SeaweedFS lists folder by folder, a folder at its name's place (``a/x``
        before ``a-b``), which differs from key order only where a name has a character
        below ``/``. Either way one folder's objects come together."""
        # obstore matches whole path segments: list the folder part, then filter.
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        try:
            async for chunk in obstore.list(self.store, folder or None, chunk_size=LIST_PAGE):
                for meta in chunk:
                    if meta["path"].startswith(prefix):
                        yield ObjectInfo(meta["path"], meta["size"], _timestamp(meta))
        except BaseError as exc:
            raise _storage_error("list", prefix, exc) from exc

    async def presign(self, key: str, ttl_s: float) -> str | None:
        """A URL that GETs ``key`` without credentials for ``ttl_s`` seconds."""
        try:
            return await obstore.sign_async(
                self.store, "GET", check_key(key), timedelta(seconds=ttl_s)
            )
        except BaseError as exc:
            raise _storage_error("presign", key, exc) from exc


def _url(bucket: str, prefix: str, endpoint_url: str | None) -> str:
    url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return f"{url}?endpoint_url={endpoint_url}" if endpoint_url else url


def _storage_error(operation: str, key: str, exc: BaseError) -> StorageError:
    # obstore's message ends in a multi-line debug dump; its first line says what failed.
    first_line = str(exc).split("\n", 1)[0].strip()
    return StorageError(f"S3 {operation} of {key!r} failed: {first_line}")


def _timestamp(meta: Any) -> float | None:
    modified = meta.get("last_modified")
    return None if modified is None else float(modified.timestamp())
