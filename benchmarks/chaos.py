"""The chaos run: N tasks through real kiln processes that are killed, paused and lied to,
then every invariant of DESIGN.md checked on what is left.

Worker processes (``chaos_worker.py``: `kiln worker` with a storage that fails a share of
its writes) and a `kiln supervisor` process share one database and one results folder.
This process submits the tasks through ``kiln.App`` (plain ones, retryable and permanent
failures, stalls, duplicates, idempotency-key replays and bursts of identical requests),
cancels some while PENDING and some while running, and meanwhile:

- SIGKILLs a random worker at random moments and starts a fresh one;
- SIGSTOPs a random worker for longer than its lease, then lets it go on (a stale worker);
- SIGKILLs the supervisor once, in the middle, and starts another;
- on SQLite, SIGKILLs this process's submit process (``kiln.store.submit_process``: plain
  submissions are written there) every 2 to 5 s; the store starts the next one.

When every task is final it stops the processes and runs the checks of
``chaos_checks.py``: a table with each invariant, PASS or FAIL and its counts, then the run
figures. The last line of stdout is one JSON object with every figure and ``"ok"``; the
exit status is 1 on any violation (or when the chaos did not happen), 0 otherwise.

    python benchmarks/chaos.py                      # 2,000 tasks on SQLite
    python benchmarks/chaos.py --tasks 200 --seed 7
    python benchmarks/chaos.py --postgres           # on a throwaway PostgreSQL cluster
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_checks import Check, Expected, Snapshot, check_all, load, step_map
from chaos_comfy import ComfyFleet, ComfySubmitter, check_comfy
from chaos_comfy import figures as comfy_figures
from chaos_submit import Submitter

import kiln
from kiln import backends, transform
from kiln.backends import comfy_workflow
from kiln.config import Settings
from kiln.states import ACTIVE, Event, Status

HERE = Path(__file__).resolve().parent
WORKER_SCRIPT = HERE / "chaos_worker.py"
POLL_S = 0.1
#: From this many tasks on, a run without a pipeline or an input by reference fails CH.
SHARES_FROM = 100


# The processes --------------------------------------------------------------------------------


@dataclass
class Fleet:
    """The kiln processes of the run, each with its own log file, stopped by PID."""

    run_dir: Path
    env: dict[str, str]
    args: argparse.Namespace
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    supervisor: subprocess.Popen[bytes] | None = None
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    paused: set[int] = field(default_factory=set)

    def _start(
        self, name: str, command: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log_path = self.run_dir / "logs" / f"{name}-{len(self.started)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env or self.env,
                cwd=self.run_dir,
            )  # fmt: skip
        self.started.append(process)
        return process

    def start_worker(self) -> None:
        """A worker process, of three sorts in turn: one whose tasks wait for a GPU slot,
        one whose kind takes no slot (its claims acquire at once), one that runs its tasks
        in batches of their key: every path runs."""
        seed = self.args.seed * 1000 + len(self.started)
        sort = ("worker", "worker-free", "worker-batch")[len(self.started) % 3]
        env = dict(self.env)
        if sort != "worker-batch":
            env.pop("KILN_GENERATE_BATCH")
        self.workers.append(
            self._start(sort, [
                sys.executable, str(WORKER_SCRIPT),
                "--fault-rate", str(self.args.fault_rate),
                "--fault-log", str(self.run_dir / "faults"),
                "--seed", str(seed),
                "--concurrency", str(self.args.concurrency),
                "--gpus", str(self.args.gpus),
                *(["--no-slot"] if sort == "worker-free" else []),
            ], env)
        )  # fmt: skip

    def start_supervisor(self) -> None:
        self.supervisor = self._start("supervisor", [sys.executable, "-m", "kiln", "supervisor"])

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL, then reap it (a stopped process dies of SIGKILL as well)."""
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        self.paused.discard(process.pid)
        if process in self.workers:
            self.workers.remove(process)

    def died(self) -> list[subprocess.Popen[bytes]]:
        """Processes that exited by themselves (none should)."""
        return [
            p for p in [*self.workers, self.supervisor] if p is not None and p.poll() is not None
        ]

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (and SIGCONT) to every live process, SIGKILL to any that lingers."""
        live = [p for p in self.started if p.poll() is None]
        for process in live:
            os.kill(process.pid, signal.SIGTERM)
            os.kill(process.pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        for process in live:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=timeout_s)


# The chaos -----------------------------------------------------------------------------------


@dataclass
class Chaos:
    """What was done to the processes, and when the run is over."""

    fleet: Fleet
    rng: random.Random
    args: argparse.Namespace
    done: asyncio.Event = field(default_factory=asyncio.Event)
    kills: int = 0
    pauses: int = 0
    supervisor_restarts: int = 0
    submit_process_kills: int = 0
    exited_by_themselves: list[str] = field(default_factory=list)

    async def _nap(self, low_s: float, high_s: float) -> bool:
        """Wait a random while; False once the run is over."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), self.rng.uniform(low_s, high_s))
        return not self.done.is_set()

    async def kill_workers(self) -> None:
        """SIGKILL a random worker at random moments; a fresh one takes its place."""
        low, high = self.args.kill_every_s
        while await self._nap(low, high):
            victim = self.rng.choice(self.fleet.workers)
            self.fleet.kill(victim)
            self.kills += 1
            self.fleet.start_worker()

    async def kill_submit_processes(self, app: kiln.App) -> None:
        """SIGKILL the App's submit process at random moments (SQLite): what it held is
        settled by the App's own writer, and the next one starts half a second later."""
        submitter = getattr(app.engine.store, "submitter", None)
        if submitter is None:
            return
        submitter.respawn_after_s = 0.5
        while await self._nap(2.0, 5.0):
            if submitter.pid is not None:
                os.kill(submitter.pid, signal.SIGKILL)
                self.submit_process_kills += 1

    async def pause_workers(self) -> None:
        """SIGSTOP a random worker past its lease, then SIGCONT: it wakes up stale."""
        low, high = self.args.pause_every_s
        while await self._nap(low, high):
            awake = [p for p in self.fleet.workers if p.pid not in self.fleet.paused]
            if not awake:
                continue
            victim = self.rng.choice(awake)
            os.kill(victim.pid, signal.SIGSTOP)
            self.fleet.paused.add(victim.pid)
            self.pauses += 1
            ttl = self.args.lease_ttl_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), self.rng.uniform(1.5 * ttl, 2.5 * ttl))
            if victim.pid in self.fleet.paused and victim.poll() is None:
                os.kill(victim.pid, signal.SIGCONT)
            self.fleet.paused.discard(victim.pid)

    async def restart_supervisor(self, app: kiln.App, total: int) -> None:
        """Once about 40% of the tasks are final: SIGKILL the supervisor, start another."""
        while not self.done.is_set():
            counts = (await app.engine.store.stats(tenant=None, ghost_after_s=60)).counts
            final = sum(n for status, n in counts.items() if Status(status) not in ACTIVE)
            if final >= 0.4 * total:
                assert self.fleet.supervisor is not None
                self.fleet.kill(self.fleet.supervisor)
                self.fleet.start_supervisor()
                self.supervisor_restarts += 1
                return
            await asyncio.sleep(POLL_S)

    async def watch_processes(self) -> None:
        """Note any process that exited without being killed (a crash of kiln itself)."""
        while not self.done.is_set():
            for process in self.fleet.died():
                name = " ".join(str(a) for a in process.args[1:3])  # type: ignore[index]
                self.exited_by_themselves.append(f"pid {process.pid} ({name}) {process.returncode}")
                if process in self.fleet.workers:
                    self.fleet.workers.remove(process)
                    self.fleet.start_worker()
                else:
                    self.fleet.start_supervisor()
            await asyncio.sleep(POLL_S)


