"""The Storage protocol: where outputs live, and how a complete attempt is recognised.

Layout: ``tasks/<task id>/<attempt>-<epoch>/<output name>`` plus ``manifest.json``
written last, so recovery and reconciliation can tell a complete upload from a torn one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from kiln.models import StoredOutput

MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    #: When the object was last written (seconds since the epoch), where the backend says.
    modified_at: float | None = None


class Storage(Protocol):
    """A flat key space of immutable objects with atomic writes."""

    url: str

    async def put(self, key: str, data: bytes) -> None: ...

    async def get(self, key: str) -> bytes: ...

    async def stat(self, key: str) -> ObjectInfo | None: ...

    async def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, streamed page by page in key order
        (on a server that lists folder by folder, in path order: see S3Storage.list), so
        one folder's objects always come together."""
        ...

    def local_path(self, key: str) -> Path | None: ...

    async def presign(self, key: str, ttl_s: float) -> str | None:
        """A URL that fetches ``key`` without credentials for ``ttl_s`` seconds, or None
        when this storage cannot make one (the API then serves the bytes itself)."""
        ...


class StorageWrapper:
    """A Storage that hands every call to ``inner``: subclass it to change one method
    (fault injection, instrumentation) and keep the others."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    async def put(self, key: str, data: bytes) -> None:
        await self.inner.put(key, data)

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def stat(self, key: str) -> ObjectInfo | None:
        return await self.inner.stat(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        async for info in self.inner.list(prefix):
            yield info

    def local_path(self, key: str) -> Path | None:
        return self.inner.local_path(key)

    async def presign(self, key: str, ttl_s: float) -> str | None:
        return await self.inner.presign(key, ttl_s)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def verify(storage: Storage, output: StoredOutput) -> bool:
    """True when the object exists with the recorded size and sha256."""
    info = await storage.stat(output.key)
    if info is None or info.size != output.size:
        return False
    try:
        data = await storage.get(output.key)
    except FileNotFoundError:
        return False
    return len(data) == output.size and sha256_hex(data) == output.sha256


def manifest_bytes(outputs: Sequence[StoredOutput], *, flagged: bool) -> bytes:
    body = {"outputs": [o.to_json() for o in outputs], "flagged": flagged}
    return json.dumps(body, sort_keys=True).encode()


async def write_manifest(
    storage: Storage, prefix: str, outputs: list[StoredOutput], *, flagged: bool
) -> None:
    await storage.put(f"{prefix}/{MANIFEST}", manifest_bytes(outputs, flagged=flagged))


async def upload(
    storage: Storage, prefix: str, outputs: Sequence[tuple[StoredOutput, bytes]], *, flagged: bool
) -> StoredOutput | None:
    """Store an attempt's outputs at ``prefix``: each one written and verified (size and
    sha256 read back), then the manifest, written last. Returns the first output that did
    not verify (nothing more is written then), or None when every output and the manifest
    are stored. No outputs, no manifest: there is nothing for recovery to find.

    A local folder does it all in one call of a worker thread (:meth:`LocalStorage.upload`);
    any other storage, wrappers of a local folder included, through its own put and get:
    an object just written is read back whole anyway, so no stat goes before the get (on
    S3, one request less per output than :func:`verify`)."""
    if not outputs:
        return None
    manifest = (f"{prefix}/{MANIFEST}", manifest_bytes([o for o, _ in outputs], flagged=flagged))
    from kiln.storage.local import LocalStorage  # here: local.py imports this module

    if type(storage) is LocalStorage:
        return await storage.upload(outputs, manifest)
    for output, data in outputs:
        await storage.put(output.key, data)
        if not await _reads_back(storage, output):
            return output
    await storage.put(*manifest)
    return None


async def _reads_back(storage: Storage, output: StoredOutput) -> bool:
    try:
        data = await storage.get(output.key)
    except FileNotFoundError:
        return False
    return len(data) == output.size and sha256_hex(data) == output.sha256


async def read_complete_manifest(storage: Storage, prefix: str) -> list[StoredOutput] | None:
    """The outputs of a complete, verified, unflagged upload at ``prefix``; else None."""
    try:
        raw = await storage.get(f"{prefix}/{MANIFEST}")
        body = json.loads(raw)
        outputs = [StoredOutput.from_json(item) for item in body["outputs"]]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    if body.get("flagged") or not outputs:
        return None
    for output in outputs:
        if not output.key.startswith(prefix + "/") or not await verify(storage, output):
            return None
    return outputs


def open_storage(url: str) -> Storage:
    """Open the storage a URL names: ``file:///abs/path``, a plain directory path, or
    ``s3://bucket/prefix?endpoint_url=...`` (see :mod:`kiln.storage.s3`)."""
    parsed = urlparse(url)
    if parsed.scheme in ("file", ""):
        from kiln.storage.local import LocalStorage

        path = parsed.path if parsed.scheme == "file" else url
        return LocalStorage(Path(path))
    if parsed.scheme == "s3":
        from kiln.storage.s3 import S3Storage

        return S3Storage.from_url(url)
    raise ValueError(
        f"unsupported storage URL {url!r}: use file:///path or s3://bucket/prefix?endpoint_url=..."
    )
