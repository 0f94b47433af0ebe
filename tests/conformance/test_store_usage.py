"""The GPU-second ledger on every backend: one row per attempt, written with the transition
that ends it, whose seconds are the event log's dwell times."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import kiln
from kiln.api.metrics import GPU_FROZEN_AFTER_S, GpuSeconds
from kiln.contributions import Ran, Retry
from kiln.engine import Engine
from kiln.errors import LeaseLost
from kiln.models import Task, TaskEvent
from kiln.states import RUNNING, Event, Status
from kiln.store import Store
from kiln.store.postgres import PostgresStore
from kiln.store.records import BUMP, WORKER, Fence
from kiln.store.usage import UsageRecord
from kiln.worker import release_fields

from .backends import Row
from .factories import KIND, SettableClock, make_new_task

Truth = Callable[..., list[Row]]
W, G = Status.WAITING_FOR_RESOURCE, Status.GENERATING
LAPSED = {"code": "lease_expired", "message": "the lease lapsed", "retryable": True}
BROKEN = {"code": "boom", "message": "the handler raised", "retryable": True}
PERMANENT = {"code": "bad_params", "message": "never works", "retryable": False}


@pytest.fixture
def core(engine: kiln.App) -> Engine:
    return engine.engine


def attempts_in_log(events: list[TaskEvent]) -> list[tuple[str, float, float]]:
    """Each attempt of a task as its event log tells it: (the event that ended it, the
    dwell_s of the event leaving WAITING_FOR_RESOURCE, of the one leaving GENERATING)."""
    found: list[tuple[str, float, float]] = []
    waiting = generating = 0.0
    for event in events:
        if event.from_status is W:
            waiting = event.dwell_s or 0.0
        if event.from_status is G:
            generating = event.dwell_s or 0.0
        if event.from_status in RUNNING and event.status not in RUNNING:
            found.append((str(event.event), waiting, generating))
            waiting = generating = 0.0
    return found


async def assert_ledger_matches_log(store: Store, task_id: str) -> list[UsageRecord]:
    """The task's ledger rows are its attempts, with exactly the log's dwell times."""
    rows = sorted(await store.usage.of_task(task_id), key=lambda r: r.epoch)
    in_log = attempts_in_log(await store.events(task_id=task_id))
    assert [(r.waiting_s, r.generating_s) for r in rows] == [(w, g) for _, w, g in in_log]
    return rows


async def claim(core: Engine, *, acquire: bool = False, worker: str = "w-1") -> Task:
    (task,) = await core.claim(worker_id=worker, kinds=[KIND], limit=1, lease_ttl_s=30,
                               acquire=[KIND] if acquire else [])  # fmt: skip
    return task


async def run_to_upload(core: Engine, clock: SettableClock, task: Task) -> Task:
    clock.advance(1.5)
    task = await core.apply(task, Event.ACQUIRE, fence=WORKER)
    clock.advance(2.25)
    task = await core.apply(task, Event.GENERATED, fence=WORKER)
    clock.advance(0.5)
    return task


async def test_a_successful_attempt_writes_one_row_with_the_logs_seconds(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given a task of a model that a worker claims, waits for, generates and uploads
    new = make_new_task()
    await store.submit(new)
    task = await run_to_upload(core, clock, await claim(core))
    # When the upload lands, with the load the worker timed and the pool its kind takes
    ran = Ran(loading_s=0.75, pool="gpu")
    await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER, facts=[ran])
    # Then the ledger holds one row whose seconds are those of the event log
    (row,) = await assert_ledger_matches_log(store, new.id)
    assert (row.waiting_s, row.generating_s, row.loading_s) == (1.5, 2.25, 0.75)
    assert (row.tenant, row.kind, row.pool, row.worker) == ("acme", KIND, "gpu", "w-1")
    assert (row.outcome, row.share, row.gpu_seconds) == ("success", 1.0, 2.25)
    assert (row.attempt, row.epoch, row.ended_at) == (1, 1, clock())


async def test_a_claim_that_acquires_at_once_waited_zero(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given a task of a kind that takes no resource: its claim acquires it at once
    new = make_new_task()
    await store.submit(new)
    task = await claim(core, acquire=True)
    assert task.status is G
    clock.advance(3.0)
    task = await core.apply(task, Event.GENERATED, fence=WORKER)
    # When it ends in review
    await core.apply(task, Event.UPLOADED, Status.NEEDS_REVIEW, fence=WORKER)
    # Then it waited 0 seconds and generated 3
    (row,) = await assert_ledger_matches_log(store, new.id)
    assert (row.outcome, row.waiting_s, row.generating_s) == ("needs_review", 0.0, 3.0)


async def test_every_attempt_of_a_retried_task_counts(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given a first attempt that fails while generating and is retried
    new = make_new_task()
    await store.submit(new)
    task = await claim(core)
    clock.advance(1.0)
    task = await core.apply(task, Event.ACQUIRE, fence=WORKER)
    clock.advance(4.0)
    task = await core.apply(task, Event.FAIL, fence=WORKER, retry=Retry(BROKEN))
    assert task.status is Status.RETRYING
    # When the second attempt succeeds
    clock.advance(120)
    task = await run_to_upload(core, clock, await claim(core, worker="w-2"))
    await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
    # Then both attempts are in the ledger, each with its own seconds and worker
    first, second = await assert_ledger_matches_log(store, new.id)
    assert (first.outcome, first.waiting_s, first.generating_s, first.worker) == (
        "retry", 1.0, 4.0, "w-1",
    )  # fmt: skip
    assert (second.outcome, second.attempt, second.worker) == ("success", 2, "w-2")
    totals = await store.usage.report(since=0, until=clock() + 1)
    assert totals[0].attempts == 2 and totals[0].generating_s == 4.0 + 2.25


async def test_a_failure_and_a_cancel_while_generating_count(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given one task failing for good while waiting, another cancelled while generating
    failing, cancelled = make_new_task({"n": 1}), make_new_task({"n": 2})
    await store.submit(failing)
    first = await claim(core)
    await store.submit(cancelled)
    second = await claim(core)
    clock.advance(2.0)
    await core.apply(first, Event.FAIL, fence=WORKER, retry=Retry(PERMANENT))
    second = await core.apply(second, Event.ACQUIRE, fence=WORKER)
    clock.advance(3.0)
    await core.request_cancel(second)
    await core.apply(second, Event.STOPPED, fence=WORKER)
    # Then each attempt has its row: the failure waited 2 s, the cancel generated 3 s
    (failed,) = await assert_ledger_matches_log(store, failing.id)
    (stopped,) = await assert_ledger_matches_log(store, cancelled.id)
    assert (failed.outcome, failed.waiting_s, failed.generating_s) == ("failed", 2.0, 0.0)
    assert (stopped.outcome, stopped.waiting_s, stopped.generating_s) == ("cancelled", 2.0, 3.0)


async def test_a_released_attempt_counts_and_the_next_one_has_its_own_row(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given an attempt a drain gives back while generating
    new = make_new_task()
    await store.submit(new)
    task = await claim(core)
    clock.advance(1.0)
    task = await core.apply(task, Event.ACQUIRE, fence=WORKER)
    clock.advance(2.0)
    fence = Fence(fenced=True, bump=True)
    await core.apply(task, Event.RELEASE, fields=release_fields(task), fence=fence)
    # When the next claim runs it to the end (the same attempt number, a new epoch)
    task = await run_to_upload(core, clock, await claim(core))
    await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
    # Then the released attempt is in the ledger beside the successful one
    released, done = await assert_ledger_matches_log(store, new.id)
    assert (released.outcome, released.attempt, released.epoch) == ("released", 1, 1)
    assert (released.waiting_s, released.generating_s) == (1.0, 2.0)
    assert (done.outcome, done.attempt, done.epoch) == ("success", 1, 3)


async def test_the_supervisor_writes_the_rows_of_the_attempts_it_ends(
    store: Store, engine: kiln.App, core: Engine, clock: SettableClock
) -> None:
    # Given an attempt whose worker vanished while generating, one stuck in waiting, and
    # a pool slot the first attempt held
    lapsed, stuck = make_new_task({"n": 1}), make_new_task({"n": 2})
    await store.submit(lapsed)
    first = await claim(core)
    await store.submit(stuck)
    await claim(core)
    clock.advance(1.0)
    assert await store.pools.acquire(first.id, first.epoch, {"gpu": 1}, {"gpu": 2}) is None
    first = await core.apply(first, Event.ACQUIRE, fence=WORKER)
    # When the lease lapses and the supervisor sweeps, then the waiting timeout passes
    clock.advance(40)
    await engine.supervisor(owner="sup").sweep()
    clock.advance(600)
    await engine.supervisor(owner="sup").sweep()
    # Then both attempts are in the ledger, with the log's seconds, no load timed, the
    # worker that held the lease and the pool its slot was in
    (expired,) = await assert_ledger_matches_log(store, lapsed.id)
    assert (expired.outcome, expired.worker, expired.loading_s) == ("expired", "w-1", 0.0)
    assert (expired.generating_s, expired.pool) == (40.0, "gpu")
    rows = await assert_ledger_matches_log(store, stuck.id)
    assert rows[0].outcome == "expired" and rows[0].waiting_s == 41.0


async def test_a_stale_replay_of_the_final_write_adds_nothing(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given an attempt that ended
    new = make_new_task()
    await store.submit(new)
    task = await run_to_upload(core, clock, await claim(core))
    await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
    # When its worker sends the same write again
    with pytest.raises(LeaseLost):
        await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
    # Then the ledger still holds one row
    assert len(await store.usage.of_task(new.id)) == 1


async def test_attempts_ending_together_each_write_their_row(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given many attempts uploading at once (PostgreSQL writes them as one statement)
    tasks = []
    for n in range(8):
        await store.submit(make_new_task({"n": n}))
        tasks.append(await run_to_upload(core, clock, await claim(core)))
    # When they all succeed together
    before = store.write_statements if isinstance(store, PostgresStore) else 0
    ran = Ran(loading_s=0.5, pool="gpu")
    await asyncio.gather(*(
        core.apply(t, Event.UPLOADED, Status.SUCCESS, fence=WORKER, facts=[ran]) for t in tasks
    ))  # fmt: skip
    if isinstance(store, PostgresStore):  # some went as one statement over arrays
        assert 0 < store.write_statements - before < len(tasks) - 1
    # Then each has its row, with the log's seconds
    for task in tasks:
        (row,) = await assert_ledger_matches_log(store, task.id)
        assert (row.outcome, row.loading_s, row.pool) == ("success", 0.5, "gpu")


async def test_sums_by_group_and_a_tenants_own(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given attempts of two tenants: acme one success and one failure, globex one success
    start = clock()
    for n, tenant in enumerate(("acme", "acme", "globex")):
        await store.submit(make_new_task({"n": n}, tenant=tenant))
        task = await run_to_upload(core, clock, await claim(core))
        if n == 1:
            await core.apply(task, Event.FAIL, fence=WORKER, retry=Retry(PERMANENT))
        else:
            ran = Ran(loading_s=1.0)
            await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER, facts=[ran])
    # When the ledger is summed by tenant and outcome
    sums = await store.usage.report(since=start, until=clock() + 1, group_by=["tenant", "outcome"])
    # Then each group has its attempts and seconds
    found = {(s.group["tenant"], s.group["outcome"]): s for s in sums}
    assert sorted(found) == [("acme", "failed"), ("acme", "success"), ("globex", "success")]
    assert found[("acme", "success")].attempts == 1
    assert found[("acme", "success")].generating_s == 2.25
    assert found[("acme", "success")].loading_s == 1.0
    assert found[("acme", "failed")].waiting_s == 1.5
    assert found[("globex", "success")].gpu_seconds == 2.25
    # And a tenant's report holds only its own attempts
    (own,) = await store.usage.report(since=start, until=clock() + 1, tenant="globex")
    assert (own.attempts, own.generating_s) == (1, 2.25)
    # And by day, the attempts fall on the day they ended
    (day,) = await store.usage.report(since=start, until=clock() + 1, group_by=["day", "kind"])
    assert day.group == {"day": "2027-01-15", "kind": KIND} and day.attempts == 3
    # And a window that ends before them holds none
    (empty,) = await store.usage.report(since=0, until=start)
    assert empty.attempts == 0 and empty.gpu_seconds == 0.0
    # And the GPU-seconds by tenant, kind, model and outcome cover the whole ledger
    assert await store.usage.gpu_seconds() == {
        ("acme", KIND, "", "failed"): 2.25, ("acme", KIND, "", "success"): 2.25,
        ("globex", KIND, "", "success"): 2.25,
    }  # fmt: skip


async def test_the_retention_purge_keeps_the_ledger(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given a task that succeeded long ago
    new = make_new_task()
    await store.submit(new)
    task = await run_to_upload(core, clock, await claim(core))
    await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
    clock.advance(86400)
    # When the retention purge deletes it with its events
    assert [t.id for t in await store.purge(finished_before=clock())] == [new.id]
    assert await store.events(task_id=new.id) == []
    # Then its ledger row stays: it is billing data
    (row,) = await store.usage.of_task(new.id)
    assert (row.outcome, row.generating_s) == ("success", 2.25)


async def test_the_gpu_seconds_metric_reads_the_ledger_incrementally_and_counts_once(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given the metric's reader and one attempt that ended
    reader = GpuSeconds()
    await store.submit(make_new_task({"n": 1}))
    task = await run_to_upload(core, clock, await claim(core))
    await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
    key = ("acme", KIND, "", "success")
    assert await reader.read(core) == {key: 2.25}
    # When another ends minutes later, and the reader's mark moves past both
    clock.advance(400)
    await store.submit(make_new_task({"n": 2}))
    task = await run_to_upload(core, clock, await claim(core))
    await core.apply(task, Event.UPLOADED, Status.SUCCESS, fence=WORKER)
    first_mark = reader.mark
    assert await reader.read(core) == {key: 4.5}
    clock.advance(2 * GPU_FROZEN_AFTER_S)
    # Then each attempt is counted once, whether frozen or still read
    assert await reader.read(core) == {key: 4.5}
    assert reader.mark is not None and first_mark is not None and reader.mark > first_mark
    assert reader.frozen == {key: 4.5}


async def test_the_supervisors_other_endings_name_their_outcomes(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given three running attempts: one past its state timeout, one whose cancel is overdue
    # and one whose complete outputs the supervisor found
    tasks = []
    for n in range(3):
        await store.submit(make_new_task({"n": n}))
        task = await claim(core)
        clock.advance(1.0)
        tasks.append(await core.apply(task, Event.ACQUIRE, fence=WORKER))
    clock.advance(5.0)
    timed_out, cancelled, recovered = tasks
    # When the supervisor ends each as its sweep would
    code = {"code": "generating_timeout", "message": "too long", "retryable": False}
    await core.apply(timed_out, Event.EXPIRE, fence=BUMP, retry=Retry(code))
    await core.apply(await core.request_cancel(cancelled), Event.FORCE_CANCEL, fence=BUMP)
    recover = {"result": {"outputs": []}}
    await core.apply(recovered, Event.RECOVER, fields=recover, fence=BUMP)
    # Then each attempt's row says how it ended, with the log's seconds
    outcomes = []
    for task in tasks:
        (row,) = await assert_ledger_matches_log(store, task.id)
        outcomes.append(row.outcome)
        assert row.worker == "w-1" and row.generating_s > 0
    assert outcomes == ["timeout", "cancelled", "success"]


async def test_generated_then_uploaded_in_one_change_logs_both_and_writes_one_row(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given an acquired task that generated for 2.25 s and has nothing to upload
    new = make_new_task()
    await store.submit(new)
    task = await claim(core)
    clock.advance(1.5)
    task = await core.apply(task, Event.ACQUIRE, fence=WORKER)
    clock.advance(2.25)
    before = await store.counters()
    # When generated and uploaded are one change
    then = Retry(then=Event.UPLOADED, then_to=Status.SUCCESS)
    done = await core.apply(task, Event.GENERATED, fence=WORKER, retry=then, facts=[Ran()])
    # Then the task succeeded two versions on, and the log holds both events
    assert (done.status, done.version) == (Status.SUCCESS, task.version + 2)
    assert await store.get(new.id) == done
    generated, uploaded = (await store.events(task_id=new.id))[-2:]
    logged = [(e.id, e.event, e.from_status, e.status) for e in (generated, uploaded)]
    assert logged == [
        (f"{new.id}:{task.version + 1}", Event.GENERATED, G, Status.UPLOADING),
        (f"{new.id}:{task.version + 2}", Event.UPLOADED, Status.UPLOADING, Status.SUCCESS),
    ]
    assert [(e.final, e.dwell_s) for e in (generated, uploaded)] == [(False, 2.25), (True, 0.0)]
    assert generated.seq < uploaded.seq
    # And the ledger's one row ends the attempt as a success, with the log's seconds
    (row,) = await assert_ledger_matches_log(store, new.id)
    assert (row.outcome, row.waiting_s, row.generating_s) == ("success", 1.5, 2.25)
    # And the counts and both transitions' counters moved
    counts = (await store.stats(tenant=None, ghost_after_s=60)).counts
    assert (counts["SUCCESS"], counts["GENERATING"], counts["UPLOADING"]) == (1, 0, 0)
    after = await store.counters()
    for key in ("GENERATING>UPLOADING", "UPLOADING>SUCCESS"):
        assert after[("transitions", key)] - before.get(("transitions", key), 0) == 1


async def test_generated_then_uploaded_from_a_fenced_out_worker_writes_nothing(
    store: Store, core: Engine, clock: SettableClock
) -> None:
    # Given an acquired task that the supervisor took back meanwhile (epoch + 1)
    new = make_new_task()
    await store.submit(new)
    task = await claim(core)
    task = await core.apply(task, Event.ACQUIRE, fence=WORKER)
    await core.apply(task, Event.EXPIRE, fence=BUMP, retry=Retry(LAPSED))
    before = (await store.get(new.id), await store.events(task_id=new.id))
    ledger = await store.usage.of_task(new.id)
    # When its old worker sends generated and uploaded as one change
    then = Retry(then=Event.UPLOADED, then_to=Status.SUCCESS)
    with pytest.raises(LeaseLost):
        await core.apply(task, Event.GENERATED, fence=WORKER, retry=then, facts=[Ran()])
    # Then neither event, nor the status, nor a ledger row was written
    assert (await store.get(new.id), await store.events(task_id=new.id)) == before
    assert await store.usage.of_task(new.id) == ledger
