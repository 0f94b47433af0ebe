"""KILN_RETRY_RATE: retries scheduled at once, from several processes, are spread out by
the store's retry clock instead of coming due together.

The clock is injected and stands still, so no retry comes due while the test reads the
stored schedule.
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import kiln
from kiln.app import running
from kiln.config import Settings
from kiln.errors import Retryable
from kiln.models import Task
from kiln.states import Status
from services.postgres import PostgresServer

from .conftest import AdvancingClock, wait_until

KIND = "flaky.upstream"
TASKS = 50


async def always_down(ctx: object, params: object) -> None:
    raise Retryable("the upstream is down", code="upstream_unavailable")


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kiln.db'}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.new_database()


@contextlib.asynccontextmanager
async def process(settings: Settings, clock: AdvancingClock) -> AsyncIterator[kiln.App]:
    """One process's App (its own store connections) with the failing kind. Its circuit
    breaker stays closed: these tests are about the retry clock, and a breaker opened by
    the first process's failures (shared through the store) would keep the second one's
    tasks from ever being claimed."""
    app = kiln.App(settings=settings.with_(breaker_min_calls=1_000_000), clock=clock)
    app.task(KIND)(always_down)
    async with app:
        yield app


async def fail_all_at_once(settings: Settings, clock: AdvancingClock) -> list[Task]:
    """Fifty tasks claimed by two worker processes' Apps and failed at the same instant;
    the tasks once they are all RETRYING (or failed for good)."""
    async with process(settings, clock) as one, process(settings, clock) as two:
        ids = [(await one.submit(KIND, {"n": n}, max_attempts=3)).task.id for n in range(TASKS)]
        workers = [app.worker(concurrency=TASKS // 2) for app in (one, two)]
        async with running(*(w.run() for w in workers)):

            async def all_failed() -> bool:
                tasks = [await one.engine.store.get(i) for i in ids]
                return all(t is not None and t.attempt == 1 and t.status in
                           (Status.RETRYING, Status.FAILED) for t in tasks)  # fmt: skip

            await wait_until(all_failed, timeout_s=60, what="every task's first attempt to fail")
        found = [await one.engine.store.get(i) for i in ids]
    return [t for t in found if t is not None]


async def test_a_retry_storm_is_spread_over_the_retry_rate(
    settings: Settings, clock: AdvancingClock, database_url: str
) -> None:
    # Given a cap of 10 retries a second across the cluster
    capped = settings.with_(database_url=database_url, retry_rate=10.0)
    failed_at = clock()
    # When fifty tasks fail at once in two processes
    tasks = await fail_all_at_once(capped, clock)
    # Then every one is RETRYING, and their retries are at least 0.1 s apart, over 5 s
    assert {t.status for t in tasks} == {Status.RETRYING}
    due = sorted(t.next_retry_at for t in tasks if t.next_retry_at is not None)
    assert len(due) == TASKS
    gaps = [b - a for a, b in itertools.pairwise(due)]
    assert min(gaps) >= 0.1 - 1e-4  # times near 1.8e9 s carry about 1e-7 s of rounding
    assert due[-1] - due[0] >= 4.9 - 1e-4
    assert due[0] >= failed_at  # never sooner than the backoff allows
    assert [t.ready_at for t in sorted(tasks, key=lambda t: t.ready_at)] == due


async def test_without_a_cap_the_same_storm_comes_due_together(
    settings: Settings, clock: AdvancingClock
) -> None:
    # Given no retry cap (the default) and a backoff of at most 0.05 s
    assert settings.retry_rate is None
    # When fifty tasks fail at once
    tasks = await fail_all_at_once(settings, clock)
    # Then their retries all come due within the backoff
    due = [t.next_retry_at for t in tasks if t.next_retry_at is not None]
    assert len(due) == TASKS
    assert max(due) - min(due) <= 0.05


async def test_a_slot_past_the_deadline_leaves_the_task_failed(
    settings: Settings, clock: AdvancingClock
) -> None:
    # Given a cap of one retry a second, and the retry clock booked for the next minute
    capped = settings.with_(retry_rate=1.0)
    async with process(capped, clock) as app:
        await app.engine.store.limits.reserve_retry(clock(), 60.0)
        task = (await app.submit(KIND, {"n": 1}, max_attempts=3, deadline_s=30)).task
        worker = app.worker(concurrency=1)
        # When its attempt fails
        async with running(worker.run()):

            async def ended() -> bool:
                found = await app.engine.store.get(task.id)
                return found is not None and found.final

            await wait_until(ended, timeout_s=30, what="the attempt to fail")
        # Then no retry is scheduled past its deadline: it stays FAILED
        found = await app.engine.store.get(task.id)
    assert found is not None
    assert (found.status, found.attempt, found.next_retry_at) == (Status.FAILED, 1, None)


async def test_a_task_that_succeeds_takes_no_retry_slot(
    settings: Settings, clock: AdvancingClock, tmp_path: Path
) -> None:
    # Given a retry cap and a kind that works
    capped = settings.with_(retry_rate=10.0)
    app = kiln.App(settings=capped, clock=clock)

    @app.task("works")
    async def works(ctx: object, params: object) -> None:
        return None

    async with app:
        task = (await app.submit("works", {})).task
        async with running(app.worker(concurrency=1).run()):

            async def done() -> bool:
                found = await app.engine.store.get(task.id)
                return found is not None and found.status is Status.SUCCESS

            await wait_until(done, timeout_s=30, what="the task to succeed")
    # Then the retry clock was never written
    with contextlib.closing(sqlite3.connect(tmp_path / "kiln.db")) as conn:
        assert conn.execute("SELECT COUNT(*) FROM retry_clock").fetchone() == (0,)
