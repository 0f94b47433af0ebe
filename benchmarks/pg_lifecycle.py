"""The lifecycle on PostgreSQL: worker processes beside pgbench on the same cluster.

This process submits; ``--workers`` worker processes (``spawn``ed, each with its own store
and connection pool) claim and run. The figure runs on a fresh database. The transactions a
lifecycle took come from the server: xids handed out in the cluster (every transaction that
wrote) and ``pg_stat_database`` commits (read-only ones too). Then ``pgbench -N`` runs on
the same cluster with as many clients as the engine held connections, and the ratio
compares the two: lifecycles/s : (pgbench tps / write transactions per lifecycle).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from harness import (
    KIND,
    Figure,
    Workers,
    build_app,
    cpu_line,
    head_lines,
    load,
    machine,
    scratch_dir,
    submit_all,
    transitions_of,
    wait_for_success,
)
from pg_cluster import Cluster, Pgbench, machine_cpu, run_pgbench, throwaway_cluster

import kiln
from kiln.api.bulk import IN_FLIGHT
from kiln.models import SubmitResult
from kiln.store import open_store

PG_POLL_S = 0.05
#: Submits in flight per pooled connection: enough to keep each busy, few enough that none
#: waits for a connection anywhere near the store's acquire timeout.
SUBMITS_PER_CONNECTION = 4
#: The aim: lifecycles/s >= AIM x (pgbench -N tps / write transactions per lifecycle).
AIM = 0.6


@dataclass
class ServerUse:
    """What a PostgreSQL figure asked of the server, from the server's own counters."""

    workers: int
    pool_size: int
    write_tx: int  # xids handed out in the cluster: every transaction that wrote
    commits: int  # commits in the benchmark database, read-only ones too (polls excluded)
    connections: int  # the engine's connections at the finish
    server_cpu_s: float | None
    busy_s: float  # CPU seconds the whole machine used, all processes together
    iowait_s: float
    engine_sys_s: float  # the engine's CPU in the kernel (sockets, epoll), all processes
    calls: dict[str, int] = field(default_factory=dict)  # claims, empty claims, heartbeats

    def tx_per_lifecycle(self, succeeded: int) -> float:
        """The transactions a lifecycle needs: those that wrote, less the heartbeats (one
        transaction each), which only attempts that outlive a heartbeat interval make."""
        return (self.write_tx - self.calls.get("heartbeats", 0)) / max(succeeded, 1)


def count_calls(store: Any) -> collections.Counter[str]:
    """Count this process's claims (with tasks or empty) and heartbeats, by wrapping the
    store's methods on the instance."""
    tally: collections.Counter[str] = collections.Counter()
    claim, heartbeat = store.claim, store.heartbeat

    async def counted_claim(**options: Any) -> Any:
        claimed = await claim(**options)
        tally["claims" if claimed else "empty_claims"] += 1
        return claimed

    async def counted_heartbeat(*args: Any, **options: Any) -> Any:
        tally["heartbeats"] += 1
        return await heartbeat(*args, **options)

    store.claim, store.heartbeat = counted_claim, counted_heartbeat
    return tally


def worker_process(
    url: str, results: Path, output_bytes: int, concurrency: int, pool_size: int, log: str,
    hold: bool, pipe: Connection,
) -> None:  # fmt: skip
    """One worker process: say "ready", claim and run until told "stop", send its tally.
    ``hold`` (a drain): its worker starts only when told "go", after "ready"."""
    if log != "off":
        from kiln import logs

        logs.setup(fmt=log, level="INFO")
    pipe.send(asyncio.run(serve(url, results, output_bytes, concurrency, pool_size, hold, pipe)))
    pipe.close()


async def serve(
    url: str, results: Path, output_bytes: int, concurrency: int, pool_size: int, hold: bool,
    pipe: Connection,
) -> dict[str, float]:  # fmt: skip
    store = open_store(url, pool_size=pool_size)
    app = build_app(url, results, "NORMAL", output_bytes, store=store)
    tally = count_calls(store)
    async with app:
        held = None
        if hold:  # a drain: the pool is open and the tasks are queued before the worker starts
            await store.counters()
            pipe.send("ready")
            await asyncio.to_thread(pipe.recv)  # "go"
            held = os.times()
        worker = app.worker(concurrency=concurrency)
        async with kiln.app.running(worker.run()):
            await store.counters()  # the pool is open before the clock starts
            before = held or os.times()
            if not hold:
                pipe.send("ready")
            await asyncio.to_thread(pipe.recv)  # "stop"
            after = os.times()
    return {"cpu_s": after.user + after.system - before.user - before.system,
            "sys_s": after.system - before.system, **tally}  # fmt: skip


