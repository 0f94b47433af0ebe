"""The Storage protocol, run against every storage backend: a local folder, and S3 (the
session's SeaweedFS server, under a fresh prefix per test)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.errors import StorageError
from kiln.models import StoredOutput
from kiln.storage import (
    MANIFEST,
    Storage,
    open_storage,
    read_complete_manifest,
    sha256_hex,
    upload,
    verify,
    write_manifest,
)
from kiln.storage.local import LocalStorage

BACKENDS = ["local", "s3"]


@pytest.fixture(params=BACKENDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield open_storage((tmp_path / "objects").as_uri())
    else:
        yield open_storage(request.getfixturevalue("s3_server").url())


def _output(prefix: str, name: str, data: bytes) -> StoredOutput:
    return StoredOutput(name, f"{prefix}/{name}", "image/png", len(data), sha256_hex(data))


async def test_put_then_get_stat_and_delete(storage: Storage) -> None:
    await storage.put("tasks/t1/1-1/image.png", b"pixels")
    assert await storage.get("tasks/t1/1-1/image.png") == b"pixels"
    info = await storage.stat("tasks/t1/1-1/image.png")
    assert info is not None and info.size == 6
    await storage.delete("tasks/t1/1-1/image.png")
    assert await storage.stat("tasks/t1/1-1/image.png") is None
    with pytest.raises(FileNotFoundError):
        await storage.get("tasks/t1/1-1/image.png")


async def test_put_replaces_an_object_whole(storage: Storage) -> None:
    await storage.put("a/b", b"first version, longer")
    await storage.put("a/b", b"second")
    assert await storage.get("a/b") == b"second"


async def test_list_yields_the_objects_under_a_prefix_and_no_temporary_files(
    storage: Storage,
) -> None:
    for key in ("tasks/t1/1-1/image.png", "tasks/t1/1-1/manifest.json", "tasks/t2/1-1/x"):
        await storage.put(key, b"x")
    found = [info.key async for info in storage.list("tasks/t1/")]
    assert found == ["tasks/t1/1-1/image.png", "tasks/t1/1-1/manifest.json"]
    everything = [info.key async for info in storage.list("")]
    assert len(everything) == 3 and all(".tmp-" not in key for key in everything)


@pytest.mark.parametrize("key", ["", "../escape", "a/../../b", "/abs", "a//b", "a/./b", "a\\b"])
async def test_keys_that_could_leave_the_storage_are_refused(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError):
        await storage.put(key, b"x")


async def test_verify_checks_size_and_sha256(storage: Storage) -> None:
    output = _output("tasks/t1/1-1", "image.png", b"pixels")
    assert not await verify(storage, output)  # missing
    await storage.put(output.key, b"pixels")
    assert await verify(storage, output)
    await storage.put(output.key, b"pixelz")  # same size, other bytes
    assert not await verify(storage, output)


async def test_upload_stores_each_output_then_a_manifest_that_recovery_recognises(
    storage: Storage,
) -> None:
    # Given an attempt's two outputs
    prefix = "tasks/t1/1-1"
    files = [(_output(prefix, name, data), data) for name, data in [("a.png", b"A"), ("b", b"BB")]]
    # When they are uploaded
    assert await upload(storage, prefix, files, flagged=False) is None
    # Then each is stored whole and the manifest lists them, and no temporary file is left
    for output, data in files:
        assert await storage.get(output.key) == data
    assert await read_complete_manifest(storage, prefix) == [output for output, _ in files]
    keys = [info.key async for info in storage.list("tasks/")]
    assert keys == ["tasks/t1/1-1/a.png", "tasks/t1/1-1/b", f"tasks/t1/1-1/{MANIFEST}"]


async def test_upload_stops_at_an_output_that_does_not_verify(storage: Storage) -> None:
    # Given a second output whose recorded sha256 is not that of its bytes
    prefix = "tasks/t1/2-2"
    good = _output(prefix, "a.png", b"A")
    bad = StoredOutput("b.png", f"{prefix}/b.png", "image/png", 2, sha256_hex(b"XX"))
    # When they are uploaded
    failed = await upload(storage, prefix, [(good, b"A"), (bad, b"BB")], flagged=False)
    # Then the upload names it, and writes no manifest that recovery could trust
    assert failed == bad
    assert await storage.stat(f"{prefix}/{MANIFEST}") is None
    assert await read_complete_manifest(storage, prefix) is None


async def test_upload_of_no_outputs_writes_nothing(storage: Storage) -> None:
    assert await upload(storage, "tasks/t1/1-1", [], flagged=False) is None
    assert [info.key async for info in storage.list("")] == []


async def test_a_flagged_upload_is_not_recovered(storage: Storage) -> None:
    prefix = "tasks/t1/1-1"
    output = _output(prefix, "a.png", b"A")
    assert await upload(storage, prefix, [(output, b"A")], flagged=True) is None
    assert await storage.get(output.key) == b"A"
    assert await read_complete_manifest(storage, prefix) is None


async def test_complete_manifest_is_recognised_and_a_torn_one_is_not(storage: Storage) -> None:
    prefix = "tasks/t1/2-3"
    output = _output(prefix, "image.png", b"pixels")
    await storage.put(output.key, b"pixels")
    assert await read_complete_manifest(storage, prefix) is None  # manifest not written yet
    await write_manifest(storage, prefix, [output], flagged=False)
    assert await read_complete_manifest(storage, prefix) == [output]
    await storage.delete(output.key)  # an object lost after the manifest
    assert await read_complete_manifest(storage, prefix) is None


async def test_flagged_or_misplaced_manifest_is_not_recovered(storage: Storage) -> None:
    prefix = "tasks/t1/1-1"
    output = _output(prefix, "image.png", b"pixels")
    await storage.put(output.key, b"pixels")
    await write_manifest(storage, prefix, [output], flagged=True)
    assert await read_complete_manifest(storage, prefix) is None
    elsewhere = _output("tasks/t1/9-9", "image.png", b"pixels")
    await storage.put(elsewhere.key, b"pixels")
    await write_manifest(storage, prefix, [elsewhere], flagged=False)
    assert await read_complete_manifest(storage, prefix) is None
    await storage.put(f"{prefix}/{MANIFEST}", b"{not json")
    assert await read_complete_manifest(storage, prefix) is None


async def test_a_key_never_written_is_missing_everywhere(storage: Storage) -> None:
    with pytest.raises(FileNotFoundError):
        await storage.get("tasks/none/1-1/image.png")
    assert await storage.stat("tasks/none/1-1/image.png") is None
    await storage.delete("tasks/none/1-1/image.png")  # deleting nothing is fine
    assert [info async for info in storage.list("tasks/none/")] == []


def _key_or_path_order(keys: list[str]) -> tuple[list[str], list[str]]:
    """Key order, and path order (folder by folder: how SeaweedFS lists)."""
    return sorted(keys), sorted(keys, key=lambda key: key.split("/"))


async def test_list_prefix_is_a_plain_string_prefix_and_keys_come_sorted(storage: Storage) -> None:
    keys = ["tasks/t1/a", "tasks/t10/b", "tasks/t2/c", "tasks/t1-x/d", "tasks/t1.y/e", "top"]
    for key in reversed(keys):
        await storage.put(key, key.encode())
    under_t1 = [i.key async for i in storage.list("tasks/t1")]
    assert under_t1 in _key_or_path_order(keys[:2] + keys[3:5])
    assert [i.key async for i in storage.list("")] in _key_or_path_order(keys)
    assert [i.size async for i in storage.list("top")] == [3]


async def test_local_storage_lists_in_key_order_folder_by_folder(tmp_path: Path) -> None:
    # Given names that sort below "/" beside a folder of the same stem, at three depths
    storage = LocalStorage(tmp_path)
    keys = ["a/b/c", "a/b-/c", "a/b.d", "a/b/c-", "a/b/e/d", "a-/x", "a.b", "a/bb/z", "b"]
    for key in keys:
        await storage.put(key, b"x")
    # When everything, and then one folder's stem, is listed
    everything = [info.key async for info in storage.list("")]
    under_a_b = [info.key async for info in storage.list("a/b")]
    # Then the walk yields exactly the order of the sorted keys
    assert everything == sorted(keys)
    assert under_a_b == sorted(k for k in keys if k.startswith("a/b"))


async def test_list_pages_through_more_objects_than_one_listing_page(storage: Storage) -> None:
    # S3 servers answer a listing 1,000 keys at a time: 1,100 objects need a second page.
    keys = [f"tasks/many/{n:05d}" for n in range(1100)]
    slots = asyncio.Semaphore(32)

    async def put(key: str) -> None:
        async with slots:
            await storage.put(key, b"x")

    await asyncio.gather(*(put(key) for key in keys))
    await storage.put("tasks/other/1", b"x")

    found = [info.key async for info in storage.list("tasks/many/")]

    assert found == keys


async def test_stat_and_list_tell_when_an_object_was_written(storage: Storage) -> None:
    # Given an object written now
    before = time.time()
    await storage.put("tasks/t9/1-1/image.png", b"pixels")
    after = time.time()
    # Then stat and list carry its write time (S3 keeps whole seconds)
    info = await storage.stat("tasks/t9/1-1/image.png")
    listed = [i async for i in storage.list("tasks/t9/")]
    for found in (info, *listed):
        assert found is not None and found.modified_at is not None
        assert before - 2 <= found.modified_at <= after + 2


async def test_local_storage_reports_a_failing_disk_as_a_storage_error(tmp_path: Path) -> None:
    # Given a storage whose folder for a new object cannot be made (a file is in the way,
    # as a broken disk or mount would refuse it)
    root = tmp_path / "results"
    storage = LocalStorage(root)
    await storage.put("tasks/a/1-1/image.png", b"png")
    (root / "tasks" / "b").write_bytes(b"not a folder")
    # Then the write fails as the storage's own error (retryable, counted by the breaker),
    # a missing object stays FileNotFoundError, and nothing half-written is left
    with pytest.raises(StorageError, match=r"writing 'tasks/b/1-1/image\.png'"):
        await storage.put("tasks/b/1-1/image.png", b"png")
    with pytest.raises(FileNotFoundError):
        await storage.get("tasks/c/1-1/image.png")
    assert [i.key async for i in storage.list("tasks/")] == ["tasks/a/1-1/image.png", "tasks/b"]


async def test_local_upload_makes_every_file_and_folder_durable_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a local storage that holds other tasks, whose fsyncs are recorded
    storage = LocalStorage(tmp_path / "results")
    await storage.put("tasks/t0/1-1/a.png", b"0")
    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    prefix = "tasks/t1/1-1"
    # When an attempt's output and manifest go up in one call
    assert await upload(storage, prefix, [(_output(prefix, "a.png", b"A"), b"A")],
                        flagged=False) is None  # fmt: skip
    # Then both files were fsynced before their rename, and then, once each, the attempt's
    # folder and the parents of the two folders it made (their names live there)
    root = storage.root
    files = [path for path in synced if ".tmp-" in path]
    assert len(files) == 2
    assert sorted(synced[2:]) == [str(root / "tasks"), str(root / "tasks/t1"), str(root / prefix)]


async def test_local_upload_reports_a_failing_disk_as_a_storage_error(tmp_path: Path) -> None:
    # Given a storage where a file stands where the task's folder should be
    root = tmp_path / "results"
    storage = LocalStorage(root)
    (root / "tasks").mkdir()
    (root / "tasks" / "b").write_bytes(b"not a folder")
    prefix = "tasks/b/1-1"
    # Then the upload fails as the storage's own error, naming the key
    with pytest.raises(StorageError, match=r"writing 'tasks/b/1-1/image\.png'"):
        await upload(storage, prefix, [(_output(prefix, "image.png", b"A"), b"A")],
                     flagged=False)  # fmt: skip
