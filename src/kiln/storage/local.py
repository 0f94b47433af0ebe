"""Local directory storage: temp file, fsync, rename; readers never see a torn object."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import itertools
import os
import tempfile
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from kiln.errors import StorageError
from kiln.models import StoredOutput
from kiln.storage import ObjectInfo, sha256_hex

T = TypeVar("T")

#: Objects a listing reads per step in its worker thread.
LIST_PAGE = 1000
#: Threads a storage's calls run on. A write waits on fsyncs (milliseconds each on a
#: virtual disk) while holding no CPU, so many run at once; the file system then commits
#: their journal updates together.
IO_THREADS = 32


class LocalStorage:
    def __init__(self, root: Path, *, io_threads: int = IO_THREADS) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()
        # Its own threads, not the event loop's default executor (a handful of threads
        # that other blocking work shares); they end with the storage object.
        self._threads = ThreadPoolExecutor(io_threads, thread_name_prefix="kiln-storage")
        weakref.finalize(self, self._threads.shutdown, wait=False)

    async def _run(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, call, *args)

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
            await self._run(self._put, path, data)
        except OSError as exc:  # a full disk, a lost mount: an outage, not the task's fault
            raise StorageError(f"writing {key!r} to {self.root} failed: {exc}") from exc

    def _put(self, path: Path, data: bytes) -> None:
        made = self._make_dirs(path.parent)
        _write(path, data)
        for folder in _unique([path.parent, *(m.parent for m in made)]):
            _fsync_dir(folder)

    async def upload(
        self, outputs: Sequence[tuple[StoredOutput, bytes]], manifest: tuple[str, bytes]
    ) -> StoredOutput | None:
        """:func:`kiln.storage.upload` in one call of a worker thread: each output written
        as :meth:`put` writes it and read back against its size and sha256, then the
        manifest, last. The folders are made once, and each folder written in (and the
        parent of each folder made) is fsynced once, at the end: when this returns, every
        file and its name are durable, as after the same puts one by one. A crash before
        that may leave the manifest's name on disk without an output's; recovery trusts a
        manifest only once every output it lists verifies, so that attempt is not used."""
        files: builtins.list[tuple[Path, bytes, StoredOutput | None]] = [
            (self._path(output.key), data, output) for output, data in outputs
        ]
        files.append((self._path(manifest[0]), manifest[1], None))
        return await self._run(self._upload, files)

    def _upload(
        self, files: builtins.list[tuple[Path, bytes, StoredOutput | None]]
    ) -> StoredOutput | None:
        written: dict[Path, None] = {}
        made: builtins.list[Path] = []
        for path, data, output in files:
            with self._failing_as_storage_error(path):
                if path.parent not in written:
                    made += self._make_dirs(path.parent)
                    written[path.parent] = None
                _write(path, data)
                if output is not None and not _holds(path, output):
                    return output
        with self._failing_as_storage_error(files[-1][0]):
            for folder in _unique([*written, *(m.parent for m in made)]):
                _fsync_dir(folder)
        return None

    @contextlib.contextmanager
    def _failing_as_storage_error(self, path: Path) -> Iterator[None]:
        try:
            yield
        except OSError as exc:  # as in put: an outage, not the task's fault
            key = path.relative_to(self.root).as_posix()
            raise StorageError(f"writing {key!r} to {self.root} failed: {exc}") from exc

    def _make_dirs(self, folder: Path) -> builtins.list[Path]:
        """Create ``folder`` and missing parents below the root; return those created,
        outermost first. One ``mkdir`` when the parent exists."""
        try:
            os.mkdir(folder)
        except FileExistsError:
            return []
        except FileNotFoundError:
            if folder == self.root or folder.parent == folder:
                raise
            made = self._make_dirs(folder.parent)
            os.makedirs(folder, exist_ok=True)  # another writer may have made it meanwhile
            return [*made, folder]
        return [folder]

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await self._run(path.read_bytes)
        except FileNotFoundError:
            raise  # the protocol's "no such object"
        except OSError as exc:
            raise StorageError(f"reading {key!r} from {self.root} failed: {exc}") from exc

    async def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            found = await self._run(path.stat)
        except FileNotFoundError:
            return None
        return ObjectInfo(key, found.st_size, found.st_mtime)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await self._run(functools.partial(path.unlink, missing_ok=True))
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
            page = await self._run(_take, walk, LIST_PAGE)
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


def _write(path: Path, data: bytes) -> None:
    """Write ``path`` whole: a temporary file beside it, fsynced, renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".part")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _holds(path: Path, output: StoredOutput) -> bool:
    """Whether the file at ``path`` has the output's size and sha256 (as verify() checks)."""
    with open(path, "rb") as handle:
        data = handle.read()
    return len(data) == output.size and sha256_hex(data) == output.sha256


def _unique(folders: builtins.list[Path]) -> builtins.list[Path]:
    return builtins.list(dict.fromkeys(folders))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
