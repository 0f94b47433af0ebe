"""Throughput of the whole task lifecycle, measured against the raw rate of the database.

N tasks of a no-op kind go through submit, claim, acquire, generated and uploaded (five
transitions each) on the real library: ``kiln.App``, ``app.submit`` and ``app.worker``.

SQLite: as ``kiln serve`` runs it (``KILN_WORKER_PROCESSES=auto``): this process submits
and runs its own worker, and one worker process per core beyond the first claims and runs
beside it on the same file (``benchmarks/sqlite_processes.py``); ``--worker-processes 0``
runs everything in one process. CPU per lifecycle counts every process. In the same run,
on a database file with the same settings (WAL, the same ``synchronous``), a tight loop of
single-row compare-and-set + event-insert transactions on stdlib ``sqlite3`` gives the
ceiling that one transaction per transition would allow.

PostgreSQL: this process submits, ``--workers`` separate worker processes claim and run,
all on a fresh database of the cluster. The server's own counters give the transactions a
lifecycle took, and ``pgbench -N`` on the same cluster, in the same run, gives the ceiling.

    python benchmarks/lifecycle.py                       # 20,000 tasks, NORMAL, both figures
    python benchmarks/lifecycle.py --synchronous FULL
    python benchmarks/lifecycle.py --synchronous FULL --worker-processes 0   # one process
    python benchmarks/lifecycle.py --tasks 200 --json-only
    python benchmarks/lifecycle.py --start-postgres      # a throwaway cluster, 3 workers
    python benchmarks/lifecycle.py --database postgresql://user@host/postgres --workers 2

The last line printed is always one JSON object (see ``summary_json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    Figure,
    build_app,
    cpu_line,
    head_lines,
    load,
    machine,
    scratch_dir,
    submit_all,
    transitions_of,
    wait_for_success,
)
from sqlite_processes import auto_processes, run_sqlite_processes

import kiln

RAW_SECONDS = 3.0
RAW_MAX_TX = 20_000
RAW_ROWS = 1_000
TRANSITIONS_PER_LIFECYCLE = 5
PG_TASKS = 2_000
PG_WORKERS = 3
PG_CONCURRENCY = 16
PG_POOL_SIZE = 10
PGBENCH_SECONDS = 10.0


# The database under test --------------------------------------------------------------------


@dataclass
class Target:
    """Where one figure runs, and how the raw rate of that database is measured."""

    url: str
    raw: Callable[[str, float, int], float]


class Databases:
    """Fresh databases for each figure and for the raw loop, all with the same settings.

    ``sqlite:///path.db`` runs the no-op figure on ``path.db``, the 1 KiB figure on
    ``path-1k.db`` and the raw loop on ``path-raw.db``; none of them may exist yet. A
    ``postgresql://`` URL only sets ``backend``: ``run_postgres`` takes over.
    """

    def __init__(self, url: str | None, scratch: Path, synchronous: str) -> None:
        self.synchronous = synchronous
        if url is None:
            url = f"sqlite:///{scratch / 'bench.db'}"
        self.url = url
        if url.startswith("sqlite:///"):
            self.backend = "sqlite"
        elif url.startswith(("postgresql:", "postgres:")):
            self.backend = "postgresql"
        else:
            raise SystemExit(
                f"unsupported --database {url!r}: use sqlite:///path.db or postgresql://..."
            )

    def figure(self, suffix: str) -> str:
        if self.backend != "sqlite":
            return self.url
        path = Path(self.url.removeprefix("sqlite:///"))
        path = path.with_name(f"{path.stem}{suffix}{path.suffix}")
        for extra in ("", "-wal", "-shm"):
            if Path(f"{path}{extra}").exists():
                raise SystemExit(f"{path}{extra} exists: the benchmark needs a fresh database")
        return f"sqlite:///{path}"

    def raw_rate(self, seconds: float, max_tx: int) -> float:
        if self.backend != "sqlite":
            raise SystemExit("the raw loop for PostgreSQL is not written yet")
        url = self.figure("-raw")
        return raw_sqlite(url.removeprefix("sqlite:///"), self.synchronous, seconds, max_tx)


def raw_sqlite(path: str, synchronous: str, seconds: float, max_tx: int) -> float:
    """Single-row CAS + event-insert transactions per second on one plain connection."""
    from kiln.store.sqlite import connect

    conn = connect(path, synchronous=synchronous)  # the store's own pragmas
    conn.row_factory = None
    conn.executescript(
        "CREATE TABLE raw_tasks (id TEXT PRIMARY KEY, status TEXT NOT NULL,"
        " version INTEGER NOT NULL, updated_at REAL NOT NULL);"
        "CREATE TABLE raw_events (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,"
        " task_id TEXT NOT NULL, from_status TEXT, to_status TEXT NOT NULL, at REAL NOT NULL);"
    )
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO raw_tasks VALUES (?, 'A', 0, 0)", [(f"t{i:06d}",) for i in range(RAW_ROWS)]
    )
    conn.execute("COMMIT")
    statuses = ("A", "B")
    versions = [0] * RAW_ROWS
    done = 0
    started = time.perf_counter()
    deadline = started + seconds
    while done < max_tx and time.perf_counter() < deadline:
        row = done % RAW_ROWS
        task_id, version = f"t{row:06d}", versions[row]
        source, target = statuses[version % 2], statuses[(version + 1) % 2]
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        changed = conn.execute(
            "UPDATE raw_tasks SET status = ?, version = version + 1, updated_at = ?"
            " WHERE id = ? AND status = ? AND version = ? RETURNING version",
            (target, now, task_id, source, version),
        ).fetchone()
        if changed is None:
            raise RuntimeError(f"raw CAS on {task_id} matched no row")
        conn.execute(
            "INSERT INTO raw_events (id, task_id, from_status, to_status, at)"
            " VALUES (?, ?, ?, ?, ?)",
            (f"{task_id}:{changed[0]}", task_id, source, target, now),
        )
        conn.execute("COMMIT")
        versions[row] = changed[0]
        done += 1
    elapsed = time.perf_counter() - started
    conn.close()
    return done / elapsed


def thread_cpu() -> dict[str, float]:
    """CPU seconds used so far by each live thread of this process, by role (Linux only)."""
    roles = {
        "MainThread": "event loop",
        "kiln-sqlite-writer": "writer",
        "kiln-sqlite-reader": "reader",
    }
    used: dict[str, float] = {}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for thread in threading.enumerate():
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        role = roles.get(thread.name, "other threads")
        used[role] = used.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return used


async def run_figure(
    url: str, scratch: Path, *, tasks: int, synchronous: str, concurrency: int, output_bytes: int
) -> Figure:
    results = scratch / f"results-{output_bytes}"
    app = build_app(url, results, synchronous, output_bytes)
    async with app:
        worker = app.worker(concurrency=concurrency)
        async with kiln.app.running(worker.run()):
            cpu_before, threads_before = time.process_time(), thread_cpu()
            started = time.perf_counter()
            created = await submit_all(app, tasks)
            submitted = time.perf_counter()
            finished, _ = await wait_for_success(app, created, timeout_s=max(120.0, tasks / 10))
            cpu_s = time.process_time() - cpu_before
            threads = thread_cpu()
        stats = await app.engine.store.stats(tenant=None, ghost_after_s=60)
        moved = transitions_of(await app.engine.store.counters())
        batches = getattr(app.engine.store, "write_batches", None)
    return Figure(
        tasks=created,
        output_bytes=output_bytes,
        concurrency=concurrency,
        wall_s=finished - started,
        submit_s=submitted - started,
        transitions=created + sum(moved.values()),
        succeeded=stats.counts["SUCCESS"],
        cpu_s=cpu_s,
        thread_cpu_s={k: v - threads_before.get(k, 0.0) for k, v in threads.items()},
        write_batches=batches,
        by_transition=moved,
    )


# Reporting ----------------------------------------------------------------------------------


def summary_json(
    figures: list[Figure], raw_tx_per_s: float, synchronous: str, backend: str
) -> dict[str, Any]:
    main = figures[0]
    body: dict[str, Any] = {
        "lifecycles_per_s": round(main.lifecycles_per_s, 1),
        "transitions_per_s": round(main.transitions_per_s, 1),
        "raw_tx_per_s": round(raw_tx_per_s, 1),
        "ratio": round(main.transitions_per_s / raw_tx_per_s, 4),
        "synchronous": synchronous,
        "output_bytes": main.output_bytes,
        "tasks": main.tasks,
        "concurrency": main.concurrency,
        "cpu_us_per_lifecycle": round(main.cpu_us_per_lifecycle, 1),
        "database": backend,
    }
    for extra in figures[1:]:
        tag = "_1k" if extra.output_bytes == 1024 else f"_{extra.output_bytes}b"
        body[f"lifecycles_per_s{tag}"] = round(extra.lifecycles_per_s, 1)
        body[f"transitions_per_s{tag}"] = round(extra.transitions_per_s, 1)
        body[f"ratio{tag}"] = round(extra.transitions_per_s / raw_tx_per_s, 4)
        body[f"cpu_us_per_lifecycle{tag}"] = round(extra.cpu_us_per_lifecycle, 1)
    return body


def describe(figure: Figure, raw_tx_per_s: float) -> list[str]:
    lines = [
        *head_lines(figure),
        f"  ratio transitions/s : raw tx/s          {figure.transitions_per_s / raw_tx_per_s:.3f}",
        "  fraction of the raw rate a lifecycle gets"
        f" {figure.lifecycles_per_s / (raw_tx_per_s / TRANSITIONS_PER_LIFECYCLE):.3f}",
        cpu_line(figure),
    ]
    if figure.write_batches:
        lines.append(
            f"  writer: {figure.write_batches[0]} transactions for {figure.write_batches[1]}"
            f" operations (mean batch {figure.mean_batch:.1f})"
        )
    return lines


# Main ---------------------------------------------------------------------------------------


def backend_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker-processes",
        type=int,
        default=None,
        help="SQLite: worker processes beside the submitting one, which runs a worker too"
        " (default: as kiln serve's auto, one per core beyond the first)",
    )
    postgres = parser.add_argument_group("PostgreSQL only")
    postgres.add_argument("--workers", type=int, default=PG_WORKERS, help="worker processes")
    postgres.add_argument(
        "--pool-size", type=int, default=PG_POOL_SIZE, help="connections per process at most"
    )  # fmt: skip
    postgres.add_argument(
        "--clients", type=int, default=None,
        help="pgbench clients (default: the connections the engine held)",
    )  # fmt: skip
    postgres.add_argument(
        "--pgbench-seconds", type=float, default=PGBENCH_SECONDS, help="pgbench -T"
    )  # fmt: skip
    postgres.add_argument(
        "--drain", action="store_true",
        help="queue every task first, then start the workers; time from their start",
    )  # fmt: skip
    postgres.add_argument(
        "--submit-batch", type=int, default=None, metavar="B",
        help="submit in batches of B, as POST /v1/tasks/batch does (default: 4 per"
        " pooled connection in flight, batch after batch)",
    )  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", type=int, default=None,
        help=f"tasks per figure (default 20,000; {PG_TASKS:,} on PostgreSQL)",
    )  # fmt: skip
    parser.add_argument(
        "--synchronous", type=str.upper, choices=["NORMAL", "FULL"], default="NORMAL"
    )
    parser.add_argument(
        "--concurrency", type=int, default=None,
        help=f"worker slots, per worker process (default 256; {PG_CONCURRENCY} on PostgreSQL)",
    )  # fmt: skip
    parser.add_argument(
        "--output-bytes", type=int, choices=[0, 1024], default=None,
        help="run only this figure (default: both, no-op first; no-op only on PostgreSQL)",
    )  # fmt: skip
    parser.add_argument("--both", action="store_true", help="run both figures (the default)")
    parser.add_argument(
        "--database", default=None,
        help="sqlite:///path.db (default: temp), or postgresql://... of a database where"
        " CREATE DATABASE may run (the run makes and drops its own databases)",
    )  # fmt: skip
    parser.add_argument(
        "--start-postgres", action="store_true",
        help="run on a throwaway PostgreSQL cluster (fsync and synchronous_commit on)",
    )  # fmt: skip
    backend_options(parser)
    parser.add_argument(
        "--raw-seconds", type=float, default=RAW_SECONDS,
        help=f"how long the raw loop runs at most (default {RAW_SECONDS}; {RAW_MAX_TX} tx at most)",
    )  # fmt: skip
    parser.add_argument(
        "--log", choices=["off", "text", "json"], default="off",
        help="engine logs at INFO to stderr, as `kiln worker` does (default off, as a library)",
    )  # fmt: skip
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    if args.start_postgres and args.database:
        parser.error("give --database or --start-postgres, not both")
    args.postgres = args.start_postgres or str(args.database).startswith(
        ("postgresql:", "postgres:")
    )
    args.tasks = args.tasks or (PG_TASKS if args.postgres else 20_000)
    args.concurrency = args.concurrency or (PG_CONCURRENCY if args.postgres else 256)
    if args.worker_processes is None:
        args.worker_processes = auto_processes()
    if args.worker_processes < 0:
        parser.error("--worker-processes must be 0 or more")
    numbers = (args.tasks, args.concurrency, args.raw_seconds, args.workers, args.pool_size,
               args.pgbench_seconds, args.clients or 1, args.submit_batch or 1)  # fmt: skip
    if min(numbers) <= 0:
        parser.error("counts and seconds must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [0, 1024] if args.both or args.output_bytes is None else [args.output_bytes]
    if args.postgres and not args.both and args.output_bytes is None:
        sizes = [0]  # the 1 KiB figure measures the storage path, not the database
    say: Callable[[str], None] = (lambda _: None) if args.json_only else print
    if args.log != "off":
        from kiln import logs

        logs.setup(fmt=args.log, level="INFO")
    if args.postgres:
        from pg_lifecycle import run_postgres

        return run_postgres(args, sizes, say)
    with scratch_dir() as scratch:
        dbs = Databases(args.database, scratch, args.synchronous)
        say(" ".join(f"{k}={v}" for k, v in machine().items()))
        say(
            f"database={dbs.backend} synchronous={args.synchronous} journal_mode=WAL"
            f" concurrency={args.concurrency} worker_processes={args.worker_processes}"
            f" engine_logs={args.log}"
        )
        raw = dbs.raw_rate(args.raw_seconds, RAW_MAX_TX)
        say(f"raw single-row CAS + event-insert transactions/s: {raw:.1f}")
        figures, locks = [], []
        for size in sizes:
            figure, lock = sqlite_figure(args, dbs, scratch, size)
            figures.append(figure)
            locks.append(lock)
            for line in describe(figure, raw):
                say(line)
            say(f"  file lock: {lock}")
        say(f"loadavg at the end: {load()}")
    body = summary_json(figures, raw, args.synchronous, dbs.backend)
    body["worker_processes"] = args.worker_processes
    body["lock"] = locks[0]
    print(json.dumps(body))
    return 0


def sqlite_figure(
    args: argparse.Namespace, dbs: Databases, scratch: Path, size: int
) -> tuple[Figure, dict[str, float]]:
    """One SQLite figure: in one process, or beside ``--worker-processes`` others; with
    the file lock's use summed over the processes."""
    url = dbs.figure("" if size == 0 else "-1k")
    if args.worker_processes == 0:
        figure = asyncio.run(
            run_figure(
                url,
                scratch,
                tasks=args.tasks,
                synchronous=args.synchronous,
                concurrency=args.concurrency,
                output_bytes=size,
            )
        )
        return figure, {}
    figure, seen = run_sqlite_processes(
        url,
        scratch,
        tasks=args.tasks,
        synchronous=args.synchronous,
        concurrency=args.concurrency,
        output_bytes=size,
        processes=args.worker_processes,
        local_concurrency=args.concurrency,
    )
    total: dict[str, float] = {}
    for lock in seen["locks"]:
        for key, value in lock.items():
            total[key] = round(total.get(key, 0) + value, 6)
    return figure, total


if __name__ == "__main__":
    sys.exit(main())
