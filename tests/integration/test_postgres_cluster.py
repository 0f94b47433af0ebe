"""A kiln deployment on one PostgreSQL database, as real `kiln` processes.

Two API nodes, three workers and two supervisors share one database and one results
folder; the leading supervisor and a worker in the middle of a task are killed with
SIGKILL while 300 tasks run. Then a single `kiln serve` and worker ride out the database
itself going away: a fast restart, and an outage longer than a lease. Every task must end
SUCCESS exactly once, its event log must replay to its status, and its outputs must verify
in storage.

State is read straight from the database (psycopg) and checked with the engine's own
store and storage. No fixed sleep stands in for synchronisation: every wait polls a
condition with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

import kiln
from cli.conftest import Process, Processes, clean_env, free_port, wait_until
from kiln.config import Settings
from kiln.models import StoredOutput, Task
from kiln.states import FINAL, Event, Status, replay
from kiln.storage import verify
from services.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(300)]

LEASE_TTL_S = 2.0
SUPERVISOR_INTERVAL_S = 0.2
FINAL_SQL = "(" + ", ".join(f"'{s}'" for s in sorted(FINAL)) + ")"


# Processes --------------------------------------------------------------------------------


@dataclass
class Cluster:
    """kiln processes on one database and one results folder, each stopped by PID."""

    processes: Processes
    database_url: str
    results: Path
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.env = clean_env(
            KILN_DATABASE_URL=self.database_url,
            KILN_STORAGE_URL=self.results.as_uri(),
            KILN_LEASE_TTL_S=str(LEASE_TTL_S),
            KILN_SUPERVISOR_INTERVAL_S=str(SUPERVISOR_INTERVAL_S),
            KILN_RETRY_BASE_S="0.05",
            KILN_RETRY_MAX_S="0.2",
        )

    @property
    def data_dir(self) -> Path:
        return self.processes.root / "data"

    def serve(self, *args: str) -> tuple[Process, str]:
        """Start `kiln serve` on a free port; its URL (not waited for: see ``healthy``)."""
        port = free_port()
        process = self.processes.start(
            "serve", ["serve", "--port", str(port), "--data-dir", str(self.data_dir), *args],
            self.env,
        )  # fmt: skip
        return process, f"http://127.0.0.1:{port}"

    def worker(self, *args: str) -> Process:
        return self.processes.start(
            "worker", ["worker", "--data-dir", str(self.data_dir), *args], self.env
        )

    def supervisor(self) -> Process:
        return self.processes.start(
            "supervisor", ["supervisor", "--data-dir", str(self.data_dir)], self.env
        )

    def healthy(self, url: str, process: Process) -> bool:
        assert process.alive(), f"{process.name} exited:\n{process.output()[-4000:]}"
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop_all(self, timeout_s: float = 15) -> None:
        """SIGTERM to every process at once, then SIGKILL to any still running."""
        started = self.processes.started
        for process in started:
            if process.alive():
                os.kill(process.pid, signal.SIGTERM)
                os.kill(process.pid, signal.SIGCONT)  # in case a test left it frozen
        deadline = time.monotonic() + timeout_s
        for process in started:
            try:
                process.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.popen.wait(timeout=timeout_s)

    def logs(self) -> str:
        parts = []
        for process in self.processes.started:
            parts.append(
                f"--- {process.log.name} (pid {process.pid}, exit {process.popen.returncode})\n"
                + process.output()[-6000:]
            )
        return "\n".join(parts)


@pytest.fixture
def cluster(postgres_server: PostgresServer, tmp_path: Path) -> Iterator[Cluster]:
    """A fresh database; every process started is stopped at teardown and its log shown
    (pytest prints a test's captured teardown output when it fails)."""
    started = Cluster(Processes(tmp_path), postgres_server.new_database(), tmp_path / "results")
    try:
        yield started
    finally:
        started.stop_all()
        sys.stderr.write(started.logs())


def assert_alive(*processes: Process) -> None:
    for process in processes:
        assert process.alive(), f"{process.name} {process.pid} exited:\n{process.output()}"


def owner_pid(owner: str) -> int:
    """The pid in a worker's or supervisor's id, ``host:pid:suffix``."""
    return int(owner.rsplit(":", 2)[1])


# The database, read directly ----------------------------------------------------------------


def worker_metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def query(database_url: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(sql, args).fetchall()


def leader(database_url: str) -> tuple[str, int] | None:
    rows = query(database_url, "SELECT owner, epoch FROM leaders WHERE name = 'supervisor'")
    return (rows[0][0], rows[0][1]) if rows else None


def final_count(database_url: str) -> int:
    try:
        rows = query(database_url, f"SELECT count(*) FROM tasks WHERE status IN {FINAL_SQL}")
    except psycopg.OperationalError:
        return -1  # the database is restarting
    return int(rows[0][0])


def status_counts(database_url: str) -> dict[str, int]:
    rows = query(database_url, "SELECT status, count(*) FROM tasks GROUP BY status")
    return {status: int(n) for status, n in rows}


def wait_all_final(cluster: Cluster, total: int, timeout_s: float, *alive: Process) -> None:
    def done() -> bool:
        assert_alive(*alive)
        return final_count(cluster.database_url) == total

    try:
        wait_until(done, timeout_s, f"all {total} tasks final")
    except pytest.fail.Exception:
        pytest.fail(f"not all final: {status_counts(cluster.database_url)}")


# Submitting and streaming ------------------------------------------------------------------


def demo_params(n: int, *, steps: int, step_ms: int) -> dict[str, Any]:
    return {
        "prompt": f"a kiln cluster, picture {n}",
        "width": 64,
        "height": 64,
        "steps": steps,
        "simulate": {"step_ms": step_ms},
    }


def submit(client: httpx.Client, params: dict[str, Any]) -> str:
    response = client.post("/v1/tasks", json={"kind": "image.generate", "params": params})
    assert response.status_code == 201, response.text
    task_id: str = response.json()["id"]
    return task_id


class EventStream(threading.Thread):
    """One SSE connection (no reconnects), parsed into ``(event, id, data)`` messages."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.status_code: int | None = None
        self.messages: list[tuple[str, str | None, dict[str, Any]]] = []
        self.error: BaseException | None = None
        self.opened = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url, timeout=httpx.Timeout(60, connect=5)) as response:
                self.status_code = response.status_code
                self.opened.set()
                self._read(response.iter_lines())
        except BaseException as exc:  # reported by the test that reads the stream
            self.error = exc
        finally:
            self.opened.set()

    def _read(self, lines: Iterator[str]) -> None:
        event, event_id, data = "message", None, ""
        for line in lines:
            if line == "":
                if data:
                    self.messages.append((event, event_id, json.loads(data)))
                event, event_id, data = "message", None, ""
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()

    @property
    def status_events(self) -> list[dict[str, Any]]:
        return [data for event, _, data in self.messages if event == "status"]


# Checking the outcome -----------------------------------------------------------------------


@dataclass
class Outcome:
    task: Task
    events: list[kiln.TaskEvent]
    objects: list[str]


async def read_outcomes(cluster: Cluster, task_ids: list[str]) -> dict[str, Outcome]:
    """Each task and its event log, through kiln's store; every output verified."""
    settings = Settings(
        data_dir=cluster.data_dir,
        database_url=cluster.database_url,
        storage_url=cluster.results.as_uri(),
        db_pool_size=2,
    )
    outcomes = {}
    async with kiln.App(settings=settings) as app:
        for task_id in task_ids:
            task = await app.engine.store.get(task_id)
            assert task is not None, f"task {task_id} was lost"
            events = await app.engine.store.events(task_id=task_id, limit=10_000)
            objects = [info.key async for info in app.storage.list(f"tasks/{task_id}/")]
            outcomes[task_id] = Outcome(task, events, objects)
            if task.status is Status.SUCCESS:
                assert task.result is not None
                outputs = [StoredOutput.from_json(o) for o in task.result["outputs"]]
                assert outputs, task_id
                for output in outputs:
                    assert await verify(app.storage, output), (task_id, output)
    return outcomes


def assert_succeeded_exactly_once(outcome: Outcome) -> None:
    """I1, I6, I7: one final event (the last), SUCCESS once, the log replays to the status."""
    task, events = outcome.task, outcome.events
    history = [f"{e.event}:{e.status}" for e in events]
    assert task.status is Status.SUCCESS, (task.id, task.error, history)
    assert replay((e.event, e.from_status, e.status) for e in events) is task.status, history
    assert [e for e in events if e.final] == [events[-1]], history
    assert len([e for e in events if e.status is Status.SUCCESS]) == 1, history
    assert len({e.id for e in events}) == len(events)
    assert 1 <= task.attempt <= task.max_attempts, (task.id, task.attempt, history)


# 1. Two API nodes, three workers, two supervisors -------------------------------------------


def kill_worker_while_generating(
    cluster: Cluster, workers: list[Process]
) -> tuple[Process, list[tuple[str, int]]]:
    """SIGKILL a worker process that holds a task in GENERATING.

    The worker is frozen (SIGSTOP) before its tasks are read, so what it holds cannot move
    on between the read and the kill; a worker found holding no GENERATING task is thawed.
    Returns the victim and its GENERATING tasks as (task id, attempt).
    """
    by_pid = {w.pid: w for w in workers}

    def victim() -> tuple[Process, list[tuple[str, int]]] | None:
        sql = "SELECT DISTINCT lease_owner FROM tasks WHERE status = 'GENERATING'"
        rows = query(cluster.database_url, sql)
        for (owner,) in rows:
            process = by_pid.get(owner_pid(owner))
            if process is None or not process.alive():
                continue
            os.kill(process.pid, signal.SIGSTOP)
            held = query(
                cluster.database_url,
                "SELECT id, attempt FROM tasks WHERE status = 'GENERATING' AND lease_owner = %s",
                (owner,),
            )
            if held:
                cluster.processes.kill(process)
                return process, [(task_id, attempt) for task_id, attempt in held]
            os.kill(process.pid, signal.SIGCONT)
        return None

    found = wait_until(victim, 30, "a worker holding a GENERATING task")
    assert isinstance(found, tuple)
    return found


def test_two_api_nodes_three_workers_two_supervisors_survive_a_killed_leader_and_worker(
    cluster: Cluster,
) -> None:
    # Given two supervisors, one of which leads, ...
    supervisors = [cluster.supervisor() for _ in range(2)]
    supervisor_pids = {s.pid for s in supervisors}

    def supervisor_leads() -> tuple[str, int] | None:
        assert_alive(*supervisors)
        row = leader(cluster.database_url)
        return row if row is not None and owner_pid(row[0]) in supervisor_pids else None

    first = wait_until(supervisor_leads, 30, "a supervisor leading")
    assert isinstance(first, tuple)
    first_owner, first_epoch = first
    # ... two API nodes (no supervisor of their own) and three workers
    nodes = [cluster.serve("--no-workers", "--no-supervisor") for _ in range(2)]
    workers = [cluster.worker("--concurrency", "2", "--gpus", "2") for _ in range(3)]
    (node1, url1), (node2, url2) = nodes
    wait_until(lambda: cluster.healthy(url1, node1) and cluster.healthy(url2, node2), 30,
               "both API nodes healthy")  # fmt: skip

    # When 300 tasks are submitted round-robin through both API nodes, with node 1
    # streaming the events of a task submitted through node 2
    total = 300
    with (
        httpx.Client(base_url=url1, timeout=10) as api1,
        httpx.Client(base_url=url2, timeout=10) as api2,
    ):
        watched = submit(api2, demo_params(0, steps=3, step_ms=30))
        stream = EventStream(f"{url1}/v1/tasks/{watched}/events")
        stream.start()
        assert stream.opened.wait(10), "the event stream did not open"
        task_ids = [watched]
        for n in range(1, total):
            task_ids.append(submit((api1, api2)[n % 2], demo_params(n, steps=3, step_ms=30)))

    # ... and, mid-run, the leading supervisor and a worker holding a GENERATING task are
    # killed with SIGKILL
    old_leader = next(s for s in supervisors if s.pid == owner_pid(first_owner))
    survivor = next(s for s in supervisors if s is not old_leader)
    cluster.processes.kill(old_leader)
    victim, killed_tasks = kill_worker_while_generating(cluster, workers)
    unfinished_at_kill = total - final_count(cluster.database_url)

    alive = [survivor, node1, node2, *(w for w in workers if w is not victim)]
    wait_all_final(cluster, total, 150, *alive)
    stream.join(timeout=30)

    # Then the other supervisor took the lead with a higher epoch
    new_owner, new_epoch = leader(cluster.database_url) or ("", 0)
    assert new_owner != first_owner
    assert new_epoch > first_epoch
    assert owner_pid(new_owner) == survivor.pid
    assert unfinished_at_kill > 0, "the run ended before the kills: nothing was tested"

    # ... every task ended SUCCESS exactly once, with a log that replays to it, in at most
    # max_attempts attempts, and with outputs that verify in storage
    outcomes = asyncio.run(read_outcomes(cluster, task_ids))
    assert len(outcomes) == total
    for outcome in outcomes.values():
        assert_succeeded_exactly_once(outcome)

    # ... the killed worker's GENERATING attempts expired after the lease lapsed, and the
    # next attempt alone produced the stored outputs
    for task_id, attempt in killed_tasks:
        outcome = outcomes[task_id]
        ended = [e for e in outcome.events if e.attempt == attempt and e.event is Event.EXPIRE]
        assert [e.from_status for e in ended] == [Status.GENERATING], outcome.events
        assert ended[0].error is not None and ended[0].error["code"] == "lease_expired"
        assert outcome.task.attempt == attempt + 1
        prefix = f"{outcome.task.result_prefix}/"
        assert outcome.objects and all(k.startswith(prefix) for k in outcome.objects)

    # ... and node 1 streamed the task submitted through node 2 through its SUCCESS, once
    assert not stream.is_alive(), "the stream did not end after the task's final event"
    assert stream.error is None, repr(stream.error)
    assert stream.status_code == 200
    streamed = stream.status_events
    logged = outcomes[watched].events
    assert [(m["seq"], m["event"], m["status"]) for m in streamed] == [
        (e.seq, str(e.event), str(e.status)) for e in logged
    ]
    assert streamed[-1]["status"] == "SUCCESS" and streamed[-1]["final"] is True
    assert [m["status"] for m in streamed].count("SUCCESS") == 1


# 2. The database restarts while tasks run ---------------------------------------------------


class Poller(threading.Thread):
    """GETs one task over and over until stopped, recording when each request was sent
    and its answer's status code (or the transport error)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.answers: list[tuple[float, int | str]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stopping.is_set():
                sent_at = time.monotonic()
                try:
                    code: int | str = client.get(self.url).status_code
                except httpx.TransportError as exc:
                    code = type(exc).__name__
                self.answers.append((sent_at, code))
                self.stopping.wait(0.05)

    @property
    def codes(self) -> set[int | str]:
        return {code for _, code in self.answers}

    def answered_ok_since(self, moment: float) -> bool:
        return any(sent_at > moment and code == 200 for sent_at, code in self.answers)


def restart_fast(postgres_server: PostgresServer) -> None:
    """pg_ctl restart -m fast: every connection dropped, back within about a second."""
    postgres_server.restart()


def restart_after_the_leases_lapse(postgres_server: PostgresServer) -> None:
    """Down for longer than a lease: the running tasks' leases lapse while nobody can
    renew them, and the supervisor meets them expired when the database is back."""
    postgres_server.stop()
    down_since = time.time()
    wait_until(lambda: time.time() > down_since + LEASE_TTL_S + SUPERVISOR_INTERVAL_S, 30,
               "the leases to lapse during the outage")  # fmt: skip
    postgres_server.start()


@pytest.mark.parametrize("outage", [restart_fast, restart_after_the_leases_lapse])
def test_tasks_running_through_a_database_restart_all_succeed_once(
    cluster: Cluster, postgres_server: PostgresServer, outage: Callable[[PostgresServer], None]
) -> None:
    # Given one API node and one worker process, running 40 tasks
    server, url = cluster.serve("--no-workers")
    metrics_port = free_port()
    worker = cluster.worker(
        "--concurrency", "2", "--gpus", "2", "--metrics-port", str(metrics_port)
    )
    wait_until(lambda: cluster.healthy(url, server), 30, f"kiln serve on {url}")
    total = 40
    with httpx.Client(base_url=url, timeout=10) as api:
        task_ids = [submit(api, demo_params(n, steps=8, step_ms=25)) for n in range(total)]

    def generating() -> bool:
        assert_alive(server, worker)
        return status_counts(cluster.database_url).get("GENERATING", 0) > 0

    wait_until(generating, 30, "a task GENERATING")

    # When PostgreSQL goes down and comes back mid-run, while a client polls the API
    poller = Poller(f"{url}/v1/tasks/{task_ids[-1]}")
    poller.start()
    try:
        outage(postgres_server)
        back_at = time.monotonic()
        unfinished_after_outage = total - final_count(cluster.database_url)

        # Then the API answers again (at worst 503 while the database was away), ...
        wait_until(lambda: poller.answered_ok_since(back_at), 30, "the API answering again")
    finally:
        poller.stopping.set()
        poller.join(timeout=15)
    assert unfinished_after_outage > 0, "the run ended before the outage: nothing was tested"
    assert poller.codes <= {200, 503}, poller.answers

    # ... and every task ends SUCCESS exactly once, with no action from outside
    wait_all_final(cluster, total, 120, server, worker)
    outcomes = asyncio.run(read_outcomes(cluster, task_ids))
    assert len(outcomes) == total
    for outcome in outcomes.values():
        assert_succeeded_exactly_once(outcome)
    with httpx.Client(base_url=url, timeout=10) as api:
        for task_id in task_ids:
            response = api.get(f"/v1/tasks/{task_id}")
            assert response.status_code == 200, response.text
            assert response.json()["status"] == "SUCCESS"
    assert_alive(server, worker)

    # ... and the worker got every slot back: each claimed attempt ended in the worker too
    claims = query(cluster.database_url, "SELECT COUNT(*) FROM events WHERE event = 'claim'")[0][0]

    def slots_back() -> bool:
        samples = worker_metrics(metrics_port)
        return samples.get("kiln_worker_attempts_running") == 0.0 and samples.get(
            "kiln_worker_attempts_completed_total"
        ) == float(claims)

    wait_until(slots_back, 30, f"the worker to end all {claims} attempts it claimed")
