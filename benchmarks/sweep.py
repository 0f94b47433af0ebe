"""The supervisor's sweep over a large task table with nothing due.

Fills a store with N tasks (default 1,000,000) in a production-like mix: mostly final
(SUCCESS, FAILED, CANCELLED, TIMEOUT), many PENDING and RETRYING whose deadlines are far
off, a few thousand running with live leases (some asked to cancel, within the grace
period). The rows go in by bulk ``INSERT … SELECT`` statements of 100,000 rows on the
driver's own connection: the point is the table, not the submit path. Then, with nothing
due, it times, median of ``--runs`` runs each:

- each query the sweep reads, as the store writes it (``kiln/store/sql``), on the driver
  connection: ``due`` (expired leases, state timeouts, deadlines), ``due_cancel`` (forced
  cancellation), ``ghosts`` (lapsed leases nobody swept), ``purge`` (the retention pass's
  candidates, every minute when retention is on) and ``lead`` (the leader row, a write);
- the store's calls the sweep makes (``lead``, ``due``, ``count_ghosts``);
- ``Supervisor.sweep()`` itself, on an app whose clock stands still at the fill's time;

and prints each query's plan: SQLite ``EXPLAIN QUERY PLAN`` (as the store leaves the file,
without ``ANALYZE``, and after it), PostgreSQL ``EXPLAIN (ANALYZE, BUFFERS)`` for the plan
of the given values and for the generic plan of a prepared statement (which psycopg's
prepared statements may get after five runs). The last line is one JSON object.

    python benchmarks/sweep.py                                # SQLite and PostgreSQL
    python benchmarks/sweep.py --backend sqlite --tasks 100000 --runs 50
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kiln
from kiln.store import open_store
from kiln.store.queries import queries
from kiln.store.sqlstore import purge_candidates
from kiln.supervisor import Supervisor

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: The fill's "now": every lease, deadline and retry time is set against it, and every
#: timed query and sweep reads at it, so nothing falls due while the run goes on.
NOW = 1_800_000_000.0
AIM_MS = 10.0
CHUNK = 100_000
CANCEL_GRACE_S = 10.0
BATCH = 500  # Supervisor(batch=...): the sweep's LIMIT
#: One microsecond per reading: the clock of the timed app moves just enough that each
#: leader renewal writes a new expiry.
TICKS = itertools.count()

#: Status by ``i % 100``: 70% SUCCESS, 8% FAILED, 2% CANCELLED, 1% TIMEOUT, 1% NEEDS_REVIEW,
#: 12% PENDING, 2% RETRYING, 4% running (1% waiting for a slot, 2% generating, 1% uploading).
STATUS = """CASE
    WHEN i % 100 < 70 THEN 'SUCCESS' WHEN i % 100 < 78 THEN 'FAILED'
    WHEN i % 100 < 80 THEN 'CANCELLED' WHEN i % 100 = 80 THEN 'TIMEOUT'
    WHEN i % 100 = 81 THEN 'NEEDS_REVIEW' WHEN i % 100 < 94 THEN 'PENDING'
    WHEN i % 100 < 96 THEN 'RETRYING' WHEN i % 100 = 96 THEN 'WAITING_FOR_RESOURCE'
    WHEN i % 100 < 99 THEN 'GENERATING' ELSE 'UPLOADING' END"""
RUNNING = "('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING')"
FINAL = "('SUCCESS', 'FAILED', 'CANCELLED', 'TIMEOUT')"

#: Rows i in [lo, hi): created over the day before NOW (ids in creation order), final
#: ones finished 30 s after creation, active ones with a day's deadline from NOW, running
#: ones with a lease 5-30 s ahead and a state timeout minutes ahead, a tenth of them asked
#: to cancel 0-9 s ago, retries due in 1-10 minutes.
FILL = f"""
INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata, inputs,
    fingerprint, attempt, max_attempts, epoch, version, lease_owner, lease_expires_at,
    state_deadline_at, deadline_s, deadline_at, timeouts, cancel_requested,
    cancel_requested_at, next_retry_at, result_prefix, error, result, created_at, updated_at,
    status_since, started_at, finished_at)
