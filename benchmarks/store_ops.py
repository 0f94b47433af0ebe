"""What one store operation costs: CPU per submit, claim, acquire and heartbeat.

The store alone, with no worker or API around it: N submissions, then claims of up to
``--concurrency`` tasks until all are claimed, then one ``acquire`` and one heartbeat per
task, each phase ``--concurrency`` operations at a time. Process CPU (every thread: the
SQLite driver's writer works on its own) divided by the operations. On a temporary
SQLite file (``--synchronous``) or a throwaway PostgreSQL cluster (``--postgres``).

    .venv/bin/python benchmarks/store_ops.py --tasks 3000
    .venv/bin/python benchmarks/store_ops.py --postgres

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

from kiln import canonical
from kiln.models import NewTask, Task, Timeouts
from kiln.states import Event, Status
from kiln.store import Change, Store, open_store
from kiln.store.records import WORKER

ROOT = Path(__file__).resolve().parents[1]
KIND = "bench.noop"


def new_task(n: int) -> NewTask:
    params = {"n": n}
    return NewTask(
        id=canonical.new_task_id(), tenant="bench", kind=KIND, params=params,
        fingerprint=canonical.digest(params), idempotency_key=None,
        dedup_key=canonical.dedup_key(KIND, params, []), priority=0, max_attempts=3,
        deadline_s=3600.0, timeouts=Timeouts(),
    )  # fmt: skip


def acquire(task: Task) -> Change:
    return Change(task.id, task.status, task.epoch, ((Event.ACQUIRE, Status.GENERATING),),
                  fence=WORKER)  # fmt: skip


async def phase(ops: Sequence[Awaitable[Any]], concurrency: int) -> tuple[float, list[Any]]:
    """CPU µs per operation, and the results."""
    started = time.process_time()
    done: list[Any] = []
    for i in range(0, len(ops), concurrency):
        done += await asyncio.gather(*ops[i : i + concurrency])
    return (time.process_time() - started) / max(len(ops), 1) * 1e6, done


async def measure(store: Store, tasks: int, concurrency: int) -> dict[str, float]:
    submit_us, _ = await phase([store.submit(new_task(n)) for n in range(tasks)], concurrency)
    started = time.process_time()
    claimed: list[Task] = []
    while len(claimed) < tasks:
        claimed += await store.claim(worker_id="bench", kinds=[KIND], limit=concurrency,
                                     lease_ttl_s=600.0)  # fmt: skip
    claim_us = (time.process_time() - started) / tasks * 1e6
    acquire_us, acquired = await phase([store.apply(acquire(t)) for t in claimed], concurrency)
    beats = [store.heartbeat(t.id, t.epoch, 600.0, None) for t, _ in acquired]
    heartbeat_us, _ = await phase(beats, concurrency)
    await store.close()
    return {"submit_us": round(submit_us, 1), "claim_us_per_task": round(claim_us, 1),
            "acquire_us": round(acquire_us, 1), "heartbeat_us": round(heartbeat_us, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--synchronous", type=str.upper, choices=["NORMAL", "FULL"],
                        default="FULL")  # fmt: skip
    parser.add_argument("--postgres", action="store_true", help="a throwaway PostgreSQL cluster")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-store-ops-"))
    server = None
    try:
        if args.postgres:
            sys.path.insert(0, str(ROOT / "tests"))
            from services.postgres import PostgresServer, _bin_dir, _prepare_template, free_port

            bin_dir = _bin_dir()
            if bin_dir is None:
                sys.exit("PostgreSQL's server binaries are missing (make test installs them)")
            server = PostgresServer(bin_dir, Path(tempfile.mkdtemp(prefix="kiln-pg-")),
                                    free_port())  # fmt: skip
            server.init()
            server.start()
            _prepare_template(server)
            store = open_store(server.new_database())
        else:
            store = open_store(f"sqlite:///{work / 'kiln.db'}", synchronous=args.synchronous)
        figures = asyncio.run(measure(store, args.tasks, args.concurrency))
        for name, value in figures.items():
            print(f"{name:>18}: {value:8.1f}")
        database = "postgresql" if args.postgres else f"sqlite ({args.synchronous})"
        print(json.dumps({"database": database, "tasks": args.tasks,
                          "concurrency": args.concurrency, **figures}))  # fmt: skip
    finally:
        if server is not None:
            server.stop("immediate")
            shutil.rmtree(server.root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
