"""A bulk retry by error code goes through in pages while real `kiln worker` processes run
the retried tasks (and other work): every retried task runs exactly once more and ends
SUCCESS, none twice, and the tasks the filter does not name are left alone. On SQLite and
PostgreSQL."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import kiln
from kiln.bulk_actions import FilterIn, bulk_action, filter_of
from kiln.states import Status
from services.postgres import PostgresServer

from .cli_workers import CliWorkers
from .conftest import demo_params, task_events, wait_until

FLAKY = 24  # failed once with upstream_unavailable: the bulk retry's tasks
BROKEN = 4  # failed for good with another code: left alone
BUSY = 8  # work the workers run while the pages go through
PAGE = 5


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kiln.db'}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.new_database()


@pytest.fixture
def workers(tmp_path: Path, database_url: str) -> Iterator[CliWorkers]:
    # No circuit breaker: the upstream_unavailable failures are the test's own
    started = CliWorkers(tmp_path / "cluster", database_url, KILN_BREAKER_MIN_CALLS="1000000")
    try:
        yield started
    finally:
        started.stop()


async def submit(app: kiln.App, prompt: str, **simulate: object) -> str:
    params = demo_params(prompt, steps=3, **simulate)
    return (await app.submit("image.generate", params, max_attempts=1)).task.id


async def claimed_any(app: kiln.App, ids: list[str]) -> bool:
    return any(status is not Status.RETRYING for status in await statuses(app, ids))


async def statuses(app: kiln.App, ids: list[str]) -> list[Status]:
    return [(await app.get(task_id)).status for task_id in ids]


async def test_bulk_retry_by_code_in_pages_while_workers_run(workers: CliWorkers) -> None:
    # Given tasks that failed once with upstream_unavailable, others failed for good with
    # bad_prompt, all on two `kiln worker` processes
    for _ in range(2):
        workers.start("--concurrency", "2")
    async with workers.app() as app:
        flaky = [
            await submit(app, f"flaky {n}", fail_attempts=1, fail_code="upstream_unavailable")
            for n in range(FLAKY)
        ]
        broken = [
            await submit(app, f"broken {n}", permanent=True, fail_code="bad_prompt")
            for n in range(BROKEN)
        ]

        async def all_failed() -> bool:
            return set(await statuses(app, flaky + broken)) == {Status.FAILED}

        with contextlib.suppress(BaseException):
            await wait_until(all_failed, timeout_s=60, what="every first attempt to fail")
        assert set(await statuses(app, flaky + broken)) == {Status.FAILED}, workers.tail()
        # And the workers busy with other work
        busy = [await submit(app, f"busy {n}", step_ms=40) for n in range(BUSY)]
        found = filter_of(
            "retry", FilterIn(status=["FAILED"], code=["upstream_unavailable"], created_after="1h"),
            scope=None, everything=False, now=app.now(),
        )  # fmt: skip
        dry = await bulk_action(app.engine, "retry", found, dry_run=True)
        # When the bulk retry goes through in pages of five, each resumed from the cursor
        pages, cursor = [], None
        while True:
            page = await bulk_action(app.engine, "retry", found, dry_run=False, limit=PAGE,
                                     cursor=cursor)  # fmt: skip
            pages.append(page)
            cursor = page["cursor"]
            if cursor is None:
                break
            # a worker takes up this page's tasks before the next page goes in
            await wait_until(lambda ids=page["task_ids"]: claimed_any(app, ids), timeout_s=30,
                             what="a worker to claim a retried task")  # fmt: skip
        # Then the dry run's count is what the pages retried, each task once
        print(f"bulk retry: dry run {dry['matched']}, pages {[p['retried'] for p in pages]}")
        assert dry["matched"] == FLAKY
        assert [p["retried"] for p in pages] == [5, 5, 5, 5, 4]
        assert sum(p["skipped"] for p in pages) == 0
        assert sorted(i for p in pages for i in p["task_ids"]) == sorted(flaky)

        async def all_done() -> bool:
            return set(await statuses(app, flaky + busy)) == {Status.SUCCESS}

        with contextlib.suppress(BaseException):
            await wait_until(all_done, timeout_s=60, what="every retried task to succeed")
        assert set(await statuses(app, flaky + busy)) == {Status.SUCCESS}, workers.tail()
        # And every retried task ran exactly once more: two claims, one retry, one success
        for task_id in flaky:
            events = [str(e.event) for e in await task_events(app.engine.store, task_id)]
            assert events.count("claim") == 2, events
            assert events.count("retry") == 1, events
            assert [str(e.status) for e in await task_events(app.engine.store, task_id)].count(
                "SUCCESS"
            ) == 1
            assert (await app.get(task_id)).attempt == 2
        # And the tasks the filter did not name were left alone
        for task_id in broken:
            events = [str(e.event) for e in await task_events(app.engine.store, task_id)]
            assert "retry" not in events and events.count("claim") == 1
        assert set(await statuses(app, broken)) == {Status.FAILED}
        # When the action runs again from the start, nothing is left to retry
        again = await bulk_action(app.engine, "retry", found, dry_run=False, limit=PAGE)
        assert (again["matched"], again["retried"]) == (0, 0)