SELECT 'tsk_' || (10000000000 + i), 't' || (i % 50), 'image.generate', status, i % 3,
    CASE WHEN status = 'RETRYING' THEN {NOW} + 60 + i % 540 ELSE created END,
    '{{"prompt": "a lighthouse at dusk, oil painting", "seed": ' || i || '}}', '{{}}', '[]',
    'f' || i, CASE WHEN status = 'PENDING' THEN 0 ELSE 1 END, 3,
    CASE WHEN status = 'PENDING' THEN 0 ELSE 1 END, 4,
    CASE WHEN status IN {RUNNING} THEN 'host:1234:w' END,
    CASE WHEN status IN {RUNNING} THEN {NOW} + 5 + i % 25 END,
    CASE WHEN status IN {RUNNING} THEN {NOW} + 120 + i % 480 END,
    86400, CASE WHEN status IN {FINAL} OR status = 'NEEDS_REVIEW' THEN created + 86400
        ELSE {NOW} + 86400 END,
    '{{"waiting_s": 600, "generating_s": 600, "uploading_s": 120}}',
    status IN {RUNNING} AND i % 1000 = 996,
    CASE WHEN status IN {RUNNING} AND i % 1000 = 996 THEN {NOW} - i % 10 END,
    CASE WHEN status = 'RETRYING' THEN {NOW} + 60 + i % 540 END,
    CASE WHEN status = 'PENDING' THEN NULL ELSE 'tasks/tsk_' || (10000000000 + i) || '/1-1' END,
    CASE WHEN status IN ('FAILED', 'TIMEOUT', 'RETRYING')
        THEN '{{"code": "handler_error", "message": "out of memory", "retryable": true}}' END,
    CASE WHEN status = 'SUCCESS' THEN '{{"outputs": [{{"name": "image.png", "key": "tasks/tsk_'
        || (10000000000 + i) || '/1-1/image.png", "content_type": "image/png", "size": 1048576,'
        || ' "sha256": "' || 'f' || i || '"}}]}}' END,
    created, created + 30, created + 30,
    CASE WHEN status = 'PENDING' THEN NULL ELSE created + 1 END,
    CASE WHEN status IN {FINAL} THEN created + 30 END
FROM (SELECT i, {STATUS} AS status, {NOW} - 86400 + i * (86400.0 / :count) AS created
      FROM {{series}}) AS shaped
"""
SQLITE_SERIES = (
    "(WITH RECURSIVE n(i) AS (SELECT :lo UNION ALL SELECT i + 1 FROM n WHERE i + 1 < :hi)"
    " SELECT i FROM n)"
)
POSTGRES_SERIES = "generate_series(%(lo)s, %(hi)s - 1) AS g(i)"


def sweep_queries(dialect: str) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """The sweep's reads and its leader write, with the parameters the sweep passes."""
    q = queries(dialect)
    purge_sql, purge_args = purge_candidates(NOW - 7 * 86400, None, (), BATCH)
    return {
        "due": (q.due, (NOW, BATCH)),
        "due_cancel": (q.due_cancel, (NOW - CANCEL_GRACE_S, BATCH)),
        "ghosts": (q.ghosts, (NOW - 60, NOW - 60)),
        "purge": (q.sql(purge_sql), tuple(purge_args)),
        "lead": (q.lead, ("bench", "bench", NOW + 3, NOW, NOW)),
    }


