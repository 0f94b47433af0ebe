"""Reading a task's input: from ``inputs/`` by its sha256, or where its ``key`` says."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import inputs
from kiln.errors import Permanent
from kiln.storage import sha256_hex
from kiln.storage.local import LocalStorage

DATA = b"\x89PNG not really, but bytes all the same"


def _record(**extra: object) -> dict[str, object]:
    return {"name": "image", "content_type": "image/png", "size": len(DATA),
            "sha256": sha256_hex(DATA), **extra}  # fmt: skip


async def test_an_upload_is_read_from_inputs_by_its_sha256(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    await storage.put(inputs.input_key(sha256_hex(DATA)), DATA)
    assert await inputs.load(storage, _record()) == DATA


async def test_a_record_with_a_key_is_read_where_the_key_says(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    await storage.put("tasks/tsk_1/image.png", DATA)
    assert await inputs.load(storage, _record(key="tasks/tsk_1/image.png")) == DATA
    with pytest.raises(Permanent) as missing:  # nothing under inputs/ for that record
        await inputs.load(storage, _record())
    assert missing.value.code == "input_missing"


async def test_a_keyed_object_that_changed_is_corrupt(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    await storage.put("tasks/tsk_1/image.png", DATA + b"!")
    with pytest.raises(Permanent) as corrupt:
        await inputs.load(storage, _record(key="tasks/tsk_1/image.png", size=len(DATA) + 1))
    assert corrupt.value.code == "input_corrupt"
