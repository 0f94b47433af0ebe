"""The cost of indexing outputs for inputs by reference (``task_outputs``, docs/uploads.md).

The database writes a ``task_outputs`` row per output when a task becomes SUCCESS (a
trigger). This measures that trigger alone: on a fresh store, tasks are moved to SUCCESS
with a result of one output, one UPDATE per task, in blocks of ``--block`` tasks inside
one transaction (so commits and fsync do not drown the difference); blocks with the
triggers and blocks with them dropped alternate. The figure is the median over pairs of
(on - off) µs per task, and of on / off. The same for a result without outputs
(``{"outputs":[]}``: there the trigger's WHEN is all it costs).

    python benchmarks/task_outputs.py                   # SQLite, and a throwaway PostgreSQL
    python benchmarks/task_outputs.py --pairs 10 --block 1000 --sqlite-only

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import scratch_dir
from pg_cluster import throwaway_cluster

from kiln.models import NewTask, Timeouts
from kiln.store import open_store
from kiln.store.queries import migrations

KIND = "bench.outputs"


def new_task(n: int) -> NewTask:
    return NewTask(
        id=f"tsk_bench{n:021d}", tenant="bench", kind=KIND, params={"n": n},
        fingerprint=f"f{n}", idempotency_key=None, dedup_key=None, priority=0,
        max_attempts=3, deadline_s=3600.0, timeouts=Timeouts(), metadata={}, inputs=[],
    )  # fmt: skip


def result_of(task_id: str, outputs: bool) -> str:
    if not outputs:
        return '{"outputs":[]}'
    item = {"content_type": "image/png", "key": f"tasks/{task_id}/image.png",
            "name": "image.png", "sha256": task_id.ljust(64, "0")[-64:], "size": 1234}  # fmt: skip
    return json.dumps({"outputs": [item]}, separators=(",", ":"), sort_keys=True)


def triggers(dialect: str) -> tuple[list[str], list[str]]:
    """The statements that drop the triggers, and those that create them again (as the
    migration does)."""
    name = "0022_task_outputs.sql" if dialect == "sqlite" else "0019_task_outputs.sql"
    sql = next(text for _, file, text in migrations(dialect) if file == name)
    paragraphs = [part for part in sql.split("\n\n") if "CREATE TRIGGER" in part]
    creates = [
        "\n".join(line for line in part.splitlines() if not line.startswith("--")).strip()
        for part in paragraphs
    ]
    on = "" if dialect == "sqlite" else " ON tasks"
    drops = [f"DROP TRIGGER task_outputs_success{on}", f"DROP TRIGGER task_outputs_gone{on}"]
    return drops, creates


async def submit(url: str, count: int) -> None:
    store = open_store(url)
    try:
        await asyncio.gather(*(store.submit(new_task(n)) for n in range(count)))
    finally:
        await store.close()


def measure(
    execute: Callable[[str, tuple[Any, ...]], None],
    commit: Callable[[], None],
    placeholder: str,
    ids: list[str],
    *,
    pairs: int,
    block: int,
    outputs: bool,
    dialect: str,
) -> dict[str, Any]:
    drops, creates = triggers(dialect)
    sql = (f"UPDATE tasks SET status = 'SUCCESS', result = {placeholder}, version = version + 1"
           f" WHERE id = {placeholder}")  # fmt: skip
    on: list[float] = []
    off: list[float] = []
    taken = 0
    for pair in range(pairs):
        for with_trigger in (True, False) if pair % 2 == 0 else (False, True):
            if not with_trigger:
                for statement in drops:
                    execute(statement, ())
                commit()
            chunk = ids[taken : taken + block]
            taken += block
            started = time.perf_counter()
            for task_id in chunk:
                execute(sql, (result_of(task_id, outputs), task_id))
            spent = time.perf_counter() - started
            commit()
            (on if with_trigger else off).append(spent / len(chunk) * 1e6)
            if not with_trigger:
                for statement in creates:
                    execute(statement, ())
                commit()
    deltas = [a - b for a, b in zip(on, off, strict=True)]
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    return {
        "on_us": round(statistics.median(on), 2),
        "off_us": round(statistics.median(off), 2),
        "delta_us": round(statistics.median(deltas), 2),
        "ratio": round(statistics.median(ratios), 3),
        "on_rounds": [round(x, 1) for x in on],
        "off_rounds": [round(x, 1) for x in off],
    }


def run_sqlite(scratch: Path, pairs: int, block: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for outputs in (True, False):
        path = scratch / f"outputs-{outputs}.db"
        asyncio.run(submit(f"sqlite:///{path}", pairs * 2 * block))
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("UPDATE tasks SET status = 'UPLOADING'")
        ids = [row[0] for row in conn.execute("SELECT id FROM tasks ORDER BY id")]
        opened = [False]

        def execute(
            sql: str, args: tuple[Any, ...], conn: Any = conn, opened: Any = opened
        ) -> None:
            if not opened[0]:
                conn.execute("BEGIN")
                opened[0] = True
            conn.execute(sql, args)

        def commit(conn: Any = conn, opened: Any = opened) -> None:
            if opened[0]:
                conn.execute("COMMIT")
                opened[0] = False

        found["with_output" if outputs else "without_outputs"] = measure(
            execute, commit, "?", ids, pairs=pairs, block=block, outputs=outputs,
            dialect="sqlite",
        )  # fmt: skip
        conn.close()
    return found


def run_postgres(pairs: int, block: int) -> dict[str, Any]:
    import psycopg

    found: dict[str, Any] = {}
    with throwaway_cluster() as cluster:
        for outputs in (True, False):
            name = f"bench_outputs_{int(outputs)}"
            with psycopg.connect(cluster.url, autocommit=True) as admin:
                admin.execute(f"CREATE DATABASE {name}")
            url = cluster.url.rsplit("/", 1)[0] + f"/{name}"
            asyncio.run(submit(url, pairs * 2 * block))
            with psycopg.connect(url) as conn:
                conn.execute("UPDATE tasks SET status = 'UPLOADING'")
                conn.commit()
                ids = [row[0] for row in conn.execute("SELECT id FROM tasks ORDER BY id")]
                conn.commit()

                def execute(sql: str, args: tuple[Any, ...], conn: Any = conn) -> None:
                    conn.execute(sql, args or None)

                found["with_output" if outputs else "without_outputs"] = measure(
                    execute, conn.commit, "%s", ids, pairs=pairs, block=block,
                    outputs=outputs, dialect="postgres",
                )  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the cost of the task_outputs trigger")
    parser.add_argument("--pairs", type=int, default=8, help="blocks with and without")
    parser.add_argument("--block", type=int, default=500, help="tasks per block")
    parser.add_argument("--sqlite-only", action="store_true")
    args = parser.parse_args(argv)
    summary: dict[str, Any] = {"pairs": args.pairs, "block": args.block}
    with scratch_dir() as scratch:
        summary["sqlite"] = run_sqlite(scratch, args.pairs, args.block)
    if not args.sqlite_only:
        summary["postgresql"] = run_postgres(args.pairs, args.block)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