async def until_all_final(
    app: kiln.App,
    submitter: Submitter,
    loops: Sequence[asyncio.Future[None]],
    timeout_s: float,
    comfy: ComfySubmitter,
) -> bool:
    """Poll the store until the submissions are done and no task is active; stop early
    when one of the run's own loops failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(loop.done() and loop.exception() for loop in loops):
            return False
        if submitter.settled and comfy.finished:
            counts = (await app.engine.store.stats(tenant=None, ghost_after_s=60)).counts
            if not any(counts.get(str(status), 0) for status in ACTIVE):
                return True
        await asyncio.sleep(POLL_S)
    return False


# One run ---------------------------------------------------------------------------------


def child_env(args: argparse.Namespace, database_url: str, results: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_DATABASE_URL=database_url,
        KILN_STORAGE_URL=results.as_uri(),
        KILN_DATA_DIR=str(results.parent),
        KILN_LEASE_TTL_S=str(args.lease_ttl_s),
        KILN_SUPERVISOR_INTERVAL_S=str(args.supervisor_interval_s),
        KILN_RETRY_BASE_S="0.05",
        KILN_RETRY_MAX_S="0.5",
        KILN_CANCEL_GRACE_S="1.0",
        KILN_LOG_LEVEL=args.log_level,
        # Tasks name one of three models (warm-model routing, a worker holding one at a
        # time) and carry a batch key; every third worker runs them in batches.
        KILN_DEMO_MODEL_LOAD_S="0.05",
        KILN_MODEL_MEMORY_GB="2",
        KILN_AFFINITY_WAIT_S="0.5",
        KILN_GENERATE_BATCH=BATCH,
    )
    return env


#: Batches of up to 4 tasks, waiting up to 20 ms for more.
BATCH = "4/20"


def settings_of(env: dict[str, str]) -> Settings:
    return Settings.from_env({k: v for k, v in env.items() if k.startswith("KILN_")})


async def run(args: argparse.Namespace, run_dir: Path, database_url: str) -> dict[str, Any]:
    results = run_dir / "results"
    for folder in ("logs", "faults", "results"):
        (run_dir / folder).mkdir(parents=True, exist_ok=True)
    env = child_env(args, database_url, results)
    sqlite = database_url.startswith("sqlite:")
    app = kiln.App(settings=settings_of(env).with_(sqlite_submit_process="on" if sqlite else "off"))
    backends.register(app)  # the kinds the workers serve, to validate what is submitted
    transform.register(app)
    comfy_workflow.register(app, url="http://127.0.0.1:9")  # it validates, never runs a job
    rng = random.Random(args.seed)
    async with app:
        await app.engine.store.stats(
            tenant=None, ghost_after_s=60
        )  # the schema exists before they start
        fleet = Fleet(run_dir, env, args)
        chaos = Chaos(fleet, random.Random(rng.random()), args)
        submitter = Submitter(app, random.Random(rng.random()), args.tasks, args.backlog)
        comfy = ComfySubmitter(
            app,
            random.Random(rng.random()),
            args.comfy_jobs,
            args.comfy_failing_share,
            args.comfy_steps,
        )
        comfy_fleet = ComfyFleet(run_dir, env, args.comfy_instances, args.comfy_step_s)
        started = time.monotonic()
        try:
            finished = await run_until_final(
                app, args, fleet, chaos, submitter, (comfy, comfy_fleet)
            )
        finally:
            fleet.stop_all()
            comfy_fleet.stop_all()
        submitter.created |= comfy.made.keys()
        submitter.permanent |= comfy.failing
        run_s = time.monotonic() - started
        checks_started = time.monotonic()
        expected = Expected(
            submitter.created, submitter.permanent, submitter.problems,
            submitter.permanent_steps, submitter.cancelled_pipelines, submitter.by_reference,
        )  # fmt: skip
        snap = await load(app.engine.store)
        integrity = sqlite_integrity(database_url)
        deadlocks = postgres_deadlocks(database_url)
        checks = await check_all(app, expected, integrity=integrity)
        checks += await check_comfy(snap, app.storage, comfy, comfy_fleet)
        check_s = time.monotonic() - checks_started
    faults = count_faults(run_dir / "faults")
    figures = {
        **submitter.figures(),
        "finished_in_time": finished,
        "sqlite": sqlite,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "worker_kills": chaos.kills,
        "worker_pauses": chaos.pauses,
        "supervisor_restarts": chaos.supervisor_restarts,
        "submit_process_kills": chaos.submit_process_kills,
        "submissions_settled": getattr(getattr(app.engine.store, "submitter", None), "settled", 0),
        "processes_started": len(fleet.started),
        "exited_by_themselves": chaos.exited_by_themselves,
        "storage_faults": sum(faults.values()),
        "pg_deadlocks": deadlocks,
        "batched_calls": count_batches(run_dir / "logs"),
        "storage_faults_by_kind": dict(sorted(faults.items())),
        "outcomes": dict(sorted(Counter(str(t.status) for t in snap.tasks.values()).items())),
        **pipeline_figures(snap),
        "tasks_retried": sum(1 for t in snap.tasks.values() if t.attempt > 1),
        "attempts": sum(t.attempt for t in snap.tasks.values()),
        "retries_scheduled": snap.of_event(Event.SCHEDULE_RETRY),
        "expired": snap.of_event(Event.EXPIRE),
        "recovered": snap.of_event(Event.RECOVER),
        "force_cancelled": snap.of_event(Event.FORCE_CANCEL),
        "stopped_by_cancel": snap.of_event(Event.STOPPED),
        "stale_writes": snap.counter("stale_writes"),
        "events": sum(len(log) for log in snap.events.values()),
        "run_s": round(run_s, 1),
        "check_s": round(check_s, 1),
        "tasks_per_s": round(len(snap.tasks) / run_s, 1) if run_s else 0.0,
        **comfy_figures(snap, comfy, comfy_fleet),
    }
    checks.append(chaos_happened(figures))
    return {"figures": figures, "checks": checks}


async def run_until_final(
    app: kiln.App,
    args: argparse.Namespace,
    fleet: Fleet,
    chaos: Chaos,
    submitter: Submitter,
    comfy: tuple[ComfySubmitter, ComfyFleet],
) -> bool:
    """Start the processes, submit, and break things until every task is final; whether
    that happened before the timeout. A failure of the run's own loops is raised."""
    comfy_jobs, comfy_fleet = comfy
    comfy_fleet.start()
    await comfy_fleet.ready(app)
    for _ in range(args.workers):
        fleet.start_worker()
    fleet.start_supervisor()
    comfy_rng = random.Random(chaos.rng.random())
    loops = [
        asyncio.ensure_future(coro)
        for coro in (
            submitter.submit_all(),
            submitter.cancel_running(),
            chaos.kill_workers(),
            chaos.kill_submit_processes(app),
            chaos.pause_workers(),
            chaos.restart_supervisor(app, args.tasks),
            chaos.watch_processes(),
            comfy_jobs.submit_all(
                chaos.done,
                args.comfy_submit_every_s,
                lambda: 1.0 if submitter.finished else len(submitter.created) / args.tasks,
            ),
            comfy_fleet.chaos(comfy_rng, chaos.done, args.comfy_kill_every_s),
            comfy_fleet.watch(chaos.done),
        )
    ]
    try:
        return await until_all_final(app, submitter, loops, args.timeout_s, comfy_jobs)
    finally:
        chaos.done.set()
        submitter.stop()
        await asyncio.gather(*loops)


