"""The asset book: a tenant's v2 assets over kiln's content-addressed inputs.

The bytes are kiln inputs (``inputs/<sha256>``, kept once per content, pinned while they
are written: :mod:`kiln.inputs`). Each asset's record (its UUID, the blake3 hash v2 uses,
size, content type, file name) is a small JSON object in the storage, under the tenant's
own folder, with one index object per content (blake3 → asset id), so that one tenant
never finds another's asset, by id or by hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from blake3 import blake3

from kiln import inputs
from kiln.api.comfy.errors import V2Error
from kiln.app import App
from kiln.errors import NotFound
from kiln.models import JSON
from kiln.storage import sha256_hex

ASSETS_PREFIX = "comfy/assets/"
BY_HASH_PREFIX = "comfy/by-hash/"
HASH_PATTERN = re.compile(r"blake3:[0-9a-f]{64}")
ID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: blake3 hashes of outputs (by sha256) this process computed, newest kept.
BLAKE3_MEMO = 4096


def blake3_of(data: bytes) -> str:
    return "blake3:" + blake3(data).hexdigest()


def tenant_folder(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class AssetRecord:
    id: str
    tenant: str
    sha256: str
    hash: str
    size_bytes: int
    content_type: str
    file_path: str
    created_at: float
    tags: list[str] = field(default_factory=list)

    def input_record(self, name: str) -> JSON:
        """The kiln input record of this asset under ``name``."""
        return {
            "name": name,
            "content_type": self.content_type,
            "size": self.size_bytes,
            "sha256": self.sha256,
        }


def normal_hash(value: str) -> str:
    """``blake3:<hex>`` in lower case; 400 when it is not one."""
    found = value.strip().lower()
    if HASH_PATTERN.fullmatch(found) is None:
        raise V2Error("invalid_request", "a hash is 'blake3:' and 64 hex digits", 400)
    return found


class AssetBook:
    """Asset records and bytes of every tenant (see the module doc)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self._blake3: OrderedDict[str, str] = OrderedDict()

    def _record_key(self, tenant: str, asset_id: str) -> str:
        return f"{ASSETS_PREFIX}{tenant_folder(tenant)}/{asset_id}.json"

    def _hash_key(self, tenant: str, digest: str) -> str:
        return f"{BY_HASH_PREFIX}{tenant_folder(tenant)}/{digest.removeprefix('blake3:')}"

    async def _read(self, key: str) -> bytes | None:
        storage = self.app.storage
        if await storage.stat(key) is None:
            return None
        try:
            return await storage.get(key)
        except FileNotFoundError:
            return None

    async def get(self, tenant: str, asset_id: str) -> AssetRecord:
        """The tenant's asset ``asset_id``; NotFound otherwise (another tenant's too)."""
        raw = None
        if ID_PATTERN.fullmatch(asset_id):
            raw = await self._read(self._record_key(tenant, asset_id))
        if raw is None:
            raise NotFound(f"no asset {asset_id}")
        return AssetRecord(**json.loads(raw))

    async def by_hash(self, tenant: str, digest: str) -> AssetRecord | None:
        """The tenant's asset with this content whose bytes are still kept, or None."""
        raw = await self._read(self._hash_key(tenant, normal_hash(digest)))
        if raw is None:
            return None
        try:
            found = await self.get(tenant, raw.decode())
        except NotFound:
            return None
        if not await self.stored(found):
            return None
        return found

    async def stored(self, record: AssetRecord) -> bool:
        info = await self.app.storage.stat(inputs.input_key(record.sha256))
        return info is not None and info.size == record.size_bytes

    async def add(
        self, tenant: str, data: bytes, *, content_type: str, file_path: str, tags: list[str]
    ) -> tuple[AssetRecord, bool]:
        """Keep ``data`` as the tenant's asset: (its record, True when it is new to the
        tenant). Content the tenant already has answers its existing asset."""
        digest = blake3_of(data)
        existing = await self.by_hash(tenant, digest)
        if existing is not None:
            return existing, False
        sha256 = sha256_hex(data)
        storage = self.app.storage
        async with self.app.pinned([(sha256, data)], drop=False):
            record = AssetRecord(
                id=str(uuid.uuid4()),
                tenant=tenant,
                sha256=sha256,
                hash=digest,
                size_bytes=len(data),
                content_type=content_type,
                file_path=file_path,
                created_at=self.app.now(),
                tags=tags,
            )
            await storage.put(self._record_key(tenant, record.id), _encoded(record))
            await storage.put(self._hash_key(tenant, digest), record.id.encode())
        return record, True

    async def delete(self, tenant: str, asset_id: str) -> None:
        """Forget the asset (NotFound when the tenant has none): its record and index go;
        its bytes stay while a task uses them, until input retention collects them."""
        record = await self.get(tenant, asset_id)
        storage = self.app.storage
        index = self._hash_key(tenant, record.hash)
        if await self._read(index) == record.id.encode():
            await storage.delete(index)
        await storage.delete(self._record_key(tenant, record.id))

    async def content(self, sha256: str, size: int, key: str | None = None) -> bytes:
        """The bytes (of an input, or of the object ``key``), checked against size and
        sha256; 404 ``output_unavailable`` when they are gone."""
        data = await self._read(key or inputs.input_key(sha256))
        if data is None or len(data) != size or sha256_hex(data) != sha256:
            raise V2Error(
                "output_unavailable",
                "the bytes are no longer stored (retention, or removed outside kiln); "
                "retrying cannot help: upload them again or run the job again",
            )
        return data

    async def blake3_of_object(self, key: str, sha256: str, size: int) -> str | None:
        """The blake3 of a stored output (memoized by sha256), or None when it is gone."""
        found = self._blake3.get(sha256)
        if found is not None:
            self._blake3.move_to_end(sha256)
            return found
        try:
            data = await self.content(sha256, size, key)
        except V2Error:
            return None
        found = await asyncio.to_thread(blake3_of, data)
        self._blake3[sha256] = found
        while len(self._blake3) > BLAKE3_MEMO:
            self._blake3.popitem(last=False)
        return found


def _encoded(record: AssetRecord) -> bytes:
    return json.dumps(asdict(record), separators=(",", ":")).encode()
