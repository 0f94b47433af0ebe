"""Procrastinate's drain rate on PostgreSQL, for benchmarks/peers.py (runs in the peers'
own venv).

N no-op jobs are deferred in batches, then one worker (``--concurrency``) drains them
until the queue is empty: the drain rate is N over the worker's run; the enqueue + drain
rate counts the deferring too. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import procrastinate

parser = argparse.ArgumentParser()
parser.add_argument("--database", required=True, help="a fresh database's URL")
parser.add_argument("--tasks", type=int, default=1500)
parser.add_argument("--concurrency", type=int, default=16)
args = parser.parse_args()

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=args.database))


@app.task(name="noop", queue="bench")
async def noop(n: int) -> None:
    return None


async def main() -> None:
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        started = time.perf_counter()
        for first in range(0, args.tasks, 500):
            last = min(first + 500, args.tasks)
            await noop.batch_defer_async(*({"n": n} for n in range(first, last)))
        deferred = time.perf_counter()
        await app.run_worker_async(queues=["bench"], concurrency=args.concurrency, wait=False)
        drained = time.perf_counter()
    print(json.dumps({
        "system": "procrastinate", "version": procrastinate.__version__, "tasks": args.tasks,
        "drain_per_s": round(args.tasks / (drained - deferred), 1),
        "enqueue_drain_per_s": round(args.tasks / (drained - started), 1),
    }))  # fmt: skip


asyncio.run(main())
