"""Local directory storage: temp file, fsync, rename; readers never see a torn object."""

from __future__ import annotations

import asyncio
import builtins
import itertools
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from kiln.errors import StorageError
from kiln.storage import ObjectInfo

#: Objects a listing reads per step in its worker thread.
LIST_PAGE = 1000


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
        path = self._path(key)
        try:
            await asyncio.to_thread(self._put, path, data)
        except OSError as exc:  # a full disk, a lost mount: an outage, not the task's fault
            raise StorageError(f"writing {key!r} to {self.root} failed: {exc}") from exc

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
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise  # the protocol's "no such object"
        except OSError as exc:
            raise StorageError(f"reading {key!r} from {self.root} failed: {exc}") from exc

    async def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            found = await asyncio.to_thread(path.stat)
        except FileNotFoundError:
            return None
        return ObjectInfo(key, found.st_size, found.st_mtime)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except OSError as exc:
            raise StorageError(f"deleting {key!r} from {self.root} failed: {exc}") from exc

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in key order, read a page at a time.

        The walk goes folder by folder and sorts one folder's names at a time (a folder
        sorts as its name plus ``/``, which is where its keys fall), so it holds the names
        of the folders on its current path, never the whole tree.
        """
        walk = self._walk(prefix)
        while True:
            page = await asyncio.to_thread(_take, walk, LIST_PAGE)
            for info in page:
                yield info
            if len(page) < LIST_PAGE:
                return

    def _walk(self, prefix: str) -> Iterator[ObjectInfo]:
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if not folder:
            return self._walk_folder(self.root, "", prefix)
        return self._walk_folder(self._path(folder), folder + "/", prefix)

    def _walk_folder(self, path: Path, key_prefix: str, prefix: str) -> Iterator[ObjectInfo]:
        try:
            with os.scandir(path) as found:
                names = sorted(
                    entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name
                    for entry in found
                )
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            key = key_prefix + name
            if name.endswith("/"):
                if key.startswith(prefix) or prefix.startswith(key):
                    yield from self._walk_folder(path / name[:-1], key, prefix)
            elif key.startswith(prefix) and not name.startswith(".tmp-"):
                try:
                    stat = (path / name).stat()
                except FileNotFoundError:
                    continue  # deleted since the folder was read
                yield ObjectInfo(key, stat.st_size, stat.st_mtime)


def _take(items: Iterator[ObjectInfo], count: int) -> builtins.list[ObjectInfo]:
    return builtins.list(itertools.islice(items, count))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
