"""Dramatiq on Redis, for benchmarks/peers.py (runs in the peers' own venv).

The worker is Dramatiq's own CLI at its defaults, ``dramatiq dramatiq_noop``: one process
per CPU, 8 threads each, the Redis broker's defaults (prefetch 2 x threads, worker
timeout 1 s). It imports this module, which defines the broker (``BENCH_REDIS_URL``) and
the no-op actor (it records its start in ``BENCH_DONE``). Run as a script, the module
drives the three figures (see common.py); Dramatiq keeps no task status, so "done" is
the handler's line in the file. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker

broker = RedisBroker(url=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
dramatiq.set_broker(broker)
write: Any = None


@dramatiq.actor
def noop(n: int) -> None:
    global write
    if write is None:
        from common import record

        write = record(os.environ["BENCH_DONE"])
    write(n)


def worker(done: Path, scratch: Path, tag: str) -> Any:
    """Dramatiq's CLI at its defaults, once every process said it is ready."""
    from common import Cli, wait_until

    cli = Cli(
        [sys.executable, "-m", "dramatiq", "dramatiq_noop"],
        {"BENCH_DONE": str(done), "PYTHONPATH": str(Path(__file__).parent)},
        scratch / f"dramatiq-{tag}.log",
    )
    processes = os.cpu_count() or 1

    def ready() -> bool:
        cli.alive()
        return cli.log.read_text().count("Worker process is ready for action.") >= processes

    wait_until(ready, 60, "dramatiq workers ready")
    return cli


def main() -> None:
    from common import (
        PICKUP,
        CpuMeter,
        arguments,
        count_lines,
        emit,
        open_loop,
        pickup_figures,
        starts,
        wait_until,
        warmed,
    )

    args = arguments()
    scratch = Path(args.scratch)
    body: dict[str, Any] = {
        "system": "dramatiq",
        "version": dramatiq.__version__,
        "tasks": args.tasks,
        "processes": os.cpu_count(),
        "threads": 8,
    }
    broker.flush_all()  # drain: N queued, then the CLI starts
    done = scratch / "dramatiq-drain.done"
    for n in range(args.tasks):
        noop.send(n)
    cli = worker(done, scratch, "drain")
    end = wait_until(lambda: count_lines(done) >= args.tasks and cli.alive(), 300, "drain")
    cli.stop()
    body["drain_per_s"] = round(args.tasks / (end - min(starts(done).values())), 1)
    broker.flush_all()  # enqueue + drain, then pickup, on one warm CLI
    done = scratch / "dramatiq-run.done"
    cli = worker(done, scratch, "run")
    try:
        noop.send(-1)  # warm-up: the CLI has started its workers before the clock starts
        wait_until(lambda: cli.alive() and warmed(done), 60, "dramatiq warm-up")
        started, meter = time.time(), CpuMeter(cli)
        for n in range(args.tasks):
            noop.send(n)
        end = wait_until(lambda: count_lines(done) >= args.tasks and cli.alive(), 300, "run")
        body["enqueue_drain_per_s"] = round(args.tasks / (end - started), 1)
        body.update(meter.per_job_us(args.tasks))

        async def submit(i: int) -> None:
            noop.send(PICKUP + i)

        begun = time.time()
        scheduled = asyncio.run(open_loop(args.rate, args.seconds, submit))
        total = args.tasks + len(scheduled)
        wait_until(lambda: count_lines(done) >= total and cli.alive(), 120, "pickup")
        body.update(pickup_figures(scheduled, done, begun))
    finally:
        cli.stop()
    emit(body)


if __name__ == "__main__":
    main()
