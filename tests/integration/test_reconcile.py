"""Reconciliation on real tasks: SQLite with a local folder, and PostgreSQL with an
S3-compatible bucket. Objects are deleted, overwritten and left behind the store's back;
the reconciler (and the leading supervisor's periodic pass) must find and repair them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.models import StoredOutput
from kiln.process_metrics import LiveMetrics, supervisor_readings
from kiln.reconcile import Options, ResultLostPolicy, reconcile
from kiln.states import Event, Status
from kiln.storage import MANIFEST, verify

from .conftest import demo_params, object_keys, wait_for_status, wait_for_task, wait_until


@pytest.fixture(params=["sqlite-local", "postgres-s3"])
async def live(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[kiln.App]:
    """An App on the real clock: SQLite and a folder, or PostgreSQL and a bucket."""
    if request.param == "postgres-s3":
        settings = settings.with_(
            database_url=request.getfixturevalue("postgres_server").new_database(),
            storage_url=request.getfixturevalue("s3_server").url(),
        )
    app = kiln.App(settings=settings)
    demo.register(app)
    async with app:
        yield app


async def _done(app: kiln.App, prompt: str) -> kiln.Task:
    task = (await app.submit("image.generate", demo_params(prompt))).task
    async with running(app.worker(concurrency=1).run()):
        return await wait_for_status(app.engine.store, task.id, Status.SUCCESS)


def _output(task: kiln.Task) -> StoredOutput:
    assert task.result is not None
    return StoredOutput.from_json(task.result["outputs"][0])


def _an_hour_on() -> float:
    return time.time() + 7200.0


async def test_a_deleted_output_is_rerun_and_the_task_succeeds_again(live: kiln.App) -> None:
    # Given a SUCCESS task whose output is deleted behind the store's back
    task = await _done(live, "a lighthouse")
    lost = _output(task)
    await live.storage.delete(lost.key)

    # When a repair runs under the rerun policy
    report = await reconcile(live, Options(repair=True, result_lost=ResultLostPolicy.RERUN))

    # Then it named the task, and the task waits for a new attempt with no result
    assert (report.lost_tasks, report.missing_count, report.rerun_count) == (1, 1, 1)
    assert report.missing[0].task_id == task.id and report.resolved
    retried = await live.get(task.id)
    assert retried.status is Status.RETRYING and retried.result is None
    assert retried.error is not None and retried.error["code"] == "result_lost"
    # And a worker runs it to SUCCESS again with a new, verified output elsewhere
    async with running(live.worker(concurrency=1).run()):
        again = await wait_for_status(live.engine.store, task.id, Status.SUCCESS)
    fresh = _output(again)
    assert fresh.key != lost.key
    assert await verify(live.storage, fresh)
    events = [e.event for e in await live.engine.store.events(task_id=task.id)]
    assert events[-6:-4] == [Event.LOSE, Event.SCHEDULE_RETRY]
    # And nothing is left to find
    after = await reconcile(live, Options(repair=True))
    assert after.clean, after


async def test_a_corrupt_output_under_the_fail_policy_ends_failed_result_lost(
    live: kiln.App,
) -> None:
    # Given a SUCCESS task whose output was overwritten with other bytes of the same size
    task = await _done(live, "a harbour")
    output = _output(task)
    await live.storage.put(output.key, b"\0" * output.size)

    # When a pass only reports, and then a repair runs under the fail policy
    seen = await reconcile(live)
    repaired = await reconcile(live, Options(repair=True, result_lost=ResultLostPolicy.FAIL))

    # Then the report named it corrupt and left it alone
    assert (seen.corrupt_count, seen.lost_tasks, seen.failed_count) == (1, 1, 0)
    assert not seen.resolved
    # And the repair made it FAILED result_lost, without a result, final, at a new epoch
    failed = await live.get(task.id)
    assert repaired.failed_count == 1 and repaired.resolved
    assert failed.status is Status.FAILED and failed.final
    assert failed.result is None and failed.epoch == task.epoch + 1
    assert failed.error is not None and failed.error["code"] == "result_lost"
    # And what was left of its result is gone with it
    assert await object_keys(live.storage, f"tasks/{task.id}/") == []
    assert (await reconcile(live)).clean


async def test_orphans_are_removed_after_the_grace_period_and_kept_before(
    live: kiln.App,
) -> None:
    # Given a SUCCESS task, a stale attempt's upload of it, a crashed upload of a failed
    # task, an object of a task the store never had, and an upload of a pending task
    done = await _done(live, "a quarry")
    failed = (await live.submit("image.generate", demo_params("a mine", permanent=True))).task
    async with running(live.worker(concurrency=1).run()):
        await wait_for_status(live.engine.store, failed.id, Status.FAILED)
    pending = (await live.submit("image.generate", demo_params("a pit"))).task
    stale = f"tasks/{done.id}/9-9/image.png"
    orphans = [stale, f"tasks/{done.id}/9-9/{MANIFEST}", f"tasks/{failed.id}/1-1/image.png",
               "tasks/tsk_gone/1-1/image.png"]  # fmt: skip
    in_use = f"tasks/{pending.id}/1-1/image.png"
    for key in [*orphans, in_use]:
        await live.storage.put(key, b"leftover")

    # When a repair runs now, and again an hour later (the grace period is an hour)
    young = await reconcile(live, Options(repair=True, grace_s=3600.0))
    old = await reconcile(live, Options(repair=True, grace_s=3600.0), clock=_an_hour_on)

    # Then the first kept every orphan, and the second deleted each one
    assert (young.orphan_count, young.kept_count, young.deleted_count) == (4, 4, 0)
    assert sorted(o.key for o in young.orphans) == sorted(orphans)
    assert not young.resolved
    assert (old.orphan_count, old.deleted_count) == (4, 4) and old.resolved
    assert sorted(old.deleted) == sorted(orphans)
    # And the SUCCESS task's outputs and the pending task's upload stay
    assert await verify(live.storage, _output(done))
    assert await object_keys(live.storage, in_use) == [in_use]
    assert (await reconcile(live)).clean


async def test_the_leading_supervisor_reconciles_by_itself(live: kiln.App) -> None:
    # Given a supervisor passing every 0.2 s with repair on and the rerun policy, and a
    # SUCCESS task whose output then disappears, and an orphan
    live.settings = live.settings.with_(
        reconcile_interval_s=0.2, reconcile_repair=True, reconcile_grace_s=0.0,
        result_lost_policy="rerun",
    )  # fmt: skip
    task = await _done(live, "a canal")
    await live.storage.delete(_output(task).key)
    await live.storage.put("tasks/tsk_gone/1-1/image.png", b"leftover")
    supervisor = live.supervisor(interval_s=0.05, owner="sup")

    # When the supervisor and a worker run
    async with running(supervisor.run(), live.worker(concurrency=1).run()):
        again = await wait_for_task(
            live.engine.store, task.id, lambda t: t.status is Status.SUCCESS and t.attempt == 2,
            what="a second SUCCESS",
        )  # fmt: skip

        async def orphan_gone() -> bool:
            return await object_keys(live.storage, "tasks/tsk_gone/") == []

        await wait_until(orphan_gone, what="the orphan's deletion")

    # Then the task has a new verified output, and the passes were counted
    assert await verify(live.storage, _output(again))
    totals = supervisor.reconciles
    assert totals.runs >= 1 and totals.rerun == 1 and totals.deleted >= 1
    registry = CollectorRegistry()
    registry.register(LiveMetrics(*supervisor_readings(supervisor)))
    text = generate_latest(registry).decode()
    assert 'kiln_reconcile_repaired_total{action="rerun"} 1.0' in text
    assert "kiln_reconcile_runs_total" in text
    assert "kiln_reconcile_last_run_timestamp_seconds" in text


async def test_the_supervisors_pass_only_reports_unless_repair_is_on(live: kiln.App) -> None:
    # Given the default settings but a short interval, and a lost output
    live.settings = live.settings.with_(reconcile_interval_s=0.2)
    task = await _done(live, "a weir")
    await live.storage.delete(_output(task).key)
    supervisor = live.supervisor(interval_s=0.05, owner="sup")

    # When the supervisor has run a pass
    async with running(supervisor.run()):

        async def passed() -> bool:
            return supervisor.reconciles.runs >= 1

        await wait_until(passed, what="a reconciliation pass")

    # Then the pass counted the lost output and changed nothing
    last = supervisor.reconciles.last
    assert last is not None and last.missing_count == 1 and last.rerun_count == 0
    assert (await live.get(task.id)).status is Status.SUCCESS
    _, gauges = supervisor_readings(supervisor)
    assert gauges["kiln_reconcile_missing"]() == 1
    assert gauges["kiln_reconcile_last_run_timestamp_seconds"]() > 0