def _renewed(lead_args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The leader write's parameters with a new expiry each time, as a sweep renews it
    (SQLite skips writing a row whose content did not change, and its commit's fsync)."""
    name, owner, _, now, _ = lead_args
    return (name, owner, now + 3 + next(TICKS) * 1e-6, now, now)


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def time_calls(call: Callable[[], Any], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


# SQLite -----------------------------------------------------------------------------------


def fill_sqlite(path: Path, count: int) -> float:
    started = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        sql = FILL.replace("{series}", SQLITE_SERIES).replace(":count", str(count))
        for lo in range(0, count, CHUNK):
            conn.execute("BEGIN")
            conn.execute(sql, {"lo": lo, "hi": min(lo + CHUNK, count)})
            conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    fd = os.open(path, os.O_RDONLY)  # written back now: no timed commit waits for the fill
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def sqlite_plans(conn: sqlite3.Connection) -> dict[str, list[str]]:
    return {
        name: [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args)]
        for name, (sql, args) in sweep_queries("sqlite").items()
    }


def time_sqlite_queries(conn: sqlite3.Connection, runs: int) -> dict[str, float]:
    timed = {}
    for name, (sql, args) in sweep_queries("sqlite").items():
        if name == "lead":  # a write: its own transaction, as the store runs it

            def call(sql: str = sql, args: tuple[Any, ...] = args) -> None:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(sql, _renewed(args)).fetchall()
                conn.execute("COMMIT")
        else:

            def call(sql: str = sql, args: tuple[Any, ...] = args) -> None:
                conn.execute(sql, args).fetchall()

        timed[name] = median_ms(time_calls(call, runs))
    return timed


def run_sqlite(work: Path, count: int, runs: int) -> dict[str, Any]:
    from kiln.store.sqlite import connect

    path = work / "kiln.db"
    url = f"sqlite:///{path}"
    asyncio.run(_open_and_close(url))  # the store's own migrations
    fill_s = fill_sqlite(path, count)
    conn = connect(str(path))
    try:
        plans = sqlite_plans(conn)
        queries_ms = time_sqlite_queries(conn, runs)
        store_ms, sweep_ms = asyncio.run(time_store_and_sweep(url, work, runs))
        conn.execute("ANALYZE")
        analysed = sqlite_plans(conn)
        analysed_ms = time_sqlite_queries(conn, runs)
    finally:
        conn.close()
    return {
        "backend": "sqlite",
        "sqlite": sqlite3.sqlite_version,
        "fill_s": round(fill_s, 1),
        "file_mib": round(path.stat().st_size / 2**20),
        "queries_ms": queries_ms,
        "store_ms": store_ms,
        "sweep_ms": sweep_ms,
        "queries_ms_analysed": analysed_ms,
        "plans": plans,
        "plans_analysed": analysed,
    }


# PostgreSQL -------------------------------------------------------------------------------


def fill_postgres(url: str, count: int) -> float:
    import psycopg

    started = time.perf_counter()
    sql = FILL.replace("{series}", POSTGRES_SERIES).replace(":count", str(count))
    sql = sql.replace("%", "%%").replace("%%(lo)s", "%(lo)s").replace("%%(hi)s", "%(hi)s")
    with psycopg.connect(url, autocommit=True) as conn:
        for lo in range(0, count, CHUNK):
            conn.execute(sql.encode(), {"lo": lo, "hi": min(lo + CHUNK, count)})
        conn.execute("VACUUM ANALYZE tasks")  # what autovacuum does after a bulk load
        conn.execute("CHECKPOINT")  # written back now: no timed commit waits for the fill
    return time.perf_counter() - started


def _numbered(sql: str) -> str:
    """``%s`` placeholders as ``$1 … $n``, for PREPARE."""
    counter = iter(range(1, 1000))
    return re.sub(r"%s", lambda _: f"${next(counter)}", sql)


def _literal(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else repr(value)


def postgres_plans(conn: Any) -> dict[str, dict[str, str]]:
    plans = {}
    for name, (sql, args) in sweep_queries("postgres").items():
        if name == "lead":
            continue  # a primary-key upsert of one row
        custom = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS) {sql}".encode(), args).fetchall()
        conn.execute(f"PREPARE bench_{name} AS {_numbered(sql)}".encode())
        conn.execute("SET plan_cache_mode = force_generic_plan")
        values = ", ".join(_literal(arg) for arg in args)
        generic = conn.execute(
            f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_{name}({values})".encode()
        ).fetchall()
        conn.execute("RESET plan_cache_mode")
        conn.execute(f"DEALLOCATE bench_{name}".encode())
        plans[name] = {
            "custom": "\n".join(row[0] for row in custom),
            "generic": "\n".join(row[0] for row in generic),
        }
    return plans


def time_postgres_queries(url: str, runs: int) -> dict[str, float]:
    import psycopg

    timed = {}
    with psycopg.connect(url, autocommit=True) as conn:  # psycopg prepares after 5 runs
        for name, (sql, args) in sweep_queries("postgres").items():
            query, renew = sql.encode(), name == "lead"

            def call(
                query: bytes = query, args: tuple[Any, ...] = args, renew: bool = renew
            ) -> None:
                conn.execute(query, _renewed(args) if renew else args).fetchall()

            timed[name] = median_ms(time_calls(call, runs))
    return timed


def run_postgres(work: Path, count: int, runs: int) -> dict[str, Any]:
    import psycopg
    from pg_cluster import throwaway_cluster

    with throwaway_cluster() as cluster:
        url = cluster.create_database("sweep")
        asyncio.run(_open_and_close(url))
        fill_s = fill_postgres(url, count)
        with psycopg.connect(url, autocommit=True) as conn:
            plans = postgres_plans(conn)
            size = conn.execute("SELECT pg_total_relation_size('tasks')").fetchone()
        queries_ms = time_postgres_queries(url, runs)
        store_ms, sweep_ms = asyncio.run(time_store_and_sweep(url, work, runs))
        described = cluster.describe()
    assert size is not None
    return {
        "backend": "postgres",
        "postgresql": described["postgresql"],
        "fill_s": round(fill_s, 1),
        "table_mib": round(size[0] / 2**20),
        "queries_ms": queries_ms,
        "store_ms": store_ms,
        "sweep_ms": sweep_ms,
        "plans": plans,
    }


# Through kiln -----------------------------------------------------------------------------


async def _open_and_close(url: str) -> None:
    store = open_store(url)
    await store.get("tsk_none")  # opening migrates
    await store.close()


async def time_store_and_sweep(url: str, work: Path, runs: int) -> tuple[dict[str, float], float]:
    """The store calls of one sweep, then whole sweeps, on an app whose clock is NOW."""
    settings = kiln.Settings(
        database_url=url, storage_url=(work / "results").as_uri(), cancel_grace_s=CANCEL_GRACE_S
    )
    app = kiln.App(settings=settings, clock=lambda: NOW + next(TICKS) * 1e-6)
    async with app:
        store = app.engine.store
        supervisor = Supervisor(app, batch=BATCH, interval_s=1.0)
        calls: dict[str, Callable[[], Any]] = {
            "lead": lambda: store.lead("bench", "bench", 3.0),
            "due": lambda: store.due(limit=BATCH, cancel_grace_s=CANCEL_GRACE_S),
            "count_ghosts": lambda: store.count_ghosts(older_than_s=supervisor.ghost_after_s),
        }
        store_ms = {}
        for name, call in calls.items():
            store_ms[name] = median_ms([await _timed(call) for _ in range(runs)])
        sweeps = []
        for _ in range(runs):
            report = await supervisor.sweep()
            assert report.leading and not (report.expired or report.deadlined), report
            sweeps.append(report.duration_s)
        await supervisor.resign()
    return store_ms, median_ms(sweeps)


async def _timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


# Report -----------------------------------------------------------------------------------


def show(figure: dict[str, Any]) -> None:
    backend = figure["backend"]
    size = figure.get("file_mib", figure.get("table_mib"))
    print(f"\n== {backend}: filled in {figure['fill_s']} s, {size} MiB")
    print("query (driver connection)   median ms")
    for name, ms in figure["queries_ms"].items():
        print(f"  {name:<26} {ms:>8.3f}")
    for name, ms in figure.get("queries_ms_analysed", {}).items():
        print(f"  {name + ' (after ANALYZE)':<26} {ms:>8.3f}")
    print("store call                  median ms")
    for name, ms in figure["store_ms"].items():
        print(f"  {name:<26} {ms:>8.3f}")
    print(f"Supervisor.sweep()           {figure['sweep_ms']:>8.3f} ms (aim < {AIM_MS} ms)")
    for title in ("plans", "plans_analysed"):
        for name, plan in figure.get(title, {}).items():
            print(f"\n-- {name} ({title.replace('_', ' ')})")
            if isinstance(plan, dict):
                for mode, text in plan.items():
                    print(f"[{mode} plan]\n{text}")
            else:
                print("\n".join(plan))


@contextmanager
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kiln-sweep-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=200, help="timed runs per figure")
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    args = parser.parse_args()
    figures = []
    for backend in ("sqlite", "postgres"):
        if args.backend not in (backend, "both"):
            continue
        with workdir() as work:
            run = run_sqlite if backend == "sqlite" else run_postgres
            figure = run(work, args.tasks, args.runs)
        show(figure)
        figures.append(figure)
    summary = {
        "tasks": args.tasks,
        "runs": args.runs,
        "aim_ms": AIM_MS,
        **{
            f["backend"]: {k: f[k] for k in ("queries_ms", "store_ms", "sweep_ms", "fill_s")}
            for f in figures
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
