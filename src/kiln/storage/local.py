"""Local directory storage: temp file, fsync, rename; readers never see a torn object."""

from __future__ import annotations

import asyncio
import builtins
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from kiln.storage import ObjectInfo


class LocalStorage:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(part in ("", ".", "..") for part in parts) or "\\" in key:
            raise ValueError(f"invalid object key {key!r}")
        return self.root.joinpath(*parts)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    async def presign(self, key: str, ttl_s: float) -> str | None:
        self._path(key)
        return None  # a folder has no URL of its own: the API serves the bytes

    async def put(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, self._path(key), data)

    def _put(self, path: Path, data: bytes) -> None:
        created = self._make_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        # A new directory's own entry lives in its parent: make those durable too, so a
        # power cut cannot lose a folder whose files were acknowledged.
        for folder in created:
            _fsync_dir(folder.parent)

    def _make_dirs(self, folder: Path) -> list[Path]:
        """Create ``folder`` and missing parents below the root; return those created."""
        missing = []
        while folder != self.root and not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for created in reversed(missing):
            created.mkdir(exist_ok=True)
        return missing

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._path(key).read_bytes)

    async def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            found = await asyncio.to_thread(path.stat)
        except FileNotFoundError:
            return None
        return ObjectInfo(key, found.st_size, found.st_mtime)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, missing_ok=True)

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        base = self.root
        found = await asyncio.to_thread(self._walk, base, prefix)
        for info in found:
            yield info

    def _walk(self, base: Path, prefix: str) -> builtins.list[ObjectInfo]:
        start = base / prefix.rsplit("/", 1)[0] if "/" in prefix else base
        found = []
        for dirpath, _dirs, files in os.walk(start):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                path = Path(dirpath) / name
                key = path.relative_to(base).as_posix()
                if key.startswith(prefix):
                    stat = path.stat()
                    found.append(ObjectInfo(key, stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda info: info.key)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