def sqlite_integrity(database_url: str) -> str | None:
    """SQLite's own ``PRAGMA integrity_check`` of the database file; None on PostgreSQL."""
    if not database_url.startswith("sqlite:///"):
        return None
    with contextlib.closing(sqlite3.connect(database_url.removeprefix("sqlite:///"))) as conn:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    return "; ".join(str(row[0]) for row in rows)


def postgres_deadlocks(database_url: str) -> int | None:
    """Deadlocks PostgreSQL detected in the run's database (each one's transaction is
    rolled back and run again by the store); None on SQLite."""
    if database_url.startswith("sqlite:///"):
        return None
    import psycopg

    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else None


def chaos_happened(figures: dict[str, Any]) -> Check:
    """A run that injected nothing proves nothing: it fails."""
    check = Check("CH", "the chaos happened", 1)
    wanted = {
        "worker_kills": figures["worker_kills"],
        "storage_faults": figures["storage_faults"],
        "cancellations": figures["cancelled_pending"] + figures["cancelled_running"],
        "tasks_retried": figures["tasks_retried"],
        "permanent_failures": figures["permanent"],
        "batched_calls": figures["batched_calls"],
    }
    if figures["sqlite"]:
        wanted["submit_process_kills"] = figures["submit_process_kills"]
    if figures.get("tasks", 0) >= SHARES_FROM:  # too few tasks may draw none of these
        wanted["pipelines"] = figures["pipelines"]
        wanted["inputs_by_reference"] = figures["by_reference"]
    wanted.update(comfy_wanted(figures))
    for name, n in wanted.items():
        if n <= 0:
            check.fail(f"no {name.replace('_', ' ')}")
    if figures["supervisor_restarts"] != 1:
        check.fail(f"{figures['supervisor_restarts']} supervisor restarts, not 1")
    if not figures["finished_in_time"]:
        check.fail("the tasks were not all final before the timeout")
    exited = [*figures["exited_by_themselves"], *figures.get("comfy_exited_by_themselves", [])]
    if exited:
        check.fail(f"processes exited by themselves: {exited}")
    check.note = ", ".join(f"{k} {v}" for k, v in wanted.items())
    return check


