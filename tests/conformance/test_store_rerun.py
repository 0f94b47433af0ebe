"""A rerun's link to the task it ran again (``tasks.rerun_of``) is stored on every way a
submission goes in: alone, in a concurrent batch, and with an idempotency key."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kiln.store import Store

from .factories import make_new_task

pytestmark = pytest.mark.usefixtures("queue_counts_checked")


async def test_rerun_of_is_stored_by_every_submission_path(store: Store) -> None:
    # Given an original task
    original = (await store.submit(make_new_task({"n": 0}))).task
    assert original.rerun_of is None
    # When reruns go in alone, many at once (one batch), and with a key
    alone = replace(make_new_task({"n": 1}), rerun_of=original.id)
    many = [replace(make_new_task({"n": n}), rerun_of=original.id) for n in range(2, 12)]
    keyed = replace(make_new_task({"n": 99}, idempotency_key="k"), rerun_of=original.id)
    results = [await store.submit(alone), *await asyncio.gather(*map(store.submit, many))]
    results.append(await store.submit(keyed))
    # Then each is created with its link, read back the same
    assert all(r.created for r in results)
    for result in results:
        assert result.task.rerun_of == original.id
        stored = await store.get(result.task.id)
        assert stored is not None and stored.rerun_of == original.id
