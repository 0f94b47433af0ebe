"""The lifecycle on SQLite as ``kiln serve`` runs it on a machine of several cores: this
process submits (the API's part) and runs its own in-process worker slots when asked;
``--worker-processes`` separate worker processes (``spawn``ed, each its own store, writer
thread and connection on the same file) claim and run beside it.

CPU per lifecycle is every kiln process's CPU: this process's and each worker process's
(``os.times``, which reads the kernel's per-process accounting), over the figure.
"""

from __future__ import annotations

import asyncio
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from harness import (
    Figure,
    Workers,
    build_app,
    submit_all,
    transitions_of,
    wait_for_success,
)
from pg_cluster import server_cpu_s

import kiln
from kiln.cli.worker_processes import usable_cores
from kiln.store import open_store


def auto_processes() -> int:
    """As ``kiln serve``'s ``KILN_WORKER_PROCESSES=auto`` on SQLite: one per usable core
    beyond the first."""
    return max(usable_cores() - 1, 0)


def worker_process(
    url: str,
    results: Path,
    synchronous: str,
    output_bytes: int,
    concurrency: int,
    pipe: Connection,
) -> None:
    """One worker process: say "ready", claim and run until told "stop", send its CPU."""
    import sys

    sys.setswitchinterval(float(os.environ.get("SWI", "0.005")))
    pipe.send(asyncio.run(_serve(url, results, synchronous, output_bytes, concurrency, pipe)))
    pipe.close()


async def _serve(
    url: str,
    results: Path,
    synchronous: str,
    output_bytes: int,
    concurrency: int,
    pipe: Connection,
) -> dict[str, Any]:
    store = open_store(url, synchronous=synchronous)
    app = build_app(url, results, synchronous, output_bytes, store=store)
    async with app:
        worker = app.worker(concurrency=concurrency)
        async with kiln.app.running(worker.run()):
            await store.counters()
            before = os.times()
            pipe.send("ready")
            await asyncio.to_thread(pipe.recv)  # "stop"
            after = os.times()
        lock = getattr(store, "lock_stats", None)
        batches = getattr(store, "write_batches", (0, 0))
    return {
        "cpu_s": after.user + after.system - before.user - before.system,
        "batches": batches,
        "lock": lock() if callable(lock) else None,
    }


async def _drive(
    url: str,
    results: Path,
    *,
    tasks: int,
    synchronous: str,
    concurrency: int,
    output_bytes: int,
) -> tuple[Figure, dict[str, Any]]:
    # As kiln serve on this machine: a submit process with two cores or more (unless
    # KILN_SQLITE_SUBMIT_PROCESS says on or off).
    chosen = os.environ.get("KILN_SQLITE_SUBMIT_PROCESS", "auto").lower()
    submit_process = usable_cores() >= 2 if chosen == "auto" else chosen == "on"
    app = build_app(url, results, synchronous, output_bytes, submit_process=submit_process)
    async with app:
        worker = app.worker(concurrency=concurrency) if concurrency else None
        running = kiln.app.running(worker.run()) if worker else _nothing()
        async with running:
            await app.engine.store.counters()
            submitter = getattr(app.engine.store, "submitter", None)
            if submitter is not None:  # started, and ready, before the clock
                assert await submitter.wait_ready(), "the submit process did not start"
            child_before = 0.0 if submitter is None else (server_cpu_s(submitter.pid) or 0.0)
            cpu = os.times()
            started = time.perf_counter()
            created = await submit_all(app, tasks)
            submitted = time.perf_counter()
            finished, _ = await wait_for_success(app, created, timeout_s=max(120.0, tasks / 10))
            end = os.times()
            submitter = getattr(app.engine.store, "submitter", None)
            child_s = (
                0.0 if submitter is None else (server_cpu_s(submitter.pid) or 0.0) - child_before
            )
        stats = await app.engine.store.stats(tenant=None, ghost_after_s=60)
        moved = transitions_of(await app.engine.store.counters())
        lock = getattr(app.engine.store, "lock_stats", None)
        batches = getattr(app.engine.store, "write_batches", (0, 0))
    cpu_s = end.user + end.system - cpu.user - cpu.system + child_s
    figure = Figure(
        tasks=created,
        output_bytes=output_bytes,
        concurrency=concurrency,
        wall_s=finished - started,
        submit_s=submitted - started,
        transitions=created + sum(moved.values()),
        succeeded=stats.counts["SUCCESS"],
        cpu_s=cpu_s,
        thread_cpu_s={"serving process": cpu_s - child_s, "submit process": child_s},
        by_transition=moved,
    )
    return figure, {"batches": batches, "lock": lock() if callable(lock) else None}


class _nothing:
    """No worker in this process (``local_concurrency`` 0)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def run_sqlite_processes(
    url: str,
    scratch: Path,
    *,
    tasks: int,
    synchronous: str,
    concurrency: int,
    output_bytes: int,
    processes: int,
    local_concurrency: int,
) -> tuple[Figure, dict[str, Any]]:
    """One figure: ``processes`` worker processes of ``concurrency`` slots beside this
    process, which submits and runs ``local_concurrency`` slots of its own (0: none)."""
    results = scratch / f"results-{output_bytes}"
    asyncio.run(_migrate(url, synchronous))
    running = Workers(worker_process)
    try:
        running.start(processes, url, results, synchronous, output_bytes, concurrency)
        figure, seen = asyncio.run(
            _drive(
                url,
                results,
                tasks=tasks,
                synchronous=synchronous,
                concurrency=local_concurrency,
                output_bytes=output_bytes,
            )
        )
        reports = running.stop()
    finally:
        running.kill_leftovers()
    worker_cpu = sum(r["cpu_s"] for r in reports)
    figure.cpu_s += worker_cpu
    figure.thread_cpu_s["worker processes"] = worker_cpu
    tx = seen["batches"][0] + sum(r["batches"][0] for r in reports)
    ops = seen["batches"][1] + sum(r["batches"][1] for r in reports)
    figure.write_batches = (tx, ops)
    locks = [x for x in [seen["lock"], *(r["lock"] for r in reports)] if x]
    return figure, {"processes": processes, "locks": locks}


async def _migrate(url: str, synchronous: str) -> None:
    store = open_store(url, synchronous=synchronous)
    await store.counters()
    await store.close()
