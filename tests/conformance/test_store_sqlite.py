"""SQLite-only checks: the hot queries' plans use their indexes, and migrations.

The query texts are the store's own named queries, so a change to a query is checked here.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.errors import StoreUnavailable
from kiln.store.effects import USAGE_ROW
from kiln.store.positions import BELOW_ALL, due_above_args, place_args
from kiln.store.queries import migrations, queries
from kiln.store.sqlite import SqliteStore, connect, migrate
from kiln.store.sqlstore import purge_candidates
from kiln.store.tx import Args

from .factories import make_new_task

NOW = 1_800_000_000.0
TASKS = 5000

#: A few thousand tasks in every status, kind, tenant and timing the queries care about.
FILL_SQL = """
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :count),
shaped AS (
    SELECT i, CASE i % 10
        WHEN 0 THEN 'PENDING' WHEN 1 THEN 'RETRYING' WHEN 2 THEN 'WAITING_FOR_RESOURCE'
        WHEN 3 THEN 'GENERATING' WHEN 4 THEN 'UPLOADING' WHEN 5 THEN 'NEEDS_REVIEW'
        WHEN 6 THEN 'FAILED' WHEN 7 THEN 'TIMEOUT' WHEN 8 THEN 'CANCELLED'
        ELSE 'SUCCESS' END AS status
    FROM n
)
INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata, inputs,
    fingerprint, idempotency_key, dedup_key, attempt, max_attempts, epoch, version,
    lease_owner, lease_expires_at, state_deadline_at, deadline_s, deadline_at, timeouts,
    cancel_requested, cancel_requested_at, created_at, updated_at, status_since)
SELECT printf('tsk_%08d', i), 't' || (i % 7), 'kind.' || (i % 4), status, i % 3,
    :now - 1000 + i % 2000, '{}', '{}', '[]', 'f' || i, NULL, 'd' || (i % 3000), 1, 3, 1, 3,
    CASE WHEN status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING') THEN 'w' END,
    CASE WHEN status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING')
        THEN :now - 50 + i % 100 END,
    CASE WHEN status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING')
        THEN :now - 40 + i % 100 END,
    3600, :now - 100 + i % 4000, '{"waiting_s":600,"generating_s":600,"uploading_s":120}',
    i % 13 = 0, CASE WHEN i % 13 = 0 THEN :now - i % 60 END, :now, :now, :now