async def submit_batches(app: kiln.App, tasks: int, batch: int) -> int:
    """Submit ``tasks`` new tasks in batches of ``batch``, as ``POST /v1/tasks/batch`` does
    (kiln.api.bulk): a batch's submits IN_FLIGHT at a time, which the store's batcher takes
    into shared transactions; the next batch once the last one is in."""
    window = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> SubmitResult:
        async with window:
            return await app.submit(KIND, {"n": i}, dedup=False)

    created = 0
    for start in range(0, tasks, batch):
        results = await asyncio.gather(*(one(i) for i in range(start, min(start + batch, tasks))))
        created += sum(1 for r in results if r.created)
    return created


async def submit(app: kiln.App, tasks: int, pool_size: int, batch: int | None) -> int:
    if batch is None:  # one task per submit call, a chunk of them in flight at a time
        return await submit_all(app, tasks, chunk=SUBMITS_PER_CONNECTION * pool_size)
    return await submit_batches(app, tasks, batch)


async def drive(
    url: str, results: Path, cluster: Cluster, postmaster: int | None, *,
    tasks: int, pool_size: int, output_bytes: int, batch: int | None,
    go: Callable[[], None] | None = None,
) -> tuple[Figure, dict[str, Any]]:  # fmt: skip
    """Submit from this process while the workers run; time to the last SUCCESS. With
    ``go`` (a drain), submit all first, then ``go()`` starts the workers and the clock.
    The CPU and the server's counters cover the submits in both."""
    name = url.rsplit("/", 1)[1]
    store = open_store(url, pool_size=pool_size)
    app = build_app(url, results, "NORMAL", output_bytes, store=store)
    async with app:
        await store.counters()  # the pool is open before the clock starts
        before, machine_before = cluster.snapshot(name, postmaster), machine_cpu()
        cpu = os.times()
        started = begun = time.perf_counter()
        created = await submit(app, tasks, pool_size, batch)
        submitted = time.perf_counter()
        if go is not None:
            go()
            started = time.perf_counter()
        timeout_s = max(120.0, tasks / 10)
        finished, polls = await wait_for_success(app, created, timeout_s, PG_POLL_S)
        cpu_end = os.times()
        cpu_s = cpu_end.user + cpu_end.system - cpu.user - cpu.system
        at_finish, machine_after = cluster.snapshot(name, postmaster), machine_cpu()
        connections = cluster.connections(name)
        stats = await app.engine.store.stats(tenant=None, ghost_after_s=60)
        moved = transitions_of(await app.engine.store.counters())
    figure = Figure(
        tasks=created, output_bytes=output_bytes, concurrency=0, wall_s=finished - started,
        submit_s=submitted - begun, transitions=created + sum(moved.values()),
        succeeded=stats.counts["SUCCESS"], cpu_s=cpu_s, thread_cpu_s={"submitter": cpu_s},
        by_transition=moved,
    )  # fmt: skip
    cpu_used = None
    if at_finish.server_cpu_s is not None and before.server_cpu_s is not None:
        cpu_used = at_finish.server_cpu_s - before.server_cpu_s
    return figure, {
        "before": before, "write_tx": at_finish.next_xid - before.next_xid - 1, "polls": polls,
        "connections": connections, "server_cpu_s": cpu_used,
        "sys_s": cpu_end.system - cpu.system,
        "busy_s": machine_after[0] - machine_before[0],
        "iowait_s": machine_after[2] - machine_before[2],
    }  # fmt: skip


