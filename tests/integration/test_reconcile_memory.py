"""A reconciliation pass holds a page, not the bucket: its peak memory must not grow with
the number of objects it reads."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import kiln
from kiln.config import Settings
from kiln.reconcile import Options, reconcile
from kiln.storage import ObjectInfo

EXAMPLES = 100


class ListedStorage:
    """A bucket of ``count`` synthetic objects, made one at a time as they are listed:
    each task id has an attempt's image and manifest; the store knows none of them."""

    def __init__(self, root: Path, count: int) -> None:
        self.url = root.as_uri()
        self.count = count
        self.modified_at = time.time()

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        for n in range(self.count):
            name = "image.png" if n % 2 == 0 else "manifest.json"
            key = f"tasks/tsk_{n // 2:026d}/1-1/{name}"
            if key.startswith(prefix):
                yield ObjectInfo(key, 1000 + n % 7, self.modified_at)

    async def stat(self, key: str) -> ObjectInfo | None:
        return None

    async def get(self, key: str) -> bytes:
        raise FileNotFoundError(key)

    async def put(self, key: str, data: bytes) -> None:
        raise AssertionError("a report-only pass writes nothing")

    async def delete(self, key: str) -> None:
        raise AssertionError("a report-only pass deletes nothing")

    def local_path(self, key: str) -> Path | None:
        return None

    async def presign(self, key: str, ttl_s: float) -> str | None:
        return None


async def _peak_bytes(settings: Settings, tmp_path: Path, count: int) -> int:
    """Peak traced memory of one report-only pass over ``count`` objects."""
    storage = ListedStorage(tmp_path, count)
    async with kiln.App(settings=settings, storage_backend=storage) as app:
        await app.engine.store.last_seq()  # opened before measuring
        tracemalloc.start()
        try:
            report = await reconcile(app, Options(examples=EXAMPLES))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert report.objects_checked == report.orphan_count == count
    assert report.orphan_bytes == sum(1000 + n % 7 for n in range(count))
    assert len(report.orphans) == EXAMPLES and report.truncated
    return peak


def _bytes_to_hold_keys(count: int) -> int:
    """What a set of every listed key (the pass before it streamed) takes."""
    tracemalloc.start()
    try:
        keys = {f"tasks/tsk_{n // 2:026d}/1-1/image-or-manifest" for n in range(count)}
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(keys) == count // 2
    return held


async def test_a_pass_over_60k_objects_peaks_no_higher_than_one_over_6k(
    settings: Settings, tmp_path: Path
) -> None:
    # Given listings of 6,000 and of 60,000 objects (30,000 task ids)
    # When one report-only pass reads each
    small = await _peak_bytes(settings, tmp_path, 6_000)
    large = await _peak_bytes(settings, tmp_path, 60_000)

    # Then ten times the objects cost no more memory at the peak (a page, not the bucket)
    assert large < small * 1.25 + 256 * 1024, (small, large)
    # And far less than holding the keys of the listing would take
    assert large < _bytes_to_hold_keys(60_000) / 4, (large, _bytes_to_hold_keys(60_000))