FROM shaped
"""

Q = queries("sqlite")

#: name -> (query, parameters, the indexes it may use)
#: An attempt's ledger row as the supervisor writes it (no pool: its slot rows are read).
USAGE_ARGS = {
    "task_id": "tsk_00000500", "attempt": 1, "epoch": 1, "tenant": "t1", "kind": "kind.1",
    "model": None, "pool": None, "worker": "w", "outcome": "expired", "source": "GENERATING",
    "dwell_s": 1.0, "loading_s": 0.0, "share": 1.0, "ended_at": NOW,
}  # fmt: skip
HOT_QUERIES: dict[str, tuple[str, tuple[Any, ...], tuple[str, ...]]] = {
    "claim": (Q.claim_candidates, ("kind.1", NOW, NOW, 16), ("tasks_claim",)),
    "claim_warm": (Q.claim_warm, ("kind.1", "m1", NOW, NOW, 16), ("tasks_claim_model",)),
    "claim_routed": (
        Q.claim_routed,
        ("kind.1", NOW, NOW, '["m1"]', NOW - 5, 16),
        ("tasks_claim",),
    ),
    "heads_of_model": (Q.heads_of_model, ("kind.1", "m1", NOW, NOW, 16), ("tasks_claim_model",)),
    "due": (Q.due, (NOW, 500), ("tasks_due",)),
    "due_cancel": (Q.due_cancel, (NOW - 10, 500), ("tasks_cancel_due",)),
    "ghosts": (Q.ghosts, (NOW - 30, NOW - 30), ("tasks_due",)),
    "ghosts_of_tenant": (
        Q.ghosts_of_tenant,
        (NOW - 30, NOW - 30, "t1"),
        ("tasks_due", "tasks_tenant_status_id"),
    ),
    "dedup_lookup": (Q.dedup_lookup, ("t1", "d17"), ("tasks_dedup",)),
    "purge": (Q.sql(purge_candidates(NOW, None, (), 500)[0]), (NOW, 500), ("tasks_finished",)),
    "purge_sparing_tenants": (
        Q.sql(purge_candidates(NOW, None, ("t1", "t2"), 500)[0]),
        (NOW, "t1", "t2", 500),
        ("tasks_finished",),
    ),
    "dwell_of_tenant": (Q.dwell_of_tenant, ("t1", 10_000), ("events_tenant",)),
    "claim_tenant_line": (
        Q.heads_of_tenant,
        ("kind.1", "t1", NOW, NOW, 16),
        ("tasks_claim_tenant",),
    ),
    "claim_priority_level": (
        Q.heads_of_level,
        ("kind.1", 2, NOW, NOW, 16),
        ("tasks_claim",),
    ),
    "claim_tenant_priority_level": (
        Q.heads_of_tenant_level,
        ("kind.1", "t1", 2, NOW, NOW, 16),
        ("tasks_claim_tenant",),
    ),
    "priority_levels": (Q.levels, ("kind.1", "kind.1"), ("tasks_claim",)),
    "queue_positions_of_level": (
        Q.queue_places_of_level,
        ("kind.1", 1, NOW - 500, "tsk_00000500", NOW - 400, "tsk_00000600", NOW, NOW, "[]"),
        ("tasks_claim",),
    ),
    "usage_row": (USAGE_ROW["sqlite"], USAGE_ARGS, ("events_task",)),
    "queue_position_levels_above": (
        Q.queue_due_above,
        due_above_args("kind.1", None, 1, NOW),
        ("tasks_claim", "tasks_due"),
    ),
    "queue_position_in_level": (
        Q.queue_place,
        place_args(("kind.1", 1), NOW - 500, "tsk_00000500", NOW, 256),
        ("tasks_claim", "tasks_due"),
    ),
    "queue_position_in_a_tenants_level": (
        Q.queue_place_of_tenant,
        place_args(("kind.1", "t1", 1), NOW - 500, "tsk_00000500", NOW, 256),
        ("tasks_claim_tenant", "tasks_due"),
    ),
    "queue_depth_of_a_tenant": (
        Q.queue_due_above_of_tenant,
        due_above_args("kind.1", "t1", BELOW_ALL, NOW),
        ("tasks_claim_tenant", "tasks_due"),
    ),
    # The autoscaling signals (store/load.py): live tasks only, whatever the history.
    "autoscaling_ready_by_kind": (Q.ready_by_kind, (NOW,), ("tasks_claim",)),
    "autoscaling_pool_lines": (
        Q.pool_line_rows,
        (NOW,),
        ("tasks_claimed", "tasks_tenant_status_id", "tasks_pkey", "pool_slots_task"),
    ),
}


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sqlite3.Connection]:
    path = tmp_path_factory.mktemp("plans") / "kiln.db"
    conn = connect(str(path))
    conn.row_factory = sqlite3.Row
    migrate(conn)
    conn.execute(FILL_SQL, {"count": TASKS, "now": NOW})
    conn.execute("ANALYZE")
    yield conn
    conn.close()


def plan(conn: sqlite3.Connection, sql: str, args: Args) -> list[str]:
    return [row["detail"] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args)]


def test_the_table_holds_thousands_of_tasks(filled: sqlite3.Connection) -> None:
    statuses = dict(filled.execute("SELECT status, COUNT(*) FROM tasks GROUP BY status"))
    assert sum(statuses.values()) == TASKS
    assert len(statuses) == 10


@pytest.mark.parametrize("name", sorted(HOT_QUERIES))
def test_hot_query_reads_through_its_index(filled: sqlite3.Connection, name: str) -> None:
    # Given a table of thousands of tasks with statistics
    sql, args, indexes = HOT_QUERIES[name]
    # When SQLite plans the query the store runs
    details = plan(filled, sql, args)
    # Then it searches an index instead of scanning the table, and sorts nothing
    uses_index = [d for d in details if "USING INDEX" in d or "USING COVERING INDEX" in d]
    assert uses_index, details
    assert any(f"INDEX {index} " in d for d in uses_index for index in indexes), details
    assert not [d for d in details if d.startswith("SCAN tasks")], details
    assert not [d for d in details if "TEMP B-TREE" in d], details


def test_the_claimed_tasks_are_read_from_their_own_index_alone(
    filled: sqlite3.Connection,
) -> None:
    # Given the autoscaling read of every claimed task (WAITING_FOR_RESOURCE, GENERATING,
    # UPLOADING: as many as the workers' slots)
    details = plan(filled, Q.claimed_tasks, ())
    # Then it walks the partial index that holds exactly those tasks, never the table
    assert details == ["SCAN tasks USING COVERING INDEX tasks_claimed"], details


def test_dwell_of_all_tenants_reads_only_the_latest_events(filled: sqlite3.Connection) -> None:
    # The event log is read backwards in seq (rowid) order: the LIMIT stops the scan, and
    # nothing is sorted, so the cost is the window, not the log's length.
    details = plan(filled, Q.dwell, (10_000,))
    assert details == ["SCAN events"], details


def test_plan_check_tells_a_scan_apart(filled: sqlite3.Connection) -> None:
    details = plan(filled, "SELECT * FROM tasks WHERE fingerprint = ?", ("f1",))
    assert any(d.startswith("SCAN tasks") for d in details)


# migrations ------------------------------------------------------------------------------


def schema(conn: sqlite3.Connection) -> set[tuple[str, str, str, str]]:
    rows = conn.execute(
        "SELECT type, name, tbl_name, sql FROM sqlite_master"
        " WHERE name NOT IN ('schema_migrations', 'sqlite_sequence')"
        " AND name NOT LIKE 'sqlite_autoindex_%' AND name NOT LIKE 'sqlite_stat%'"
    ).fetchall()
    return {(r[0], r[1], r[2], " ".join(str(r[3]).split())) for r in rows}


def declared_schema(directory: Path) -> set[tuple[str, str, str, str]]:
    """Every migration file run as one script on an empty database."""
    conn = sqlite3.connect(directory / "declared.db")
    try:
        conn.executescript("\n".join(sql for _, _, sql in migrations("sqlite")))
        return schema(conn)
    finally:
        conn.close()


def migrated_from(directory: Path, applied_first: int) -> sqlite3.Connection:
    """A database at the version after ``applied_first`` migrations, then migrated."""
    conn = connect(str(directory / f"from-{applied_first}.db"))
    conn.execute(
        "CREATE TABLE schema_migrations "
        "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
    )
    for version, name, sql in migrations("sqlite")[:applied_first]:
        conn.executescript(sql)
        conn.execute("INSERT INTO schema_migrations VALUES (?, ?, 'then')", (version, name))
    applied = migrate(conn)
    assert applied == len(migrations("sqlite")) - applied_first
    return conn


def test_there_is_at_least_one_numbered_migration() -> None:
    versions = [version for version, _, _ in migrations("sqlite")]
    assert versions
    assert versions == sorted(set(versions))


def test_migrated_schema_equals_the_declared_one(tmp_path: Path) -> None:
    # Given the schema that all migration files declare together
    declared = declared_schema(tmp_path)
    assert {"tasks", "events", "idempotency_keys", "tasks_dedup", "tasks_claim"} <= {
        name for _, name, _, _ in declared
    }
    # Then a database migrated from any earlier version ends with exactly that schema
    for applied_first in range(len(migrations("sqlite"))):
        conn = migrated_from(tmp_path, applied_first)
        try:
            assert schema(conn) == declared
        finally:
            conn.close()


def test_migrating_twice_is_a_no_op(tmp_path: Path) -> None:
    conn = connect(str(tmp_path / "kiln.db"))
    try:
        assert migrate(conn) == len(migrations("sqlite"))
        before = schema(conn), conn.execute("SELECT * FROM schema_migrations").fetchall()
        assert migrate(conn) == 0
        after = schema(conn), conn.execute("SELECT * FROM schema_migrations").fetchall()
        assert [tuple(r) for r in after[1]] == [tuple(r) for r in before[1]]
        assert after[0] == before[0]
    finally:
        conn.close()


def test_concurrent_migrations_apply_each_version_once(tmp_path: Path) -> None:
    # Given several connections migrating one new file at the same time
    path = str(tmp_path / "kiln.db")
    start = threading.Barrier(4)
    applied: list[int] = []

    def run() -> None:
        conn = connect(path)
        try:
            start.wait()
            applied.append(migrate(conn))
        finally:
            conn.close()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then every version was applied exactly once (each by whichever got there first)
    assert len(applied) == 4 and sum(applied) == len(migrations("sqlite"))
    conn = connect(path)
    try:
        assert conn.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0] == len(
            migrations("sqlite")
        )
    finally:
        conn.close()


async def test_reopening_a_store_keeps_its_tasks(tmp_path: Path) -> None:
    path = str(tmp_path / "kiln.db")
    first = SqliteStore(path, clock=lambda: NOW)
    submitted = (await first.submit(make_new_task())).task
    await first.close()
    second = SqliteStore(path, clock=lambda: NOW)
    try:
        assert await second.get(submitted.id) == submitted
        assert (await second.submit(make_new_task())).task.id == submitted.id
    finally:
        await second.close()


async def test_a_damaged_database_file_is_refused_with_what_to_do(tmp_path: Path) -> None:
    # Given a file that is not a SQLite database where the store's database should be
    path = tmp_path / "kiln.db"
    path.write_bytes(b"this is not a database, it is a shopping list\n" * 200)
    # When the store opens it, then it says which file and what to do, as kiln's own error
    with pytest.raises(StoreUnavailable) as refused:
        SqliteStore(str(path), clock=lambda: NOW)
    message = str(refused.value)
    assert str(path) in message and "KILN_DATABASE_URL" in message
    assert "file is not a database" in message
    assert refused.value.__cause__ is None  # no sqlite3 error chained behind it


async def test_an_operation_that_fails_after_it_wrote_rolls_back_alone(tmp_path: Path) -> None:
    """A batch runs without a savepoint per operation; one that fails after it changed a
    row sends the batch round again with a savepoint each, and rolls back alone (I11)."""
    store = SqliteStore(str(tmp_path / "kiln.db"), clock=lambda: NOW)
    try:
        await store._write(lambda tx: tx.run("CREATE TABLE t (n INTEGER)"))

        def put(n: int) -> Any:
            async def op(tx: Any) -> int:
                return await tx.run("INSERT INTO t VALUES (?)", (n,))

            return op

        async def put_then_refuse(tx: Any) -> None:
            await tx.run("INSERT INTO t VALUES (99)")
            raise ValueError("refused after it wrote")

        async def refuse(tx: Any) -> None:
            raise ValueError("refused before it wrote")

        # Given a batch in which one operation fails before it writes: no second round
        done = await store._write_many([put(1), refuse, put(2)])
        assert [type(d) for d in done] == [int, ValueError, int]
        assert store._writer.reruns == 0

        # When one fails after it wrote
        done = await store._write_many([put(3), put_then_refuse, put(4)])

        # Then its row is gone, the others' rows are there, and its error is its own
        assert [type(d) for d in done] == [int, ValueError, int]
        assert str(done[1]) == "refused after it wrote"
        rows = await store._read(lambda tx: tx.all("SELECT n FROM t ORDER BY n"))
        assert [r[0] for r in rows] == [1, 2, 3, 4]
        assert store._writer.reruns == 1
    finally:
        await store.close()