def run_pg_figure(
    cluster: Cluster, scratch: Path, postmaster: int | None, *,
    tasks: int, workers: int, concurrency: int, pool_size: int, output_bytes: int, log: str,
    drain: bool = False, batch: int | None = None,
) -> Figure:  # fmt: skip
    """One figure on a fresh database: migrate, start the workers, submit, wait, count."""
    name = f"kiln_bench_{os.getpid()}_{output_bytes}"
    url = cluster.create_database(name)
    results = scratch / f"results-{output_bytes}"
    asyncio.run(migrate(url))
    cluster.wait_idle(name)
    running = Workers(worker_process)
    try:
        running.start(workers, url, results, output_bytes, concurrency, pool_size, log, drain)
        figure, seen = asyncio.run(drive(
            url, results, cluster, postmaster, tasks=tasks, pool_size=pool_size,
            output_bytes=output_bytes, batch=batch, go=running.go if drain else None,
        ))  # fmt: skip
        reports = running.stop()
    finally:
        running.kill_leftovers()
    cluster.wait_idle(name)  # every backend has reported its commits
    after = cluster.snapshot(name, postmaster)
    cluster.drop_database(name)
    calls: collections.Counter[str] = collections.Counter()
    for report in reports:
        calls.update({k: int(v) for k, v in report.items() if not k.endswith("_s")})
    worker_cpu_s = sum(report["cpu_s"] for report in reports)
    figure.concurrency = concurrency
    figure.cpu_s += worker_cpu_s
    figure.thread_cpu_s["worker processes"] = worker_cpu_s
    figure.server = ServerUse(
        workers=workers, pool_size=pool_size, write_tx=seen["write_tx"],
        commits=after.commits - seen["before"].commits - seen["polls"],
        connections=seen["connections"], server_cpu_s=seen["server_cpu_s"],
        busy_s=seen["busy_s"], iowait_s=seen["iowait_s"], calls=dict(calls),
        engine_sys_s=seen["sys_s"] + sum(report["sys_s"] for report in reports),
    )  # fmt: skip
    return figure


async def migrate(url: str) -> None:
    store = open_store(url, pool_size=1)
    await store.counters()  # opening the store applies the migrations
    await store.close()


def run_postgres(args: argparse.Namespace, sizes: list[int], say: Callable[[str], None]) -> int:
    """The PostgreSQL figures, then pgbench -N on the same cluster; the JSON line last."""
    with scratch_dir() as scratch, (
        throwaway_cluster() if args.start_postgres else nullcontext(Cluster(args.database))
    ) as cluster:  # fmt: skip
        server = cluster.describe()
        postmaster = cluster.postmaster_pid()
        say(" ".join(f"{k}={v}" for k, v in machine().items()))
        say(" ".join(f"{k}={v}" for k, v in server.items()))
        say(f"database=postgresql workers={args.workers} concurrency={args.concurrency}"
            f" pool_size={args.pool_size} engine_logs={args.log} mode={mode_of(args)}"
            f" submit_batch={args.submit_batch or 'off'}")  # fmt: skip
        figures = [
            run_pg_figure(
                cluster, scratch, postmaster, tasks=args.tasks, workers=args.workers,
                concurrency=args.concurrency, pool_size=args.pool_size, output_bytes=size,
                log=args.log, drain=args.drain, batch=args.submit_batch,
            )
            for size in sizes
        ]  # fmt: skip
        assert figures[0].server is not None
        clients = args.clients or figures[0].server.connections
        threads = min(clients, os.cpu_count() or 1)
        bench = run_pgbench(cluster, clients=clients, threads=threads,
                            seconds=args.pgbench_seconds, postmaster=postmaster)  # fmt: skip
        say(describe_pgbench(bench))
        for figure in figures:
            for line in describe_pg(figure, bench):
                say(line)
        say(f"loadavg at the end: {load()}")
    body = pg_summary_json(figures, bench, server)
    body.update(mode=mode_of(args), submit_batch=args.submit_batch)
    print(json.dumps(body))
    return 0


def mode_of(args: argparse.Namespace) -> str:
    """lifecycle: submits while the workers run; drain: all queued before they start."""
    return "drain" if args.drain else "lifecycle"


def pg_ratio(figure: Figure, pgbench_tps: float) -> float:
    """lifecycles/s : (pgbench tps / write transactions per lifecycle); the aim is AIM."""
    assert figure.server is not None
    return figure.lifecycles_per_s / (
        pgbench_tps / figure.server.tx_per_lifecycle(figure.succeeded)
    )


