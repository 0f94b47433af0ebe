"""Procrastinate on PostgreSQL, for benchmarks/peers.py (runs in the peers' own venv).

The worker is Procrastinate's own CLI at its defaults,
``procrastinate --app procrastinate_noop.app worker``: one process, concurrency 1,
LISTEN/NOTIFY on with a 5 s polling fallback, finished jobs kept (status ``succeeded``).
It imports this module, which defines the app (``BENCH_DATABASE``) and the no-op task (it
records its start in ``BENCH_DONE``). Run as a script, the module drives the three figures
(see common.py); "done" is every job in ``succeeded`` in the jobs table. The last line is
one JSON object.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import procrastinate
import psycopg

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("BENCH_DATABASE", ""))
)
write: Any = None
BATCH = 500


@app.task(name="noop")
async def noop(n: int) -> None:
    global write
    if write is None:
        from common import record

        write = record(os.environ["BENCH_DONE"])
    write(n)


def worker(done: Path, scratch: Path, tag: str) -> Any:
    from common import Cli

    return Cli(
        [sys.executable, "-m", "procrastinate", "--app", "procrastinate_noop.app", "worker"],
        {"BENCH_DONE": str(done), "PYTHONPATH": str(Path(__file__).parent)},
        scratch / f"procrastinate-{tag}.log",
    )


def succeeded(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        ).fetchone()
        return int(row[0]) if row else 0


def all_done(url: str, done: Path, tasks: int, cli: Any, warm: int = 0) -> bool:
    """Every job ran (its line) and is ``succeeded`` in the table (warm-up jobs too)."""
    from common import count_lines

    return cli.alive() and count_lines(done) >= tasks and succeeded(url) >= tasks + warm


async def defer(first: int, count: int, batch: int = BATCH) -> None:
    for start in range(first, first + count, batch):
        last = min(start + batch, first + count)
        await noop.batch_defer_async(*({"n": n} for n in range(start, last)))


def drain(args: Any, url: str, scratch: Path) -> float:
    from common import starts, wait_until

    done = scratch / "procrastinate-drain.done"
    asyncio.run(run_open(defer(0, args.tasks, args.enqueue_batch)))
    cli = worker(done, scratch, "drain")
    try:
        end = wait_until(lambda: all_done(url, done, args.tasks, cli), 300, "drain")
    finally:
        cli.stop()
    return round(args.tasks / (end - min(starts(done).values())), 1)


async def run_open(work: Any) -> Any:
    async with app.open_async():
        return await work


def main() -> None:
    from common import (
        PICKUP,
        CpuMeter,
        arguments,
        emit,
        open_loop,
        pickup_figures,
        wait_until,
        warmed,
    )

    args = arguments()
    url, scratch = os.environ["BENCH_DATABASE"], Path(args.scratch)
    asyncio.run(run_open(app.schema_manager.apply_schema_async()))
    body: dict[str, Any] = {
        "system": "procrastinate",
        "version": procrastinate.__version__,
        "tasks": args.tasks,
        "processes": 1,
        "concurrency": 1,
    }
    body["drain_per_s"] = drain(args, url, scratch)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM procrastinate_jobs")
    done = scratch / "procrastinate-run.done"
    cli = worker(done, scratch, "run")
    try:
        asyncio.run(run_open(noop.defer_async(n=-1)))
        wait_until(lambda: cli.alive() and warmed(done), 60, "procrastinate warm-up")
        started, meter = time.time(), CpuMeter(cli)
        asyncio.run(run_open(defer(0, args.tasks, args.enqueue_batch)))
        end = wait_until(lambda: all_done(url, done, args.tasks, cli, 1), 300, "run")
        body["enqueue_drain_per_s"] = round(args.tasks / (end - started), 1)
        body.update(meter.per_job_us(args.tasks))

        async def submit(i: int) -> None:
            await noop.defer_async(n=PICKUP + i)

        begun = time.time()
        scheduled = asyncio.run(run_open(open_loop(args.rate, args.seconds, submit)))
        total = args.tasks + len(scheduled)
        wait_until(lambda: all_done(url, done, total, cli, 1), 300, "pickup")
        body.update(pickup_figures(scheduled, done, begun))
    finally:
        cli.stop()
    emit(body)


if __name__ == "__main__":
    main()
