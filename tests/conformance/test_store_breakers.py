"""Circuit breaker states and the retry clock, on every backend.

Breaker rows are what every worker of every machine reads to act together; the half-open
probe goes to exactly one process (a compare-and-set). The retry clock hands out retry
slots a fixed interval apart, whichever process asks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kiln.store import BreakerRecord, Store

from .backends import Backend
from .factories import SettableClock


def record(state: str, until: float | None, at: float, by: str = "w-1") -> BreakerRecord:
    return BreakerRecord("openai-images", state, until, at, by)


async def test_a_breaker_row_is_written_read_back_and_its_transition_counted(
    store: Store,
) -> None:
    # Given no breaker row yet
    assert await store.limits.breakers() == []
    # When one process opens a breaker, then another breaker is stored closed
    opened = record("open", 130.0, 100.0)
    assert await store.limits.save_breaker(opened)
    assert await store.limits.save_breaker(BreakerRecord("storage", "closed", None, 101.0, "w-2"))
    # Then both rows read back in name order, and each transition is counted
    assert await store.limits.breakers() == [
        opened,
        BreakerRecord("storage", "closed", None, 101.0, "w-2"),
    ]
    counters = await store.counters()
    assert counters[("breaker_transitions", "openai-images>open")] == 1
    assert counters[("breaker_transitions", "storage>closed")] == 1
    # And a later write replaces the row
    assert await store.limits.save_breaker(record("closed", None, 140.0))
    assert (await store.limits.breakers())[0] == record("closed", None, 140.0)


async def test_the_probe_is_taken_only_once_the_open_period_is_over(store: Store) -> None:
    # Given a breaker open until 130
    await store.limits.save_breaker(record("open", 130.0, 100.0))
    # When a process tries to take the probe before then, it is refused
    assert not await store.limits.save_breaker(record("half_open", 160.0, 129.0), only_if_due=True)
    assert (await store.limits.breakers())[0].state == "open"
    # When it tries at 130, it takes it
    assert await store.limits.save_breaker(
        record("half_open", 160.0, 130.0, "w-2"), only_if_due=True
    )
    assert (await store.limits.breakers())[0] == record("half_open", 160.0, 130.0, "w-2")
    # And nobody else takes it while that probe's time runs
    assert not await store.limits.save_breaker(record("half_open", 170.0, 140.0), only_if_due=True)
    # A probe gone silent past its time may be taken over
    assert await store.limits.save_breaker(
        record("half_open", 190.0, 160.0, "w-3"), only_if_due=True
    )
    assert (await store.counters())[("breaker_transitions", "openai-images>half_open")] == 2


async def test_a_closed_breaker_is_not_taken_for_a_probe(store: Store) -> None:
    # Given a breaker another process has closed
    await store.limits.save_breaker(record("closed", None, 100.0))
    # When a process with a stale view tries to take its probe, nothing changes
    assert not await store.limits.save_breaker(record("half_open", 200.0, 150.0), only_if_due=True)
    assert (await store.limits.breakers())[0].state == "closed"
    # Without a row at all, the probe is taken (the row is created)
    taken = BreakerRecord("comfyui", "half_open", 200.0, 150.0, "w-1")
    assert await store.limits.save_breaker(taken, only_if_due=True)
    assert taken in await store.limits.breakers()


async def test_one_of_many_racing_processes_takes_the_probe(
    store: Store, backend: Backend, tmp_path: Path, clock: SettableClock
) -> None:
    # Given a breaker whose open period is over, and two store handles on the database
    await store.limits.save_breaker(record("open", 100.0, 50.0))
    other = backend.open(tmp_path / "store", clock)
    try:
        await other.last_seq()
        handles = [store, other]
        # When twenty processes try to take the probe at once
        won = await asyncio.gather(*(
            handles[i % 2].limits.save_breaker(record("half_open", 200.0, 150.0, f"w-{i}"),
                                        only_if_due=True)
            for i in range(20)
        ))  # fmt: skip
    finally:
        await other.close()
    # Then exactly one did, and the row names it
    assert won.count(True) == 1
    winner = f"w-{won.index(True)}"
    assert (await store.limits.breakers())[0].by == winner


async def test_retry_slots_are_spread_one_interval_apart(store: Store) -> None:
    # Given an empty retry clock, 0.1 s per retry
    # When five retries due at once take their slots
    slots = [await store.limits.reserve_retry(1000.0, 0.1) for _ in range(5)]
    # Then they are 0.1 s apart from the first due time
    assert slots == pytest.approx([1000.0, 1000.1, 1000.2, 1000.3, 1000.4])
    # And a retry due later than the next free slot keeps its own time
    assert await store.limits.reserve_retry(2000.0, 0.1) == pytest.approx(2000.0)
    assert await store.limits.reserve_retry(1500.0, 0.1) == pytest.approx(2000.1)


async def test_retry_slots_from_racing_processes_never_collide(
    store: Store, backend: Backend, tmp_path: Path, clock: SettableClock
) -> None:
    # Given two store handles on one database (two processes)
    other = backend.open(tmp_path / "store", clock)
    try:
        await other.last_seq()
        handles = [store, other]
        # When forty retries take slots at once, through both
        slots = await asyncio.gather(
            *(handles[i % 2].limits.reserve_retry(1000.0, 0.5) for i in range(40))
        )
    finally:
        await other.close()
    # Then the slots are the forty distinct steps from 1000, 0.5 s apart
    assert sorted(slots) == pytest.approx([1000.0 + 0.5 * i for i in range(40)])