def comfy_wanted(figures: dict[str, Any]) -> dict[str, int]:
    """When comfy jobs ran: instances were killed, and (from SHARES_FROM tasks) some jobs
    had a failing node."""
    if not figures.get("comfy_jobs"):
        return {}
    wanted = {"comfy_instance_kills": figures["comfy_instance_kills"]}
    if figures.get("tasks", 0) >= SHARES_FROM:
        wanted["comfy_failing_jobs"] = figures["comfy_failing"]
    return wanted


def pipeline_figures(snap: Snapshot) -> dict[str, Any]:
    """The pipelines' outcomes, their steps' (tasks the store made), and how many steps
    were retried with their pipeline (a ``retry`` event on a step)."""
    pipelines = snap.pipelines()
    steps = [t for t in snap.tasks.values() if t.pipeline_id is not None]
    return {
        "pipeline_outcomes": dict(sorted(Counter(str(p.status) for p in pipelines).items())),
        "pipeline_steps": len(steps),
        "step_outcomes": dict(sorted(Counter(str(t.status) for t in steps).items())),
        "steps_deduplicated": sum(
            1
            for p in pipelines
            for task_id in step_map(p).values()
            if task_id in snap.tasks and snap.tasks[task_id].pipeline_id != p.id
        ),
        "steps_retried_with_pipeline": sum(
            1 for t in steps if any(e.event is Event.RETRY for e in snap.events.get(t.id, []))
        ),
    }


