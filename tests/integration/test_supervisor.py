"""The Supervisor's sweep: expiry, retries, timeouts, deadlines, forced cancel, leadership.

Most tests run on the fake clock and call ``sweep()`` directly: time moves, nothing sleeps.
"""

from __future__ import annotations

import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.errors import NotLeader
from kiln.models import StoredOutput, Timeouts
from kiln.states import Event, Status
from kiln.storage import sha256_hex, write_manifest

from .conftest import (
    AdvancingClock,
    assert_one_final_state,
    claim_generating,
    claim_one,
    demo_params,
    wait_for_status,
)


async def submit(app: kiln.App, prompt: str = "a meadow", **options: object) -> kiln.Task:
    return (await app.submit("image.generate", demo_params(prompt), **options)).task  # type: ignore[arg-type]


async def test_expired_lease_times_out_and_schedules_a_retry_in_one_transaction(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a GENERATING task whose worker stopped heartbeating
    task = await submit(fake_app, max_attempts=3)
    running_task = await claim_generating(fake_app, lease_ttl_s=1.0)

    # When the lease lapses and the supervisor sweeps
    clock.advance(1.5)
    now = clock.now
    report = await fake_app.supervisor().sweep()

    # Then TIMEOUT and RETRYING were written together, with backoff within the policy's bound
    assert report.leading and report.expired == 1
    after = await fake_app.get(task.id)
    assert after.status is Status.RETRYING
    assert after.epoch == running_task.epoch + 1
    assert after.lease_owner is None and after.lease_expires_at is None
    events = await fake_app.engine.store.events(task_id=task.id)
    expire, schedule = events[-2:]
    assert (expire.event, expire.from_status, expire.status) == (
        Event.EXPIRE, Status.GENERATING, Status.TIMEOUT)  # fmt: skip
    assert (schedule.event, schedule.from_status, schedule.status) == (
        Event.SCHEDULE_RETRY, Status.TIMEOUT, Status.RETRYING)  # fmt: skip
    assert schedule.seq == expire.seq + 1 and schedule.at == expire.at == now
    assert not expire.final and not schedule.final
    assert expire.error is not None and expire.error["code"] == "lease_expired"
    settings = fake_app.settings
    ceiling = min(settings.retry_max_s, settings.retry_base_s * 2 ** (after.attempt - 1))
    assert after.next_retry_at is not None
    assert now <= after.next_retry_at <= now + ceiling
    assert after.ready_at == after.next_retry_at


async def test_backoff_bound_grows_with_the_attempt(
    settings: Settings, clock: AdvancingClock
) -> None:
    # Given a policy with base 1 s and max 3 s, and a task on its attempts 1, 2 and 3
    app = kiln.App(settings=settings.with_(retry_base_s=1.0, retry_max_s=3.0), clock=clock)
    demo.register(app)
    async with app:
        task = await submit(app, max_attempts=4)
        supervisor = app.supervisor()
        for attempt, ceiling in ((1, 1.0), (2, 2.0), (3, 3.0)):
            # When its lease lapses on that attempt
            clock.advance(10.0)
            claimed = await claim_one(app, lease_ttl_s=1.0)
            assert claimed.attempt == attempt
            clock.advance(1.5)
            now = clock.now
            await supervisor.sweep()

            # Then the next attempt is due within [now, now + min(max, base * 2^(attempt-1))]
            after = await app.get(task.id)
            assert after.status is Status.RETRYING
            assert after.next_retry_at is not None
            assert now <= after.next_retry_at <= now + ceiling


async def test_expired_lease_on_last_attempt_ends_in_final_timeout(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a task on its only attempt whose worker went silent
    task = await submit(fake_app, max_attempts=1)
    await claim_generating(fake_app, lease_ttl_s=1.0)

    # When the supervisor sweeps after the lease lapsed
    clock.advance(2.0)
    await fake_app.supervisor().sweep()

    # Then the task is TIMEOUT for good
    after = await fake_app.get(task.id)
    assert after.status is Status.TIMEOUT and after.final
    assert after.attempt == after.max_attempts == 1
    assert after.finished_at == clock.now
    assert after.error is not None and after.error["code"] == "lease_expired"
    events = await assert_one_final_state(fake_app.engine.store, task.id)
    assert events[-1].event is Event.EXPIRE


async def test_live_lease_is_left_alone(fake_app: kiln.App, clock: AdvancingClock) -> None:
    # Given a GENERATING task whose lease is still live
    task = await submit(fake_app)
    held = await claim_generating(fake_app, lease_ttl_s=10.0)

    # When the supervisor sweeps before it lapses
    clock.advance(9.0)
    report = await fake_app.supervisor().sweep()

    # Then nothing happens to it
    assert report.expired == 0
    after = await fake_app.get(task.id)
    assert (after.status, after.epoch, after.version) == (held.status, held.epoch, held.version)


async def test_stalled_generation_times_out_and_the_retry_succeeds(
    settings: Settings,
) -> None:
    # Given a task whose first attempt stalls in GENERATING while its worker stays alive
    app = kiln.App(settings=settings.with_(retry_base_s=0.01, retry_max_s=0.02))
    demo.register(app)
    async with app:
        task = (
            await app.submit(
                "image.generate",
                demo_params("a stalled comet", stall_attempts=1),
                timeouts=Timeouts(generating_s=0.3),
            )
        ).task

        # When a worker (heartbeating) and the supervisor run
        worker = app.worker(concurrency=1, lease_ttl_s=3.0, idle_poll_s=(0.01, 0.05))
        supervisor = app.supervisor(interval_s=0.05)
        async with running(worker.run(), supervisor.run()):
            done = await wait_for_status(app.engine.store, task.id, Status.SUCCESS, timeout_s=15)

        # Then the generating timeout ended attempt 1 and attempt 2 succeeded
        assert done.attempt == 2
        events = await assert_one_final_state(app.engine.store, task.id)
        [expired] = [e for e in events if e.event is Event.EXPIRE]
        assert expired.attempt == 1 and expired.from_status is Status.GENERATING
        assert expired.error is not None and expired.error["code"] == "generating_timeout"


async def test_deadline_on_pending_task_ends_in_final_timeout(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a PENDING task with a 10 s deadline and no worker
    task = await submit(fake_app, deadline_s=10)

    # When the deadline passes and the supervisor sweeps
    clock.advance(11.0)
    report = await fake_app.supervisor().sweep()

    # Then it is TIMEOUT deadline_exceeded, final, never retried
    assert report.deadlined == 1
    after = await fake_app.get(task.id)
    assert after.status is Status.TIMEOUT
    assert after.error is not None and after.error["code"] == "deadline_exceeded"
    assert after.attempt == 0
    events = await assert_one_final_state(fake_app.engine.store, task.id)
    assert [e.event for e in events] == [Event.SUBMIT, Event.DEADLINE]
    assert await fake_app.engine.store.claim(worker_id="w", kinds=["image.generate"], limit=1,
                                      lease_ttl_s=5.0) == []  # fmt: skip


async def test_deadline_on_running_task_ends_it_for_good_and_fences_the_worker(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a GENERATING task with a live lease and a 30 s overall deadline
    task = await submit(fake_app, "a deadline", deadline_s=30, max_attempts=3)
    held = await claim_generating(fake_app, lease_ttl_s=600.0)

    # When the deadline passes while the worker still heartbeats
    clock.advance(31.0)
    await fake_app.engine.store.heartbeat(task.id, held.epoch, 600.0, None)
    await fake_app.supervisor().sweep()

    # Then the task is TIMEOUT deadline_exceeded, final despite attempts left
    after = await fake_app.get(task.id)
    assert after.status is Status.TIMEOUT and after.final
    assert after.attempt == 1 < after.max_attempts
    assert after.error is not None and after.error["code"] == "deadline_exceeded"
    assert after.epoch == held.epoch + 1
    await assert_one_final_state(fake_app.engine.store, task.id)
    with pytest.raises(kiln.LeaseLost):
        await fake_app.apply(held, Event.GENERATED, fenced=True)


async def test_task_waiting_too_long_for_a_resource_times_out_and_retries(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a task claimed 1 s past its waiting timeout, its lease still live
    task = await submit(fake_app, "a long wait", timeouts=Timeouts(waiting_s=5.0))
    held = await claim_one(fake_app, lease_ttl_s=600.0)
    assert held.status is Status.WAITING_FOR_RESOURCE
    clock.advance(6.0)

    # When the supervisor sweeps
    report = await fake_app.supervisor().sweep()

    # Then the attempt ends with waiting_for_resource_timeout and a retry is scheduled
    assert report.expired == 1
    after = await fake_app.get(task.id)
    assert after.status is Status.RETRYING
    assert after.error is not None
    assert after.error["code"] == "waiting_for_resource_timeout"


async def test_cancel_ignored_past_grace_period_is_forced(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a running task whose worker never heartbeats, and a cancel request
    task = await submit(fake_app)
    held = await claim_generating(fake_app, lease_ttl_s=600.0)
    requested = await fake_app.cancel(task.id)
    assert requested.status is Status.GENERATING and requested.cancel_requested
    supervisor = fake_app.supervisor()

    # When the grace period has not passed yet, nothing is forced
    clock.advance(fake_app.settings.cancel_grace_s / 2)
    assert (await supervisor.sweep()).force_cancelled == 0
    assert (await fake_app.get(task.id)).status is Status.GENERATING

    # And when it has passed
    clock.advance(fake_app.settings.cancel_grace_s)
    report = await supervisor.sweep()

    # Then the supervisor cancels it and fences the worker out
    assert report.force_cancelled == 1
    after = await fake_app.get(task.id)
    assert after.status is Status.CANCELLED
    assert after.epoch == held.epoch + 1
    events = await assert_one_final_state(fake_app.engine.store, task.id)
    assert events[-1].event is Event.FORCE_CANCEL
    with pytest.raises(kiln.LeaseLost):
        await fake_app.engine.store.heartbeat(task.id, held.epoch, 5.0, None)


async def test_ghost_gauge_counts_long_expired_leases_nobody_swept(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given three running tasks: two whose leases lapsed long ago, one still live
    for n in range(3):
        await submit(fake_app, f"a ghost {n}")
    await claim_one(fake_app, lease_ttl_s=1.0)
    await claim_one(fake_app, lease_ttl_s=1.0)
    await claim_one(fake_app, lease_ttl_s=10_000.0)
    supervisor = fake_app.supervisor(batch=1)
    store = fake_app.engine.store

    # When no supervisor swept them for longer than lease TTL plus two intervals
    clock.advance(1.0 + supervisor.ghost_after_s + 1.0)

    # Then the gauge shows both ghosts, and a sweep that can only act on one leaves one
    assert await store.count_ghosts(older_than_s=supervisor.ghost_after_s) == 2
    stats = await store.stats(tenant=None, ghost_after_s=supervisor.ghost_after_s)
    assert stats.ghosts == 2
    report = await supervisor.sweep()
    assert report.expired == 1 and report.ghosts == 1
    report = await supervisor.sweep()
    assert report.expired == 1 and report.ghosts == 0


async def test_only_one_supervisor_leads_and_the_next_takes_over_when_it_lapses(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given two supervisors on one store
    first = fake_app.supervisor(owner="sup-a", leader_ttl_s=3.0)
    second = fake_app.supervisor(owner="sup-b", leader_ttl_s=3.0)

    # When both sweep, only the first leads; it keeps leading while it renews
    assert (await first.sweep()).leading
    assert not (await second.sweep()).leading
    clock.advance(2.0)
    assert (await first.sweep()).leading
    assert not (await second.sweep()).leading
    old_token = first.token
    assert old_token is not None

    # And when the leader stops renewing past its ttl
    clock.advance(3.5)
    assert (await second.sweep()).leading

    # Then the second leads with a higher epoch, and the first is refused
    assert second.token is not None and second.token.epoch > old_token.epoch
    assert not (await first.sweep()).leading


async def test_old_leader_token_is_refused_and_changes_nothing(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a running task with a lapsed lease, and a leader that lost its leadership
    task = await submit(fake_app)
    await claim_generating(fake_app, lease_ttl_s=1.0)
    old = fake_app.supervisor(owner="sup-old", leader_ttl_s=3.0)
    new = fake_app.supervisor(owner="sup-new", leader_ttl_s=3.0)
    await old.sweep()
    old_token = old.token
    assert old_token is not None
    clock.advance(4.0)
    new_lead = await fake_app.engine.store.lead("supervisor", "sup-new", 3.0)
    assert new_lead is not None and new_lead.epoch > old_token.epoch
    before = await fake_app.get(task.id)
    events_before = await fake_app.engine.store.events(task_id=task.id)

    # When the old leader acts with its old token
    with pytest.raises(NotLeader):
        await fake_app.apply(before, Event.EXPIRE, leader=old_token, bump_epoch=True,
                             retry_error={"code": "lease_expired", "message": "late",
                                          "retryable": True})  # fmt: skip

    # Then nothing changed; the new leader's sweep is the one that acts
    after = await fake_app.get(task.id)
    assert (after.status, after.epoch, after.version) == (before.status, before.epoch,
                                                          before.version)  # fmt: skip
    assert await fake_app.engine.store.events(task_id=task.id) == events_before
    assert (await new.sweep()).expired == 1
    assert (await fake_app.get(task.id)).status is Status.RETRYING


async def _upload_as_the_worker(app: kiln.App, task: kiln.Task, damage: str) -> list[StoredOutput]:
    """Write the attempt's output and manifest as a worker would, then damage them."""
    assert task.result_prefix is not None
    data = b"\x89PNG pretend image bytes"
    key = f"{task.result_prefix}/image.png"
    if damage == "outside_prefix":
        key = f"tasks/{task.id}/0-0/image.png"
    record = StoredOutput("image.png", key, "image/png", len(data), sha256_hex(data))
    await app.storage.put(key, data)
    await write_manifest(app.storage, task.result_prefix, [record], flagged=damage == "flagged")
    if damage == "missing_object":
        await app.storage.delete(key)
    if damage == "corrupt_object":
        await app.storage.put(key, data[::-1])
    if damage == "torn_manifest":
        await app.storage.put(f"{task.result_prefix}/manifest.json", b'{"outputs": [')
    return [record]


@pytest.mark.parametrize(
    "damage",
    ["missing_object", "corrupt_object", "flagged", "torn_manifest", "outside_prefix"],
)
async def test_incomplete_upload_is_expired_not_recovered(
    fake_app: kiln.App, clock: AdvancingClock, damage: str
) -> None:
    # Given an UPLOADING task whose worker died leaving an upload that does not verify
    task = await submit(fake_app, f"a torn upload {damage}")
    held = await claim_generating(fake_app, lease_ttl_s=1.0)
    uploading = await fake_app.apply(held, Event.GENERATED, fenced=True)
    await _upload_as_the_worker(fake_app, uploading, damage)

    # When its lease lapses and the supervisor sweeps
    clock.advance(2.0)
    report = await fake_app.supervisor().sweep()

    # Then it is expired and retried, never SUCCESS on what storage cannot prove
    assert (report.recovered, report.expired) == (0, 1)
    after = await fake_app.get(task.id)
    assert after.status is Status.RETRYING and after.result is None
    assert (await fake_app.engine.store.counters()).get(("recovered", ""), 0) == 0


@pytest.mark.parametrize("status", [Status.GENERATING, Status.UPLOADING])
async def test_complete_upload_of_a_dead_worker_is_recovered(
    fake_app: kiln.App, clock: AdvancingClock, status: Status
) -> None:
    # Given a task whose worker died after writing a complete, verified upload
    task = await submit(fake_app, f"a finished upload {status}")
    held = await claim_generating(fake_app, lease_ttl_s=1.0)
    if status is Status.UPLOADING:
        held = await fake_app.apply(held, Event.GENERATED, fenced=True)
    [record] = await _upload_as_the_worker(fake_app, held, "none")

    # When its lease lapses and the supervisor sweeps
    clock.advance(2.0)
    report = await fake_app.supervisor().sweep()

    # Then the upload is the result: SUCCESS via recover, same attempt, epoch bumped
    assert (report.recovered, report.expired) == (1, 0)
    after = await fake_app.get(task.id)
    assert after.status is Status.SUCCESS
    assert (after.attempt, after.epoch) == (held.attempt, held.epoch + 1)
    assert after.result == {"outputs": [record.to_json()]}
    events = await assert_one_final_state(fake_app.engine.store, task.id)
    assert (events[-1].event, events[-1].from_status) == (Event.RECOVER, status)
    assert (await fake_app.engine.store.counters()).get(("recovered", "")) == 1
