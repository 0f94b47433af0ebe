"""The GPU-second ledger after a crash: a worker process killed with SIGKILL while
generating leaves its attempt to the supervisor, which writes the attempt's ledger row with
no memory of the worker, on each store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.states import RUNNING, Status

from .conftest import WorkerProcesses, demo_params, wait_for_status, wait_for_task

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_settings(request: pytest.FixtureRequest, crash_settings: Settings) -> Settings:
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return crash_settings.with_(database_url=server.new_database())
    return crash_settings


@pytest.fixture
def workers(ledger_settings: Settings, tmp_path: Path) -> Iterator[WorkerProcesses]:
    procs = WorkerProcesses(ledger_settings, tmp_path)
    try:
        yield procs
    finally:
        procs.close()


@pytest.fixture
async def ledger_app(ledger_settings: Settings) -> AsyncIterator[kiln.App]:
    instance = kiln.App(settings=ledger_settings)
    demo.register(instance)
    async with instance:
        yield instance


async def test_a_killed_workers_attempt_is_in_the_ledger_with_the_logs_seconds(
    ledger_app: kiln.App, workers: WorkerProcesses
) -> None:
    # Given a worker process GENERATING a task in a shared pool
    store = ledger_app.engine.store
    params = demo_params("a heron", steps=20, step_ms=50)
    task = (await ledger_app.submit("image.generate", params)).task
    victim = workers.start("--pools", "gpu:1")
    held = await wait_for_task(
        store, task.id, lambda t: t.status is Status.GENERATING and (t.progress_step or 0) > 0,
        timeout_s=15, what="GENERATING with progress",
    )  # fmt: skip
    # When it is killed, and a fresh worker runs beside the supervisor
    workers.sigkill(victim)
    workers.start("--pools", "gpu:1")
    async with running(ledger_app.supervisor(interval_s=0.05).run()):
        await wait_for_status(store, task.id, Status.SUCCESS, timeout_s=30)
    # Then the ledger holds both attempts: the expired one, written by the supervisor for
    # the killed worker, and the successful one, each with the event log's seconds
    events = await store.events(task_id=task.id)
    ended = [e for e in events if e.from_status in RUNNING and e.status not in RUNNING]
    expired, done = sorted(await store.usage.of_task(task.id), key=lambda r: r.epoch)
    assert [e.event for e in ended] == ["expire", "uploaded"]
    assert (expired.outcome, expired.worker, expired.loading_s) == ("expired", held.lease_owner, 0)
    assert (done.outcome, done.pool) == ("success", "gpu")
    assert done.worker is not None and done.worker != held.lease_owner
    for row in (expired, done):
        mine = [e for e in events if e.attempt == row.attempt and e.epoch == row.epoch]
        waited = [e.dwell_s for e in mine if e.from_status is Status.WAITING_FOR_RESOURCE]
        generated = [e.dwell_s for e in mine if e.from_status is Status.GENERATING]
        if row is expired:  # the expire event carries the next epoch (it fences the worker)
            generated = [e.dwell_s for e in ended[:1]]
        assert [row.waiting_s] == waited and [row.generating_s] == generated
    # And the sums by outcome say so
    by_outcome = await store.usage.report(since=0, until=ledger_app.now() + 1, group_by=["outcome"])
    assert {s.group["outcome"]: s.attempts for s in by_outcome} == {"expired": 1, "success": 1}