def pg_summary_json(
    figures: list[Figure], bench: Pgbench, server: dict[str, str]
) -> dict[str, Any]:
    main = figures[0]
    assert main.server is not None
    use = main.server
    body: dict[str, Any] = {
        "lifecycles_per_s": round(main.lifecycles_per_s, 1),
        "transitions_per_s": round(main.transitions_per_s, 1),
        "raw_tx_per_s": round(bench.tps, 1),
        "ratio": round(pg_ratio(main, bench.tps), 4),
        "aim": AIM,
        "tx_per_lifecycle": round(use.tx_per_lifecycle(main.succeeded), 3),
        "heartbeats_per_lifecycle": round(use.calls.get("heartbeats", 0) / main.succeeded, 3),
        "commits_per_lifecycle": round(use.commits / max(main.succeeded, 1), 3),
        "output_bytes": main.output_bytes,
        "tasks": main.tasks,
        "workers": use.workers,
        "concurrency": main.concurrency,
        "pool_size": use.pool_size,
        "pgbench_clients": bench.clients,
        "pgbench_threads": bench.threads,
        "cpu_us_per_lifecycle": round(main.cpu_us_per_lifecycle, 1),
        "worker_cpu_us_per_lifecycle": round(
            main.thread_cpu_s["worker processes"] / max(main.succeeded, 1) * 1e6, 1
        ),
        "database": "postgresql",
        "postgresql": server["postgresql"],
        "fsync": server["fsync"],
        "synchronous_commit": server["synchronous_commit"],
    }
    if use.server_cpu_s is not None:
        body["server_cpu_us_per_lifecycle"] = round(use.server_cpu_s / main.succeeded * 1e6, 1)
    for extra in figures[1:]:
        assert extra.server is not None
        tag = "_1k" if extra.output_bytes == 1024 else f"_{extra.output_bytes}b"
        body[f"lifecycles_per_s{tag}"] = round(extra.lifecycles_per_s, 1)
        body[f"transitions_per_s{tag}"] = round(extra.transitions_per_s, 1)
        body[f"ratio{tag}"] = round(pg_ratio(extra, bench.tps), 4)
        body[f"tx_per_lifecycle{tag}"] = round(extra.server.tx_per_lifecycle(extra.succeeded), 3)
        body[f"cpu_us_per_lifecycle{tag}"] = round(extra.cpu_us_per_lifecycle, 1)
    return body


def describe_pg(figure: Figure, bench: Pgbench) -> list[str]:
    use = figure.server
    assert use is not None
    n = max(figure.succeeded, 1)
    tx = use.tx_per_lifecycle(figure.succeeded)
    calls = use.calls
    lines = [
        *head_lines(figure),
        f"  write transactions {use.write_tx}, less heartbeats = {tx:.3f} per lifecycle"
        f" ({calls.get('claims', 0)} claims with tasks, mean batch"
        f" {figure.succeeded / max(calls.get('claims', 0), 1):.1f};"
        f" {calls.get('heartbeats', 0)} heartbeats)",
        f"  commits, read-only too {use.commits} = {use.commits / n:.3f} per lifecycle"
        f" ({calls.get('empty_claims', 0)} empty claims)",
        f"  pgbench -N {bench.tps:.1f} tps / {tx:.3f} = {bench.tps / tx:.1f} lifecycles/s ceiling",
        f"  ratio lifecycles/s : ceiling            {pg_ratio(figure, bench.tps):.3f}"
        f"  (aim {AIM:.2f})",
        f"{cpu_line(figure)}; in the kernel {use.engine_sys_s:.2f} s",
    ]
    cores = os.cpu_count() or 1
    server = "unknown" if use.server_cpu_s is None else (
        f"{use.server_cpu_s:.2f} s = {use.server_cpu_s / n * 1e6:.0f} us per lifecycle"
    )  # fmt: skip
    lines.append(
        f"  server CPU {server}; machine busy {use.busy_s:.2f} of"
        f" {cores * figure.wall_s:.2f} CPU-s ({use.busy_s / (cores * figure.wall_s):.0%}),"
        f" iowait {use.iowait_s:.2f} s; {use.connections} engine connections"
    )
    return lines


def describe_pgbench(bench: Pgbench) -> str:
    per_tx = "unknown" if bench.server_cpu_s is None else (
        f"{bench.server_cpu_s / (bench.tps * bench.seconds) * 1e6:.0f} us"
    )  # fmt: skip
    return (
        f"pgbench -N -c {bench.clients} -j {bench.threads} -T {bench.seconds:g}:"
        f" {bench.tps:.1f} tps, latency {bench.latency_ms:.2f} ms; server CPU per tx {per_tx},"
        f" pgbench CPU {bench.client_cpu_s:.2f} s, machine busy {bench.busy_s:.2f} CPU-s"
    )
