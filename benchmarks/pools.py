"""What a shared resource pool costs a worker: no-op lifecycles with and without a pool.

One worker in this process (16 slots) runs N no-op tasks on a throwaway PostgreSQL
cluster (the test suite's, from tests/services/postgres.py) or on a temporary SQLite file,
once per capacity given (0: no pool). It prints the worker's CPU per lifecycle and the
rate; the last line is one JSON object with every figure.

    .venv/bin/python benchmarks/pools.py --capacities 0,8,4 --tasks 3000
    .venv/bin/python benchmarks/pools.py --sqlite
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kiln
from kiln.app import running

ROOT = Path(__file__).resolve().parents[1]


async def measure(url: str, storage: Path, tasks: int, capacity: int) -> dict[str, Any]:
    pools = {"gpu-a100": capacity} if capacity else {}
    settings = kiln.Settings(database_url=url, storage_url=storage.as_uri(), pools=pools)
    app = kiln.App(settings=settings)

    @app.task("noop", resources={"gpu-a100": 1})
    async def noop(ctx: Any, params: Any) -> None:
        return None

    async with app:
        for i in range(tasks):
            await app.submit("noop", {"n": i}, dedup=False)
        cpu, wall = time.process_time(), time.perf_counter()
        worker = app.worker(concurrency=16)
        async with running(worker.run()):
            while worker.completed < tasks:
                await asyncio.sleep(0.02)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "capacity": capacity,
        "lifecycles_per_s": round(tasks / wall, 1),
        "cpu_us_per_lifecycle": round(cpu / tasks * 1e6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--capacities", default="0,8,4", help="pool sizes; 0 runs without one")
    parser.add_argument("--sqlite", action="store_true", help="a temporary SQLite file instead")
    args = parser.parse_args()
    capacities = [int(c) for c in args.capacities.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kiln-pools-"))
    server = None
    try:
        if not args.sqlite:
            sys.path.insert(0, str(ROOT / "tests"))
            from services.postgres import PostgresServer, _bin_dir, _prepare_template, free_port

            bin_dir = _bin_dir()
            if bin_dir is None:
                sys.exit("PostgreSQL's server binaries are missing (make test installs them)")
            pg_root = Path(tempfile.mkdtemp(prefix="kiln-pg-"))  # handed to the postgres user
            server = PostgresServer(bin_dir, pg_root, free_port())
            server.init()
            server.start()
            _prepare_template(server)
        figures = []
        for i, capacity in enumerate(capacities):
            url = server.new_database() if server else f"sqlite:///{work / f'kiln-{i}.db'}"
            found = asyncio.run(measure(url, work / f"results-{i}", args.tasks, capacity))
            print(f"pool {capacity or 'none':>4}: {found['lifecycles_per_s']:7.1f} lifecycles/s,"
                  f" {found['cpu_us_per_lifecycle']:6d} us worker CPU per lifecycle")  # fmt: skip
            figures.append(found)
        database = "sqlite" if args.sqlite else "postgresql"
        print(json.dumps({"database": database, "tasks": args.tasks, "figures": figures}))
    finally:
        if server is not None:
            server.stop("immediate")
            shutil.rmtree(server.root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
