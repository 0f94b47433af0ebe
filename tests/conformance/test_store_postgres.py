"""What only the PostgreSQL store has to get right: the event tail under concurrent
commits, the query plans of the hot queries, and migrations across processes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

from kiln.errors import LeaseLost, StoreUnavailable
from kiln.states import Event, Status, replay
from kiln.store.effects import USAGE_ROW
from kiln.store.positions import due_above_args, place_args
from kiln.store.postgres import PostgresStore, migrate
from kiln.store.queries import migrations, queries
from kiln.store.sqlstore import purge_candidates
from kiln.store.tx import Args
from services.postgres import PostgresServer, free_port

from .factories import KIND, make_new_task, step_change

pytestmark = pytest.mark.postgres
Q = queries("postgres")


@pytest.fixture
async def pg(postgres_server: PostgresServer) -> AsyncIterator[PostgresStore]:
    store = await PostgresStore.open(postgres_server.new_database(), clock=time.time)
    try:
        yield store
    finally:
        await store.close()


def _hold_an_event(conn: psycopg.Connection[Any], task_id: str) -> int:
    """In an open transaction, write like the store does (a task row first, then an event)
    and return the seq the event took."""
    conn.execute("BEGIN")
    conn.execute("UPDATE tasks SET updated_at = updated_at WHERE id = %s", (task_id,))
    row = conn.execute(
        "INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
        " attempt, epoch, error, at, dwell_s) VALUES (%s, %s, 'acme', 'claim', 'PENDING',"
        " 'WAITING_FOR_RESOURCE', false, 1, 1, NULL, 0, NULL) RETURNING seq",
        (f"{task_id}:held", task_id),
    ).fetchone()
    assert row is not None
    return int(row[0])


async def test_the_tail_waits_for_an_event_whose_transaction_is_still_open(
    pg: PostgresStore,
) -> None:
    # Given a first event, then a transaction holding the next seq open, then a later
    # event that committed before it
    first = (await pg.submit(make_new_task({"prompt": "one"}))).task
    with psycopg.connect(pg.url, autocommit=True) as conn:
        held = _hold_an_event(conn, first.id)
        later = (await pg.submit(make_new_task({"prompt": "two"}))).task
        # When the tail reads while that transaction is open
        seen = [e.seq for e in await pg.tail(after=0)]
        again = [e.seq for e in await pg.tail(after=0)]
        # Then it stops before the gap, however often it reads
        assert seen == again == [held - 1]
        assert (await pg.events(task_id=later.id))[0].seq == held + 1  # visible to reads
        # And where a tail may start is before the gap too
        assert await pg.last_seq() == held - 1
        # When the transaction commits
        conn.execute("COMMIT")
    # Then the tail reads the held event and the later one, in seq order
    assert [e.seq for e in await pg.tail(after=held - 1)] == [held, held + 1]


async def test_the_tail_moves_past_a_rolled_back_seq(pg: PostgresStore) -> None:
    # Given a seq taken by a transaction that rolled back, and a later committed event
    first = (await pg.submit(make_new_task({"prompt": "one"}))).task
    with psycopg.connect(pg.url, autocommit=True) as conn:
        held = _hold_an_event(conn, first.id)
        later_task = (await pg.submit(make_new_task({"prompt": "two"}))).task
        assert [e.seq for e in await pg.tail(after=0)] == [held - 1]  # waiting
        conn.execute("ROLLBACK")
    # When the tail reads again
    events = await pg.tail(after=held - 1)
    # Then the gap is known to be permanent and the later event comes through
    assert [(e.seq, e.task_id) for e in events] == [(held + 1, later_task.id)]


async def test_a_tail_behind_an_unrelated_long_transaction_still_moves_on(
    pg: PostgresStore,
) -> None:
    # Given a rolled-back seq seen while an unrelated transaction stays open
    first = (await pg.submit(make_new_task({"prompt": "one"}))).task
    with (
        psycopg.connect(pg.url, autocommit=True) as long_running,
        psycopg.connect(pg.url, autocommit=True) as conn,
    ):
        long_running.execute("BEGIN")
        long_running.execute("SELECT pg_current_xact_id()")  # a writer: it has an id
        held = _hold_an_event(conn, first.id)
        conn.execute("ROLLBACK")
        later = (await pg.submit(make_new_task({"prompt": "two"}))).task
        # When the tail first sees the gap, an older transaction may still hold it
        assert [e.seq for e in await pg.tail(after=0)] == [held - 1]
        # When that transaction ends
        long_running.execute("COMMIT")
    # Then the gap is given up and the tail goes on
    assert [e.task_id for e in await pg.tail(after=held - 1)] == [later.id]


async def test_a_stream_on_one_store_sees_a_task_moved_by_another(
    postgres_server: PostgresServer,
) -> None:
    # Given two stores on one database, as on two machines
    url = postgres_server.new_database()
    api = await PostgresStore.open(url, clock=time.time)
    worker = await PostgresStore.open(url, clock=time.time)
    try:
        start = await api.last_seq()
        task = (await worker.submit(make_new_task())).task
        claimed = await worker.claim(worker_id="w1", kinds=[KIND], limit=1, lease_ttl_s=30)
        assert [t.id for t in claimed] == [task.id]
        # When the API's tail reads
        events = await api.tail(after=start)
        # Then it has both events of the task, in order
        assert [(e.task_id, e.status) for e in events] == [
            (task.id, Status.PENDING),
            (task.id, Status.WAITING_FOR_RESOURCE),
        ]
    finally:
        await api.close()
        await worker.close()


async def test_a_listener_hears_work_made_ready_in_another_store(
    postgres_server: PostgresServer,
) -> None:
    # Given a store listening for ready work, and another store
    url = postgres_server.new_database()
    listener = await PostgresStore.open(url, clock=time.time)
    other = await PostgresStore.open(url, clock=time.time)
    heard = asyncio.Event()
    try:
        connected = asyncio.Event()
        listener.watch_ready(connected.set)  # fires once when LISTEN is in place
        await asyncio.wait_for(connected.wait(), 10)
        listener.watch_ready(heard.set)
        # When the other store accepts a task
        await other.submit(make_new_task())
        # Then the listener hears of it
        await asyncio.wait_for(heard.wait(), 10)
    finally:
        await listener.close()
        await other.close()


# Query plans ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def filled(postgres_server: PostgresServer) -> Iterator[psycopg.Connection[Any]]:
    """A database with 20,000 tasks across statuses, analysed."""
    url = postgres_server.new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        statuses = ["SUCCESS"] * 16 + ["PENDING", "GENERATING", "FAILED", "RETRYING"]
        conn.execute(
            "INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata,"
            " inputs, fingerprint, dedup_key, max_attempts, deadline_s, deadline_at, timeouts,"
            " created_at, updated_at, status_since, lease_expires_at, finished_at)"
            " SELECT 'tsk_' || lpad(i::text, 8, '0'), 't' || (i %% 7), 'k' || (i %% 3),"
            " (%s::text[])[1 + i %% 20], i %% 5, i, '{}', '{}', '[]', 'f', 'd' || i, 3, 600,"
            " 1e12, %s, i, i, i, CASE WHEN i %% 20 = 1 THEN 1e12 END, i"
            " FROM generate_series(1, 20000) AS i",
            (statuses, json.dumps({"waiting_s": 1, "generating_s": 1, "uploading_s": 1})),
        )
        conn.execute(
            "INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
            " attempt, epoch, at, dwell_s) SELECT 'e' || i, 'tsk_' || i, 't' || (i % 7),"
            " 'claim', 'PENDING', 'WAITING_FOR_RESOURCE', false, 1, 1, i, 0.1"
            " FROM generate_series(1, 20000) AS i"
        )
        conn.execute("ANALYZE")
        yield conn


HOT = {
    "claim candidates": (Q.claim_candidates, ("k1", 1e9, 1e9, 8)),
    "claim warm candidates": (Q.claim_warm, ("k1", "m1", 1e9, 1e9, 8)),
    "claim routed candidates": (Q.claim_routed, ("k1", 1e9, 1e9, ["m1"], 1e9 - 5, 8)),
    "a model's heads": (Q.heads_of_model, ("k1", "m1", 1e9, 1e9, 8)),
    "dedup lookup": (Q.dedup_lookup, ("t1", "d8")),
    "claim a tenant's line": (Q.heads_of_tenant, ("k1", "t1", 1e9, 1e9, 8)),
    "claim a priority level": (Q.heads_of_level, ("k1", 2, 1e9, 1e9, 8)),
    "priority levels": (Q.levels_of_tenant, ("k1", "t1", "k1", "t1")),
    "queue position, levels above": (Q.queue_due_above, due_above_args("k1", None, 2, 1e9)),
    "queue position in a level": (
        Q.queue_place,
        place_args(("k1", 2), 500.0, "tsk_x", 1e9, 256),
    ),
    "queue position in a tenant's level": (
        Q.queue_place_of_tenant,
        place_args(("k1", "t1", 2), 500.0, "tsk_x", 1e9, 256),
    ),
    "a page's queue positions": (
        Q.queue_places_of_level,
        ("k1", 2, 500.0, "tsk_x", 600.0, "tsk_y", 1e9, 1e9, ["tsk_x"]),
    ),
    "autoscaling: ready by kind": (Q.ready_by_kind, (1e9,)),
    "autoscaling: claimed tasks": (Q.claimed_tasks, ()),
    "due": (Q.due, (100.0, 100)),
    "due cancels": (Q.due_cancel, (100.0, 100)),
    "ghosts": (Q.ghosts, (100.0, 100.0)),
    "dwell": (Q.dwell, (10_000,)),
    "dwell of a tenant": (Q.dwell_of_tenant, ("t3", 10_000)),
    "purge": (Q.sql(purge_candidates(1e9, None, (), 500)[0]), (1e9, 500)),
    "purge sparing tenants": (
        Q.sql(purge_candidates(1e9, None, ("t1",), 500)[0]),
        (1e9, "t1", 500),
    ),
}
#: An attempt's ledger row as the supervisor writes it (no pool: its slot rows are read).
USAGE_ARGS = {
    "task_id": "tsk_500", "attempt": 1, "epoch": 1, "tenant": "t1", "kind": "k1",
    "model": None, "pool": None, "worker": "w", "outcome": "expired", "source": "GENERATING",
    "dwell_s": 1.0, "loading_s": 0.0, "share": 1.0, "ended_at": 1e9,
}  # fmt: skip


def plan(conn: psycopg.Connection[Any], sql: str, args: Args) -> str:
    rows = conn.execute(f"EXPLAIN {sql}", args).fetchall()  # type: ignore[arg-type]
    return "\n".join(row[0] for row in rows)


@pytest.mark.parametrize("name", sorted(HOT))
def test_hot_query_reads_through_an_index(filled: psycopg.Connection[Any], name: str) -> None:
    sql, args = HOT[name]
    found = plan(filled, sql, args)
    assert "Seq Scan" not in found, found
    assert "Index" in found, found


def test_the_pools_lines_are_read_without_scanning_the_tasks(
    filled: psycopg.Connection[Any],
) -> None:
    # Given the autoscaling read of the pools' live lines (pool_slots holds only the rows of
    # tasks waiting for or holding a slot: a scan of it is the cheap way)
    found = plan(filled, Q.pool_line_rows, (1e9,))
    # Then the tasks are reached through an index, never scanned
    assert "Seq Scan on tasks" not in found, found
    assert "Index" in found, found


def test_an_attempts_ledger_row_reads_its_events_through_their_index(
    filled: psycopg.Connection[Any],
) -> None:
    # (pool_slots is empty here, so a scan of it is the cheap plan: not checked)
    found = plan(filled, USAGE_ROW["postgres"], USAGE_ARGS)
    assert "Index Scan using events_task on events" in found, found
    assert "Seq Scan on events" not in found, found


def test_the_plan_check_tells_a_scan_apart(filled: psycopg.Connection[Any]) -> None:
    found = plan(filled, "SELECT * FROM tasks WHERE params = %s", ("{}",))
    assert "Seq Scan" in found


# Migrations ------------------------------------------------------------------------------


async def test_migrations_apply_once_across_concurrent_processes(
    postgres_server: PostgresServer,
) -> None:
    # Given an empty database and several connections migrating it at once
    url = postgres_server.new_database(template=None)

    async def run() -> int:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            return await migrate(conn)

    applied = await asyncio.gather(*(run() for _ in range(4)))
    # Then every version was applied once, and once more is nothing
    assert sum(applied) == len(migrations("postgres"))
    assert await run() == 0
    with psycopg.connect(url) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_migrations")]
    assert sorted(versions) == [v for v, _, _ in migrations("postgres")]


async def test_a_store_upgrades_a_database_at_an_older_version_in_place(
    postgres_server: PostgresServer,
) -> None:
    # Given a database with a task, migrated up to the first version only
    url = postgres_server.new_database(template=None)
    first_version, _, first_sql = migrations("postgres")[0]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(first_sql.encode())
        conn.execute(
            "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute(
            "INSERT INTO schema_migrations (version, name) VALUES (%s, 'first')", (first_version,)
        )
    before = await PostgresStore.open(url, clock=time.time)
    task = (await before.submit(make_new_task())).task
    await before.close()
    # When a store opens it
    store = await PostgresStore.open(url, clock=time.time)
    try:
        # Then the task is still there and the store works on it
        assert await store.get(task.id) == task
        claimed = await store.claim(worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=30)
        assert [t.id for t in claimed] == [task.id]
    finally:
        await store.close()


async def test_an_unreachable_database_raises_store_unavailable(
    postgres_server: PostgresServer,
) -> None:
    # Given a URL where nothing listens
    store = PostgresStore(f"postgresql://kiln@127.0.0.1:{free_port()}/x", clock=time.time)
    # Then every call says the store is unavailable
    with pytest.raises(StoreUnavailable):
        await store.get("tsk_x")
    await store.close()


async def test_many_first_calls_at_once_migrate_once(postgres_server: PostgresServer) -> None:
    # Given a store nobody has used yet on an empty database
    url = postgres_server.new_database(template=None)
    store = PostgresStore(url, clock=time.time, pool_size=4)
    try:
        # When 200 calls arrive at once
        found = await asyncio.gather(*(store.get(f"tsk_{i}") for i in range(200)))
        # Then they all answer, and the schema was applied once
        assert found == [None] * 200
        with psycopg.connect(url) as conn:
            versions = [r[0] for r in conn.execute("SELECT version FROM schema_migrations")]
        assert sorted(versions) == [v for v, _, _ in migrations("postgres")]
    finally:
        await store.close()


# the batch of one-statement writes


async def test_concurrent_steps_share_one_transaction_and_each_stays_its_own_cas(
    pg: PostgresStore,
) -> None:
    # Given 20 claimed tasks, 3 of which moved on since their worker read them
    for n in range(20):
        await pg.submit(make_new_task({"n": n}))
    claimed = await pg.claim(worker_id="w", kinds=[KIND], limit=20, lease_ttl_s=60)
    stale = {t.id for t in claimed[::7]}
    for task in claimed:
        if task.id in stale:
            await pg.apply(step_change(task, Event.EXPIRE, fenced=False, bump_epoch=True))
    before = pg.write_batches
    counts_before = await pg.counters()
    # When the 20 workers' acquires arrive at once
    results = await asyncio.gather(
        *(pg.apply(step_change(t, Event.ACQUIRE)) for t in claimed), return_exceptions=True
    )
    # Then they went as one batch, the stale ones were refused alone, the others committed
    transactions, writes = (a - b for a, b in zip(pg.write_batches, before, strict=True))
    assert (transactions, writes) == (1, 20)
    for task, result in zip(claimed, results, strict=True):
        if task.id in stale:
            assert isinstance(result, LeaseLost)
        else:
            assert not isinstance(result, BaseException)
            moved, events = result
            assert moved.status is Status.GENERATING and len(events) == 1
            assert events[0].seq > 0 and events[0].event is Event.ACQUIRE
    # And counts, counters and logs agree with what committed
    counters = await pg.counters()
    moved_key = ("transitions", "WAITING_FOR_RESOURCE>GENERATING")
    assert counters[moved_key] - counts_before.get(moved_key, 0) == 17
    assert counters[("stale_writes", "")] - counts_before.get(("stale_writes", ""), 0) == 3
    stats = await pg.stats(tenant=None, ghost_after_s=60)
    assert stats.counts["GENERATING"] == 17 and stats.counts["TIMEOUT"] == 3
    for task in claimed:
        events = await pg.events(task_id=task.id)
        assert replay((e.event, e.from_status, e.status) for e in events) is (
            Status.TIMEOUT if task.id in stale else Status.GENERATING
        )


async def test_steps_of_one_shape_share_a_statement_and_each_row_gets_its_own_values(
    pg: PostgresStore,
) -> None:
    # Given 16 claimed tasks: 8 to acquire, 8 acquired already, one of which moved on
    for n in range(16):
        await pg.submit(make_new_task({"n": n}))
    claimed = await pg.claim(worker_id="w", kinds=[KIND], limit=16, lease_ttl_s=60)
    to_acquire, running = claimed[:8], []
    for task in claimed[8:]:
        moved, _ = await pg.apply(step_change(task, Event.ACQUIRE))
        running.append(moved)
    gone = running[3]
    await pg.apply(step_change(gone, Event.EXPIRE, fenced=False, bump_epoch=True))
    before = pg.write_statements
    # When the acquires and the generated steps (each with its own stage) arrive at once
    acquires = [pg.apply(step_change(t, Event.ACQUIRE)) for t in to_acquire]
    reports = [
        pg.apply(step_change(t, Event.GENERATED, fields={"stage": f"stage of {t.id}"}))
        for t in running
    ]
    results = await asyncio.gather(*acquires, *reports, return_exceptions=True)
    # Then each shape went as one statement over arrays
    assert pg.write_statements - before == 2
    # And every row got its own values, version and event; the one that moved on was refused
    for task, result in zip(to_acquire + running, results, strict=True):
        if task.id == gone.id:
            assert isinstance(result, LeaseLost)
            continue
        assert not isinstance(result, BaseException)
        moved, events = result
        stored = await pg.get(task.id)
        assert stored is not None and stored.version == moved.version == task.version + 1
        if task in running:
            assert moved.status is Status.UPLOADING and moved.stage == f"stage of {task.id}"
        else:
            assert moved.status is Status.GENERATING and moved.stage is None
        (event,) = events
        assert event.id == f"{task.id}:{moved.version}" and event.task_id == task.id
        assert [e.seq for e in await pg.events(task_id=task.id)][-1] == event.seq
        assert event.dwell_s is not None and event.dwell_s >= 0
    stats = await pg.stats(tenant=None, ghost_after_s=60)
    assert (stats.counts["GENERATING"], stats.counts["UPLOADING"]) == (8, 7)


async def test_steps_of_two_events_share_a_statement_each_logging_both(
    pg: PostgresStore,
) -> None:
    # Given six acquired tasks with nothing to upload, one of which moved on
    for n in range(6):
        await pg.submit(make_new_task({"n": n}))
    claimed = await pg.claim(worker_id="w", kinds=[KIND], limit=6, lease_ttl_s=60)
    running = [(await pg.apply(step_change(t, Event.ACQUIRE)))[0] for t in claimed]
    gone = running[2]
    await pg.apply(step_change(gone, Event.EXPIRE, fenced=False, bump_epoch=True))
    before, counts_before = pg.write_statements, await pg.counters()
    # When their generated-then-uploaded changes arrive at once
    chained = [step_change(t, Event.GENERATED, (Event.UPLOADED, Status.SUCCESS)) for t in running]
    results = await asyncio.gather(*map(pg.apply, chained), return_exceptions=True)
    # Then they went as one statement over arrays, the one that moved on refused
    assert pg.write_statements - before == 1
    for task, result in zip(running, results, strict=True):
        if task.id == gone.id:
            assert isinstance(result, LeaseLost)
            continue
        assert not isinstance(result, BaseException)
        moved, events = result
        # And each row is two versions on, its two events exactly those of the log
        assert (moved.status, moved.version) == (Status.SUCCESS, task.version + 2)
        assert events == (await pg.events(task_id=task.id))[-2:]
        assert [(e.event, e.status, e.final) for e in events] == [
            (Event.GENERATED, Status.UPLOADING, False),
            (Event.UPLOADED, Status.SUCCESS, True),
        ]
    # And counts and both transitions' counters agree with what committed
    stats = await pg.stats(tenant=None, ghost_after_s=60)
    assert (stats.counts["SUCCESS"], stats.counts["UPLOADING"]) == (5, 0)
    counters = await pg.counters()
    for key in ("GENERATING>UPLOADING", "UPLOADING>SUCCESS"):
        moved_key = ("transitions", key)
        assert counters[moved_key] - counts_before.get(moved_key, 0) == 5


async def test_a_step_of_two_events_alone_counts_itself(pg: PostgresStore) -> None:
    # Given one acquired task
    await pg.submit(make_new_task())
    (task,) = await pg.claim(worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=60)
    task, _ = await pg.apply(step_change(task, Event.ACQUIRE))
    # When its generated-then-uploaded change is written alone
    change = step_change(task, Event.GENERATED, (Event.UPLOADED, Status.SUCCESS))
    moved, events = await pg.apply(change)
    assert (moved.status, moved.version) == (Status.SUCCESS, task.version + 2)
    # Then the task and its events are those of the log, and the counts moved once
    assert events == (await pg.events(task_id=task.id))[-2:]
    counts = (await pg.stats(tenant=None, ghost_after_s=60)).counts
    assert (counts["SUCCESS"], counts["GENERATING"], counts["UPLOADING"]) == (1, 0, 0)


async def test_a_value_an_array_does_not_take_refuses_no_other_write_of_its_batch(
    pg: PostgresStore,
) -> None:
    # Given five acquired tasks
    for n in range(5):
        await pg.submit(make_new_task({"n": n}))
    claimed = await pg.claim(worker_id="w", kinds=[KIND], limit=5, lease_ttl_s=60)
    running = [(await pg.apply(step_change(t, Event.ACQUIRE)))[0] for t in claimed]
    # When their generated steps arrive at once, one with a progress step of 1.5 (a float
    # for an integer column: a cast from text refuses it, a statement of its own rounds it)
    results = await asyncio.gather(*(
        pg.apply(step_change(t, Event.GENERATED, fields={"progress_step": 1.5 if n == 2 else n}))
        for n, t in enumerate(running)
    ), return_exceptions=True)  # fmt: skip
    # Then every one of them committed
    for result in results:
        assert not isinstance(result, BaseException), result
        assert result[0].status is Status.UPLOADING
    assert [r[0].progress_step for r in results] == [0, 1, 2, 3, 4]  # type: ignore[index]


async def test_concurrent_submissions_share_transactions_and_dedup_still_holds(
    pg: PostgresStore,
) -> None:
    # When 30 submissions arrive at once, 10 of them the same content
    news = [make_new_task({"n": n}) for n in range(20)] + [
        make_new_task({"same": True}) for _ in range(10)
    ]
    before, statements = pg.write_batches, pg.write_statements
    results = await asyncio.gather(*(pg.submit(new) for new in news))
    transactions, _ = (a - b for a, b in zip(pg.write_batches, before, strict=True))
    # Then they took fewer transactions than submissions, went as one statement over
    # arrays (the same content inserted once in it), and made 21 tasks
    assert transactions < 30
    assert pg.write_statements - statements == 1
    assert len({r.task.id for r in results}) == 21
    assert sum(r.created for r in results) == 21
    assert (await pg.stats(tenant=None, ghost_after_s=60)).counts["PENDING"] == 21