def count_batches(folder: Path) -> int:
    """Calls of a batching worker's handler with more than one task (``batch_call``)."""
    found = 0
    for path in folder.glob("worker-batch-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "batch_call" in line and "size=1 " not in line and '"size": 1,' not in line:
                found += 1
    return found


def count_faults(folder: Path) -> Counter[str]:
    faults: Counter[str] = Counter()
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            faults[line.split(" ", 1)[0]] += 1
    return faults


# Reporting -----------------------------------------------------------------------------------


def report_lines(result: dict[str, Any], args: argparse.Namespace) -> Iterator[str]:
    checks: list[Check] = result["checks"]
    figures = result["figures"]
    yield f"{'':2} {'invariant':58} {'result':6} {'checked':>8} {'violations':>10}"
    for check in checks:
        verdict = "PASS" if check.ok else "FAIL"
        yield (f"{check.key:2} {check.name:58} {verdict:6} {check.checked:8d} "
               f"{len(check.violations):10d}")  # fmt: skip
        if check.note:
            yield f"{'':5}{check.note}"
        for violation in check.violations[:5]:
            yield f"{'':5}! {violation}"
    yield ""
    yield (
        f"tasks {figures['tasks']} ({figures['submissions']} submissions: "
        f"{figures['dedup_hits']} dedup hits, {figures['replays']} key replays, "
        f"{figures['key_reuse_refused']} key reuses refused, {figures['bursts']} bursts)"
    )
    yield f"outcomes {figures['outcomes']}"
    yield (f"workers {figures['workers']} x {figures['concurrency']}; "
           f"{figures['worker_kills']} SIGKILLs, {figures['worker_pauses']} paused past the lease, "
           f"{figures['supervisor_restarts']} supervisor restart; "
           f"{figures['processes_started']} processes started")  # fmt: skip
    if figures["sqlite"]:
        yield (f"submit process SIGKILLs {figures['submit_process_kills']}; submissions it "
               f"held, settled by the App's writer {figures['submissions_settled']}")  # fmt: skip
    yield (f"storage faults {figures['storage_faults']} {figures['storage_faults_by_kind']} "
           f"at rate {args.fault_rate}")  # fmt: skip
    if figures["pg_deadlocks"] is not None:
        yield f"PostgreSQL deadlocks detected (and retried) {figures['pg_deadlocks']}"
    yield (
        f"pipelines {figures['pipelines']} {figures['pipeline_outcomes']} "
        f"({figures['pipelines_cancelled_pending']} cancelled while pending, "
        f"{figures['pipelines_cancelled_running']} while running, "
        f"{figures['pipelines_retried']} retried once ended); steps "
        f"{figures['pipeline_steps']} {figures['step_outcomes']}, "
        f"{figures['steps_retried_with_pipeline']} retried with their pipeline, "
        f"{figures['steps_deduplicated']} done by an earlier task of the same content "
        f"({figures['pipelines_reusing']} pipelines reused a plain task's content)"
    )
    yield f"inputs by reference: {figures['by_reference']} transforms of earlier outputs"
    yield (
        f"comfy jobs {figures['comfy_jobs']} ({figures['comfy_failing']} with a failing node) "
        f"{figures['comfy_outcomes']} on {figures['comfy_instances']} instances: "
        f"{figures['comfy_instance_kills']} instance SIGKILLs, "
        f"{figures['comfy_worker_kills']} of their workers; "
        f"{figures['comfy_attempts']} attempts"
    )
    yield (
        f"cancelled {figures['cancelled_pending']} while pending, "
        f"{figures['cancelled_running']} while running ({figures['cancel_missed']} ended first)"
    )
    yield (f"attempts {figures['attempts']}; tasks retried {figures['tasks_retried']}; "
           f"retries scheduled {figures['retries_scheduled']}; expired {figures['expired']}; "
           f"recovered {figures['recovered']}; force-cancelled {figures['force_cancelled']}; "
           f"stale writes refused {figures['stale_writes']}")  # fmt: skip
    yield (f"run {figures['run_s']} s ({figures['tasks_per_s']} tasks/s), "
           f"checks {figures['check_s']} s, {figures['events']} events")  # fmt: skip


def summary_json(result: dict[str, Any], args: argparse.Namespace, ok: bool) -> dict[str, Any]:
    return {
        "ok": ok,
        **result["figures"],
        "database": args.database_kind,
        "seed": args.seed,
        "fault_rate": args.fault_rate,
        "lease_ttl_s": args.lease_ttl_s,
        "checks": {
            check.key: {"name": check.name, **check.to_json()} for check in result["checks"]
        },
    }


# Main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--tasks", type=int, default=2000, help="distinct tasks to submit (default 2000)")
    add("--workers", type=int, default=3, help="worker processes alive at once (default 3)")
    add("--concurrency", type=int, default=4, help="tasks per worker process (default 4)")
    add("--gpus", type=int, default=2, help="gpu slots per worker process (default 2)")
    add("--fault-rate", type=float, default=0.05, help="share of storage writes that fail (0.05)")
    add("--seed", type=int, default=1, help="seed of the task mix, kills, pauses, faults (1)")
    add("--lease-ttl-s", type=float, default=1.5, help="worker lease, seconds (default 1.5)")
    add("--supervisor-interval-s", type=float, default=0.2, help="sweep period (default 0.2)")
    add("--kill-every-s", type=float, nargs=2, default=(1.0, 4.0), metavar=("MIN", "MAX"),
        help="a worker is SIGKILLed every MIN..MAX seconds (default 1 4)")  # fmt: skip
    add("--pause-every-s", type=float, nargs=2, default=(3.0, 8.0), metavar=("MIN", "MAX"),
        help="a worker is paused past its lease every MIN..MAX seconds (default 3 8)")  # fmt: skip
    add("--backlog", type=int, default=80, help="PENDING tasks kept ahead of the workers (80)")
    add("--timeout-s", type=float, default=None, help="give up waiting after (default N/4+120)")
    add("--postgres", action="store_true", help="run on a throwaway PostgreSQL cluster")
    add("--keep", type=Path, default=None, metavar="DIR",
        help="keep the database, results and logs in DIR (kept anyway on a failure)")  # fmt: skip
    add("--log-level", default="INFO", help="the processes' KILN_LOG_LEVEL (default INFO)")
    add(
        "--comfy-instances",
        type=int,
        default=2,
        help="stand-in ComfyUI instances, each with a comfy.workflow worker (2; 0: none)",
    )
    add(
        "--comfy-share",
        type=float,
        default=0.05,
        help="comfy.workflow jobs, as a share of --tasks (0.05)",
    )
    add(
        "--comfy-failing-share",
        type=float,
        default=0.2,
        help="share of the comfy jobs with a node that raises (0.2)",
    )
    add(
        "--comfy-kill-every-s",
        type=float,
        nargs=2,
        default=(2.0, 5.0),
        metavar=("MIN", "MAX"),
        help="an instance (each 4th time its worker) is SIGKILLed every MIN..MAX s (2 5)",
    )
    add("--comfy-steps", type=int, default=4, help="KSampler steps of a comfy job (4)")
    add("--comfy-step-s", type=float, default=0.02, help="an instance's cost per step (0.02)")
    add(
        "--comfy-submit-every-s",
        type=float,
        default=0.2,
        help="the least time between two comfy jobs (0.2)",
    )
    args = parser.parse_args(argv)
    if args.tasks < 20 or args.workers < 1 or not 0 <= args.fault_rate < 1:
        parser.error("--tasks must be at least 20, --workers at least 1, --fault-rate in [0, 1)")
    args.timeout_s = args.timeout_s or args.tasks / 4 + 120
    args.database_kind = "postgresql" if args.postgres else "sqlite"
    args.comfy_jobs = round(args.tasks * args.comfy_share) if args.comfy_instances > 0 else 0
    return args


@contextlib.contextmanager
def database(args: argparse.Namespace, run_dir: Path) -> Iterator[str]:
    if not args.postgres:
        yield f"sqlite:///{run_dir / 'kiln.db'}"
        return
    from pg_cluster import throwaway_cluster

    with throwaway_cluster(max_connections=300) as cluster:
        yield cluster.create_database("kiln_chaos")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = args.keep or Path(tempfile.mkdtemp(prefix="kiln-chaos-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"chaos run: {args.tasks} tasks, {args.workers} workers x {args.concurrency}, "
          f"fault rate {args.fault_rate}, seed {args.seed}, {args.database_kind}, in {run_dir}",
          flush=True)  # fmt: skip
    with database(args, run_dir) as url:
        result = asyncio.run(run(args, run_dir, url))
    ok = all(check.ok for check in result["checks"])
    for line in report_lines(result, args):
        print(line)
    if ok and args.keep is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"database, results and process logs kept in {run_dir}")
    print(json.dumps(summary_json(result, args, ok)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
