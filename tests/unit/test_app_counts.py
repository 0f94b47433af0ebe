"""BatchedCounts (kiln/app_counts.py): counts that arrive together share one write, and each
caller returns only once a write holding its count is done."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from kiln.app_counts import BatchedCounts


async def test_counts_that_arrive_during_a_write_share_the_next_one() -> None:
    # Given a write that is held until the test lets it go
    writes: list[dict[str, int]] = []
    gate = asyncio.Event()

    async def write(counts: Mapping[str, int]) -> None:
        writes.append(dict(counts))
        await gate.wait()

    counts = BatchedCounts(write)
    # When one count starts a write, and 500 more arrive while it is in flight
    first = asyncio.ensure_future(counts.add("content"))
    while not writes:
        await asyncio.sleep(0)
    later = [asyncio.ensure_future(counts.add(how)) for how in ["content", "idempotency"] * 250]
    await asyncio.sleep(0)
    # Then nobody has returned before its write is done
    assert not first.done() and not any(f.done() for f in later)
    gate.set()
    await asyncio.gather(first, *later)
    # And the 500 went in one more write, summed by label
    assert writes == [{"content": 1}, {"content": 250, "idempotency": 250}]


async def test_a_failed_write_fails_the_counts_it_held_and_the_next_goes_on() -> None:
    calls = 0

    async def write(counts: Mapping[str, int]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the store is down")

    counts = BatchedCounts(write)
    with pytest.raises(RuntimeError):
        await counts.add("content")
    await counts.add("content")
    assert calls == 2
