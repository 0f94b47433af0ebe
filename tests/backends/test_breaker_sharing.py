"""Breakers shared through the store, between two processes' Apps on one database and one
clock: one opens, the other follows; one takes the probe; its outcome reaches both."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import kiln
from kiln.breakers import READ_EVERY_S
from kiln.config import Settings
from kiln.errors import Retryable

KIND = "calls.upstream"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def handler(ctx: object, params: object) -> None:
    return None


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def apps(tmp_path: Path, clock: Clock) -> AsyncIterator[tuple[kiln.App, kiln.App]]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'kiln.db'}",
        storage_url=(tmp_path / "results").as_uri(),
        breaker_min_calls=2,
        breaker_open_s=30.0,
    )
    opened = []
    for owner in ("one", "two"):
        app = kiln.App(settings=settings, clock=clock)
        app.task(KIND)(handler)
        await app.open()
        app.breakers.owner = owner
        opened.append(app)
    try:
        yield opened[0], opened[1]
    finally:
        for app in opened:
            await app.close()


async def fail_twice(app: kiln.App) -> None:
    task = (await app.submit(KIND, {"n": 1})).task
    down = Retryable("down", code="upstream_unavailable")
    for _ in range(2):
        app.breakers.settle(task, app.breakers.admit(KIND), down)


async def test_one_process_opens_the_other_follows_and_one_probe_closes_both(
    apps: tuple[kiln.App, kiln.App], clock: Clock
) -> None:
    one, two = apps
    await one.breakers.sync()
    await two.breakers.sync()
    # Given the kind's upstream failing twice in process one
    await fail_twice(one)
    assert one.breakers.state(KIND) == "open"
    assert two.breakers.state(KIND) == "closed"

    # When both sync (process two reads at most once a second)
    await one.breakers.sync()
    clock.now += READ_EVERY_S
    await two.breakers.sync()

    # Then process two holds the kind back too
    assert two.breakers.state(KIND) == "open"
    assert await two.breakers.claimable([KIND]) == ([], [])
    assert two.breakers.transitions == {}  # it adopted; it decided nothing

    # When the open period is over, both want the probe: one gets it
    clock.now += 30
    first = await one.breakers.claimable([KIND])
    second = await two.breakers.claimable([KIND])
    assert (first, second) == (([], [KIND]), ([], []))
    [record] = await one.engine.store.limits.breakers()
    assert (record.state, record.by) == ("half_open", "one")

    # When the probe succeeds in process one
    task = (await one.submit(KIND, {"n": 2})).task
    one.breakers.probing(KIND, task.id)
    permits = one.breakers.admit(KIND)
    assert permits[KIND].probe
    one.breakers.settle(task, permits, None)

    # Then it is closed in both, through the store
    await one.breakers.sync()
    clock.now += READ_EVERY_S
    await two.breakers.sync()
    assert (one.breakers.state(KIND), two.breakers.state(KIND)) == ("closed", "closed")
    assert await two.breakers.claimable([KIND]) == ([KIND], [])
    counters = await one.engine.store.counters()
    transitions = {k[1]: n for k, n in counters.items() if k[0] == "breaker_transitions"}
    assert transitions == {f"{KIND}>open": 1, f"{KIND}>half_open": 1, f"{KIND}>closed": 1}


async def test_fail_fast_refuses_while_open_and_hands_the_probe_to_one_task(
    apps: tuple[kiln.App, kiln.App], clock: Clock
) -> None:
    one, _ = apps
    one.settings = one.settings.with_(breaker_policy={KIND: "fail_fast"})
    one.breakers.settings = one.settings
    await fail_twice(one)
    await one.breakers.sync()
    # While open: every task is refused, and the kind is still claimed
    assert await one.breakers.claimable([KIND]) == ([KIND], [])
    refusal = await one.breakers.refusal(KIND, "tsk_a")
    assert refusal is not None and "is open" in refusal
    # Half-open: the first task is the probe, the next is refused
    clock.now += 30
    assert await one.breakers.refusal(KIND, "tsk_b") is None
    assert await one.breakers.refusal(KIND, "tsk_c") is not None
