"""kiln's pickup latency at a fixed offered load, for benchmarks/peers.py (kiln's venv).

The same open-loop generator as the peers' (common.py): one ``app.submit`` every 1/rate s
for ``--seconds``, each fired as its own asyncio task (the generator never waits on the
one before); the no-op handler records ``time.time()`` at its start in a done file; the
latency is that start less the submit's scheduled time.

- SQLite (``sqlite:///path.db``): as ``benchmarks/lifecycle.py`` and ``kiln serve`` run
  it: the app submits and ``app.worker(concurrency=C)`` runs in the same event loop, and
  ``--worker-processes`` worker processes (default: one per core beyond the first, as
  ``KILN_WORKER_PROCESSES=auto``) claim beside it on the same file; a worker of another
  process hears of a submission by the store's wake-up, not by polling.
- PostgreSQL: as ``benchmarks/pg_lifecycle.py``, ``--workers`` separate processes
  (``spawn``ed, each its own store and pool, ``app.worker(concurrency=C)``) claim and run;
  this process submits.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from common import PICKUP, count_lines, emit, open_loop, pickup_figures, record  # noqa: E402

import kiln  # noqa: E402
from kiln.cli.worker_processes import usable_cores  # noqa: E402
from kiln.config import Settings  # noqa: E402
from kiln.store import open_store  # noqa: E402

KIND = "bench.pickup"
POOL_SIZE = 10


def build(url: str, scratch: Path, done: Path, pool: bool) -> kiln.App:
    settings = Settings(
        data_dir=scratch, database_url=url, storage_url=(scratch / "results").as_uri()
    )
    store = open_store(url, pool_size=POOL_SIZE) if pool else None
    app = kiln.App(settings=settings, store=store)
    write = record(str(done))

    @app.task(KIND)
    async def noop(ctx: Any, params: Any) -> None:
        write(int(params["n"]))

    return app


async def generate(app: kiln.App, done: Path, rate: float, seconds: float) -> dict[str, Any]:
    async def submit(i: int) -> None:
        await app.submit(KIND, {"n": PICKUP + i}, dedup=False)

    begun = time.time()
    scheduled = await open_loop(rate, seconds, submit)
    deadline = time.monotonic() + 120
    while count_lines(done) < len(scheduled):
        if time.monotonic() > deadline:
            raise TimeoutError("not every pickup task started within 120 s")
        await asyncio.sleep(0.005)
    return pickup_figures(scheduled, done, begun)


async def in_process(args: argparse.Namespace, scratch: Path, done: Path) -> dict[str, Any]:
    app = build(args.database, scratch, done, pool=False)
    async with app:
        worker = app.worker(concurrency=args.concurrency)
        async with kiln.app.running(worker.run()):
            return await generate(app, done, args.rate, args.seconds)


def worker_process(url: str, scratch: Path, done: Path, concurrency: int, pipe: Connection) -> None:
    async def serve() -> None:
        app = build(url, scratch, done, pool=True)
        async with app:
            worker = app.worker(concurrency=concurrency)
            async with kiln.app.running(worker.run()):
                await app.engine.store.counters()  # the pool is open
                pipe.send("ready")
                await asyncio.to_thread(pipe.recv)

    asyncio.run(serve())


def separate(
    args: argparse.Namespace, scratch: Path, done: Path, *, workers: int, local: bool
) -> dict[str, Any]:
    """``workers`` worker processes; this process submits, and runs a worker too when
    ``local``."""
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for _ in range(workers):
        mine, theirs = spawn.Pipe()
        process = spawn.Process(
            target=worker_process,
            daemon=True,
            args=(args.database, scratch, done, args.concurrency, theirs),
        )
        process.start()
        pipes.append(mine)
        processes.append(process)
    try:
        for pipe in pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise RuntimeError("a worker process did not start")

        async def drive() -> dict[str, Any]:
            app = build(args.database, scratch, done, pool=True)
            async with app:
                if not local:
                    return await generate(app, done, args.rate, args.seconds)
                worker = app.worker(concurrency=args.concurrency)
                async with kiln.app.running(worker.run()):
                    return await generate(app, done, args.rate, args.seconds)

        return asyncio.run(drive())
    finally:
        for pipe in pipes:
            pipe.send("stop")
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", required=True, help="sqlite:///fresh.db or postgresql://")
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=1, help="PostgreSQL: worker processes")
    parser.add_argument("--concurrency", type=int, default=64, help="slots per worker")
    parser.add_argument(
        "--worker-processes",
        type=int,
        default=max(usable_cores() - 1, 0),
        help="SQLite: worker processes beside this one (default: one per core beyond the first)",
    )
    args = parser.parse_args()
    scratch = Path(args.scratch)
    done = scratch / "kiln-pickup.done"
    if not args.database.startswith("sqlite:"):
        body = separate(args, scratch, done, workers=args.workers, local=False)
    elif args.worker_processes:
        body = separate(args, scratch, done, workers=args.worker_processes, local=True)
    else:
        body = asyncio.run(in_process(args, scratch, done))
    emit(
        {
            "system": "kiln",
            "database": args.database.split(":", 1)[0],
            "worker_processes": args.worker_processes,
            **body,
        }
    )


if __name__ == "__main__":
    main()
