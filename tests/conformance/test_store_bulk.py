"""Bulk cancel and retry by filter (kiln.bulk_actions over kiln.store.bulk), on both
backends: pages by keyset, resume from a cursor, the dry run's count, each filter field,
a task that changed meanwhile, tenants kept apart."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import psycopg
import pytest

import kiln
from kiln.bulk_actions import FilterIn, bulk_action, filter_of
from kiln.config import Settings
from kiln.errors import InvalidCursor, InvalidRequest
from kiln.models import NewTask, Task
from kiln.states import Event, Status
from kiln.store import Store
from kiln.store.bulk import BulkFilter
from kiln.store.postgres import PostgresStore
from services.postgres import PostgresServer

from .factories import KIND, SettableClock, claim_one, drive, make_new_task, step_change

pytestmark = pytest.mark.usefixtures("queue_counts_checked")

OTHER_KIND = "conformance.other"


@pytest.fixture
def bulk_app(store: Store, settings: Settings, clock: SettableClock) -> kiln.App:
    """An App on the store under test and its fake clock (the store fixture closes it)."""
    return kiln.App(store=store, settings=settings, clock=clock, rng=random.Random(7))


def new(n: int, *, tenant: str = "acme", kind: str = KIND) -> NewTask:
    return make_new_task({"n": n}, tenant=tenant, kind=kind, max_attempts=1)


async def failed(store: Store, task: NewTask, code: str) -> Task:
    """Submit ``task`` and fail its only attempt with ``code`` (final FAILED)."""
    await store.submit(task)
    claimed = await claim_one(store, task.kind)
    assert claimed.id == task.id
    error = {"code": code, "message": "upstream said no", "retryable": True}
    done, _ = await store.apply(
        step_change(claimed, Event.FAIL, fields={"error": error}, error=error)
    )
    assert done.status is Status.FAILED
    return done


def retry_filter(app: kiln.App, **fields: object) -> BulkFilter:
    return filter_of("retry", FilterIn(**fields), scope=None, everything=False, now=app.now())  # type: ignore[arg-type]


async def events_of(store: Store, task_id: str) -> list[str]:
    return [str(e.event) for e in await store.events(task_id=task_id)]


async def test_bulk_retry_by_code_goes_in_pages_and_resumes_from_the_cursor(
    store: Store, bulk_app: kiln.App
) -> None:
    # Given 7 tasks failed with upstream_unavailable and 2 with another code (all at the
    # same created_at: the keyset is the time-ordered id), a success and a pending task
    wanted = [await failed(store, new(n), "upstream_unavailable") for n in range(7)]
    others = [await failed(store, new(10 + n), "bad_prompt") for n in range(2)]
    success = await drive(store, new(20), Status.SUCCESS)
    pending = await drive(store, new(21), Status.PENDING)
    found = retry_filter(bulk_app, status=["FAILED"], code=["upstream_unavailable"])
    # When a dry run counts first
    dry = await bulk_action(bulk_app.engine, "retry", found, dry_run=True)
    # Then it counts the 7 and changes nothing
    assert (dry["matched"], dry["retried"], dry["cursor"]) == (7, 0, None)
    for task in wanted:
        unchanged = await store.get(task.id)
        assert unchanged is not None and unchanged.version == task.version
    # When the retry goes in pages of 3, each resumed from the previous cursor
    pages = [await bulk_action(bulk_app.engine, "retry", found, dry_run=False, limit=3)]
    while pages[-1]["cursor"] is not None:
        cursor = pages[-1]["cursor"]
        pages.append(
            await bulk_action(
                bulk_app.engine, "retry", found, dry_run=False, limit=3, cursor=cursor
            )
        )
    # Then three pages acted on 3, 3 and 1 tasks: the 7, each once, in id order
    assert [p["retried"] for p in pages] == [3, 3, 1]
    assert sum(p["skipped"] for p in pages) == 0
    acted = [task_id for p in pages for task_id in p["task_ids"]]
    assert acted == sorted(t.id for t in wanted)
    print(f"bulk retry pages: {[p['retried'] for p in pages]}, dry run {dry['matched']}")
    for task in wanted:
        now = await store.get(task.id)
        assert now is not None and now.status is Status.RETRYING
        assert now.max_attempts == 2 and now.finished_at is None
        assert (await events_of(store, task.id)).count("retry") == 1
    # And the others are untouched
    for task in [*others, success, pending]:
        before = task.status
        now = await store.get(task.id)
        assert now is not None and now.status is before and now.version == task.version
    # When the whole action runs again from the start, it finds nothing left to do
    again = await bulk_action(bulk_app.engine, "retry", found, dry_run=False)
    assert (again["matched"], again["retried"], again["cursor"]) == (0, 0, None)


async def test_dry_run_count_equals_what_the_run_acts_on(store: Store, bulk_app: kiln.App) -> None:
    # Given a mix of live and final tasks of two kinds
    await drive(store, new(7), Status.NEEDS_REVIEW)
    await drive(store, new(6), Status.RETRYING)
    await drive(store, new(8), Status.CANCELLED)
    for n in range(3):
        await drive(store, new(n), Status.PENDING)
    await drive(store, new(5, kind=OTHER_KIND), Status.PENDING)
    found = filter_of("cancel", FilterIn(kind=[KIND]), scope=None, everything=False, now=0.0)
    # When a dry run counts and then the cancel runs in pages of 2
    dry = await bulk_action(bulk_app.engine, "cancel", found, dry_run=True)
    done, cursor = 0, None
    while True:
        page = await bulk_action(
            bulk_app.engine, "cancel", found, dry_run=False, limit=2, cursor=cursor
        )
        done += page["cancelled"] + page["cancel_requested"]
        cursor = page["cursor"]
        if cursor is None:
            break
    # Then the count was what the run acted on: the live tasks of the kind
    assert dry["matched"] == done == 5
    assert await store.bulk.count(found) == 0


async def test_each_filter_field_narrows(
    store: Store, bulk_app: kiln.App, clock: SettableClock
) -> None:
    # Given failed tasks that differ in one field each, created an hour apart
    early = await failed(store, new(0), "upstream_unavailable")
    clock.advance(3600)
    middle = await failed(store, new(1, kind=OTHER_KIND), "upstream_unavailable")
    clock.advance(3600)
    late = await failed(store, new(2, tenant="globex"), "bad_prompt")
    timed_out = await drive(store, new(3), Status.TIMEOUT)

    def count(**fields: object) -> object:
        return store.bulk.count(retry_filter(bulk_app, **fields))

    # Then each field matches only the tasks it names
    assert await count(status=["FAILED"]) == 3
    assert await count(status=["TIMEOUT"]) == 1
    assert await count(kind=[OTHER_KIND]) == 1
    assert await count(code=["bad_prompt"]) == 1
    assert await count(code=["bad_prompt", "upstream_unavailable"]) == 3
    assert await count(tenant="globex", status=["FAILED"]) == 1
    assert await count(created_before=early.created_at + 1) == 1
    assert await count(created_after=middle.created_at) == 3  # middle, late, timed_out
    assert await count(created_after="30m") == 2  # relative to the clock: late, timed_out
    assert await count(created_before="30m") == 2  # early, middle
    assert await count(created_before="1.5h", created_after="3h") == 1  # early
    assert timed_out.created_at == late.created_at


async def test_bulk_cancel_asks_running_tasks_to_stop_once(
    store: Store, bulk_app: kiln.App
) -> None:
    # Given a running task and a pending one
    running = await drive(store, new(0), Status.GENERATING)
    pending = await drive(store, new(1), Status.PENDING)
    found = filter_of("cancel", FilterIn(kind=[KIND]), scope=None, everything=False, now=0.0)
    # When a bulk cancel runs
    page = await bulk_action(bulk_app.engine, "cancel", found, dry_run=False)
    # Then the pending task is CANCELLED, the running one asked to stop (still running)
    assert (page["cancelled"], page["cancel_requested"], page["skipped"]) == (1, 1, 0)
    stopped = await store.get(running.id)
    assert stopped is not None and stopped.cancel_requested and stopped.status is Status.GENERATING
    gone = await store.get(pending.id)
    assert gone is not None and gone.status is Status.CANCELLED
    assert (await events_of(store, pending.id))[-1] == "cancel"
    # When it runs again, it finds nothing: no task is acted on twice
    again = await bulk_action(bulk_app.engine, "cancel", found, dry_run=False)
    assert (again["matched"], again["cancelled"], again["cancel_requested"]) == (0, 0, 0)


async def test_a_task_that_changed_since_it_was_read_is_skipped(
    store: Store, bulk_app: kiln.App
) -> None:
    # Given three failed tasks, one of which the plan sees as it was before a change
    tasks = [await failed(store, new(n), "upstream_unavailable") for n in range(3)]
    stale = tasks[1].id
    engine = bulk_app.engine
    found = retry_filter(bulk_app, status=["FAILED"])

    def plan(task: Task) -> object:
        seen = replace(task, status=Status.CANCELLED) if task.id == stale else task
        return engine.user_change(seen, Event.RETRY, {"max_attempts": 2})

    # When a page acts on them
    page = await engine.act_page(found, None, 10, plan)  # type: ignore[arg-type]
    # Then its compare-and-set refuses that one alone: skipped, unchanged; the others commit
    assert (page.matched, len(page.changed), page.skipped) == (3, 2, 1)
    kept = await store.get(stale)
    assert kept is not None and kept.status is Status.FAILED and kept.version == tasks[1].version
    assert "retry" not in await events_of(store, stale)
    assert {t.id for t in page.changed} == {tasks[0].id, tasks[2].id}


async def test_a_tenant_acts_on_its_own_tasks_only(store: Store, bulk_app: kiln.App) -> None:
    # Given failed tasks of two tenants
    acme = [await failed(store, new(n), "upstream_unavailable") for n in range(2)]
    globex = [
        await failed(store, new(9 + n, tenant="globex"), "upstream_unavailable") for n in range(2)
    ]
    everything = FilterIn(code=["upstream_unavailable"], tenant="globex")
    # When acme's key retries (a tenant in the filter does not widen its scope)
    mine = filter_of("retry", everything, scope="acme", everything=False, now=0.0)
    page = await bulk_action(bulk_app.engine, "retry", mine, dry_run=False)
    # Then only acme's tasks were retried
    assert sorted(page["task_ids"]) == sorted(t.id for t in acme)
    for task in globex:
        now = await store.get(task.id)
        assert now is not None and now.status is Status.FAILED
    # And the admin narrows to one tenant with ``tenant``
    admin = filter_of("retry", everything, scope=None, everything=False, now=0.0)
    assert await store.bulk.count(admin) == 2


async def test_bad_filters_and_cursors_are_refused_and_change_nothing(
    store: Store, bulk_app: kiln.App
) -> None:
    task = await failed(store, new(0), "upstream_unavailable")
    # An empty filter must be asked for with all
    with pytest.raises(InvalidRequest, match="all"):
        filter_of("retry", FilterIn(), scope="acme", everything=False, now=0.0)
    every = filter_of("retry", FilterIn(), scope="acme", everything=True, now=0.0)
    assert await store.bulk.count(every) == 1
    # A status the action does not apply to, a time that is not one
    with pytest.raises(InvalidRequest, match="PENDING"):
        filter_of("retry", FilterIn(status=["PENDING"]), scope=None, everything=False, now=0.0)
    with pytest.raises(InvalidRequest, match="created_after"):
        filter_of(
            "retry", FilterIn(created_after="yesterday"), scope=None, everything=False, now=0.0
        )
    # A cursor no page gave, a limit out of range
    with pytest.raises(InvalidCursor):
        await bulk_action(bulk_app.engine, "retry", every, dry_run=False, cursor="not-a-cursor")
    with pytest.raises(InvalidRequest, match="limit"):
        await bulk_action(bulk_app.engine, "retry", every, dry_run=False, limit=0)
    now = await store.get(task.id)
    assert now is not None and now.status is Status.FAILED and now.version == task.version


async def test_on_postgres_a_task_changed_while_the_page_waits_for_it_is_skipped(
    postgres_server: PostgresServer, settings: Settings, clock: SettableClock
) -> None:
    # Given three failed tasks on PostgreSQL, one of them locked by another transaction
    url = postgres_server.new_database()
    store = await PostgresStore.open(url, clock=clock)
    try:
        app = kiln.App(store=store, settings=settings, clock=clock, rng=random.Random(7))
        tasks = [await failed(store, new(n), "upstream_unavailable") for n in range(3)]
        held = tasks[1].id
        found = retry_filter(app, status=["FAILED"])
        async with await psycopg.AsyncConnection.connect(url) as other:
            async with other.transaction():
                await other.execute("SELECT 1 FROM tasks WHERE id = %s FOR UPDATE", (held,))
                # When a page selects all three and waits for that task's lock
                page = asyncio.create_task(bulk_action(app.engine, "retry", found, dry_run=False))
                await waiting_for_a_lock(url, page)
                # And the other transaction changes it (as a single retry would) and commits
                await other.execute("UPDATE tasks SET status = 'RETRYING' WHERE id = %s", (held,))
            answer = await page
        # Then the page's compare-and-set refused it alone: skipped; the others retried
        assert (answer["matched"], answer["retried"], answer["skipped"]) == (3, 2, 1)
        assert held not in answer["task_ids"]
        assert "retry" not in await events_of(store, held)
    finally:
        await store.close()


async def waiting_for_a_lock(url: str, page: asyncio.Task[object]) -> None:
    """Until a session of the store waits on a row lock (the page reached the held task)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watcher:
        for _ in range(1000):
            assert not page.done(), "the page did not wait for the held task"
            cursor = await watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
            row = await cursor.fetchone()
            if row is not None and row[0] > 0:
                return
            await asyncio.sleep(0.01)
    pytest.fail("no session waited for the lock")
