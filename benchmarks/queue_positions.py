"""What a new task's queue position costs as the queue grows, through the store in process.

A temporary SQLite store is filled with queued tasks of one kind and priority (group
commits of 500), and at each size the newest task's ``queue_position`` (the end of the
line: what ``POST /v1/tasks`` answers) is read ``--reads`` times; the CPU per read is the
process's, both store threads included. The last line is JSON::

    .venv/bin/python benchmarks/queue_positions.py
    .venv/bin/python benchmarks/queue_positions.py --sizes 1000,10000 --reads 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from kiln import canonical
from kiln.models import NewTask, Task, Timeouts
from kiln.store import Store, open_store


def new_task(n: int) -> NewTask:
    return NewTask(
        id=canonical.new_task_id(),
        tenant="bench",
        kind="image.generate",
        params={"prompt": f"queued {n}"},
        fingerprint=f"queued-{n}",
        idempotency_key=None,
        dedup_key=None,
        priority=0,
        max_attempts=3,
        deadline_s=7 * 86400.0,
        timeouts=Timeouts(),
    )


async def fill(store: Store, start: int, end: int) -> None:
    for done in range(start, end, 500):
        count = min(500, end - done)
        await asyncio.gather(*(store.submit(new_task(done + i)) for i in range(count)))


async def cpu_per_read(store: Store, task: Task, reads: int) -> tuple[int | None, float]:
    started = time.process_time()
    position = None
    for _ in range(reads):
        position = await store.queue_position(task)
    return position, (time.process_time() - started) / reads * 1e6


async def main(sizes: list[int], reads: int) -> None:
    found = []
    with tempfile.TemporaryDirectory(prefix="kiln-positions-") as tmp:
        store = open_store(f"sqlite:///{Path(tmp) / 'kiln.db'}", synchronous="OFF")
        queued = 0
        try:
            for size in sizes:
                await fill(store, queued, size - 1)
                newest = (await store.submit(new_task(size))).task
                queued = size
                position, cpu_us = await cpu_per_read(store, newest, reads)
                print(f"queued {queued:>9,}  position {position:>9,}  {cpu_us:8.1f} µs CPU a read")
                found.append({"queued": queued, "position": position, "cpu_us": round(cpu_us, 1)})
        finally:
            await store.close()
    print(json.dumps({"reads": reads, "sizes": found}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--reads", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(main([int(s) for s in args.sizes.split(",")], args.reads))
