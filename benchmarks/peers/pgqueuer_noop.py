"""PgQueuer on PostgreSQL (asyncpg), for benchmarks/peers.py (runs in the peers' own venv).

The worker is PgQueuer's own CLI at its defaults, ``pgq run pgqueuer_noop:factory``: one
process, one asyncpg connection, batch size 10, dequeue timeout 30 s, LISTEN/NOTIFY,
acknowledgements buffered and written in batches (a finished job's row is deleted from
the queue table and a row goes to ``pgqueuer_log``). ``factory`` is the README's consumer,
as the async context manager 1.6's CLI asks for, with a no-op entrypoint (it records its
start in ``BENCH_DONE``). Run as a script, the module drives the three figures (see
common.py), and a fourth: ``enqueue_one_drain_per_s``, enqueue + drain with one job per
``enqueue`` call (as a web request submits), ``IN_FLIGHT`` calls at once over a pool of
``POOL`` connections, the bounds kiln's own one-per-call figure runs under
(``lifecycle.py``: 4 × its pool of 10). "done" is the queue table empty. The last line is
one JSON object.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pgqueuer
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

BATCH = 500
#: One-per-call enqueue: connections, calls in flight, and the first job number.
POOL = 10
IN_FLIGHT = 40
ONE_BY_ONE = 5_000_000


@asynccontextmanager
async def factory() -> AsyncIterator[PgQueuer]:
    from common import record

    write = record(os.environ["BENCH_DONE"])
    connection = await asyncpg.connect(os.environ["BENCH_DATABASE"])
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        write(int(job.payload or b"0"))

    try:
        yield pgq
    finally:
        await connection.close()


def worker(done: Path, scratch: Path, tag: str) -> Any:
    from common import Cli

    return Cli(
        [sys.executable, "-m", "pgqueuer", "run", "pgqueuer_noop:factory"],
        {"BENCH_DONE": str(done), "PYTHONPATH": str(Path(__file__).parent)},
        scratch / f"pgqueuer-{tag}.log",
    )


async def with_queries(work: Any) -> Any:
    connection = await asyncpg.connect(os.environ["BENCH_DATABASE"])
    try:
        return await work(Queries(AsyncpgDriver(connection)), connection)
    finally:
        await connection.close()


async def enqueue(first: int, count: int, batch: int = BATCH) -> None:
    async def work(queries: Queries, _: Any) -> None:
        for start in range(first, first + count, batch):
            numbers = range(start, min(start + batch, first + count))
            await queries.enqueue(
                ["noop"] * len(numbers), [str(n).encode() for n in numbers], [0] * len(numbers)
            )

    await with_queries(work)


def all_done(done: Path, tasks: int, cli: Any) -> bool:
    """Every job ran (its line) and its acknowledgement is in (the queue table is empty)."""
    from common import count_lines

    if not (cli.alive() and count_lines(done) >= tasks):
        return False

    async def left(_: Queries, connection: Any) -> int:
        return int(await connection.fetchval("SELECT count(*) FROM pgqueuer"))

    return asyncio.run(with_queries(left)) == 0


def drain(args: Any, scratch: Path) -> float:
    from common import starts, wait_until

    done = scratch / "pgqueuer-drain.done"
    asyncio.run(enqueue(0, args.tasks, args.enqueue_batch))
    cli = worker(done, scratch, "drain")
    try:
        end = wait_until(lambda: all_done(done, args.tasks, cli), 300, "drain")
    finally:
        cli.stop()
    return round(args.tasks / (end - min(starts(done).values())), 1)


async def enqueue_one_by_one(count: int) -> None:
    """``count`` jobs, one per ``enqueue`` call, ``IN_FLIGHT`` calls at once."""
    pool = await asyncpg.create_pool(os.environ["BENCH_DATABASE"], min_size=POOL, max_size=POOL)
    queries = Queries.from_asyncpg_pool(pool)
    numbers = iter(range(ONE_BY_ONE, ONE_BY_ONE + count))

    async def caller() -> None:
        for n in numbers:
            await queries.enqueue("noop", str(n).encode())

    try:
        await asyncio.gather(*(caller() for _ in range(IN_FLIGHT)))
    finally:
        await pool.close()


async def pickup(rate: float, seconds: float) -> list[float]:
    from common import PICKUP, open_loop

    pool = await asyncpg.create_pool(os.environ["BENCH_DATABASE"])
    queries = Queries.from_asyncpg_pool(pool)

    async def submit(i: int) -> None:
        await queries.enqueue("noop", str(PICKUP + i).encode())

    try:
        return await open_loop(rate, seconds, submit)
    finally:
        await pool.close()


def main() -> None:
    from common import CpuMeter, arguments, emit, pickup_figures, wait_until, warmed

    args = arguments()
    scratch = Path(args.scratch)
    asyncio.run(with_queries(lambda queries, _: queries.install()))
    body: dict[str, Any] = {
        "system": "pgqueuer",
        "version": pgqueuer.__version__,
        "tasks": args.tasks,
        "processes": 1,
        "batch_size": 10,
        "enqueue_batch": args.enqueue_batch,
    }
    body["drain_per_s"] = drain(args, scratch)
    done = scratch / "pgqueuer-run.done"
    cli = worker(done, scratch, "run")
    try:
        asyncio.run(enqueue(-1, 1))
        wait_until(lambda: cli.alive() and warmed(done), 60, "pgqueuer warm-up")
        started, meter = time.time(), CpuMeter(cli)
        asyncio.run(enqueue(0, args.tasks, args.enqueue_batch))
        end = wait_until(lambda: all_done(done, args.tasks, cli), 300, "run")
        body["enqueue_drain_per_s"] = round(args.tasks / (end - started), 1)
        body.update(meter.per_job_us(args.tasks))
        started = time.time()
        asyncio.run(enqueue_one_by_one(args.tasks))
        end = wait_until(lambda: all_done(done, 2 * args.tasks, cli), 300, "one by one")
        body["enqueue_one_drain_per_s"] = round(args.tasks / (end - started), 1)
        begun = time.time()
        scheduled = asyncio.run(pickup(args.rate, args.seconds))
        total = 2 * args.tasks + len(scheduled)
        wait_until(lambda: all_done(done, total, cli), 300, "pickup")
        body.update(pickup_figures(scheduled, done, begun))
    finally:
        cli.stop()
    emit(body)


if __name__ == "__main__":
    main()
