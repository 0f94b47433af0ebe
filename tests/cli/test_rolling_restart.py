"""A rolling restart of every worker and of the supervisor under a stream of tasks loses
nothing and counts nothing: each task ends SUCCESS on its first attempt (DESIGN.md, I9).

`kiln serve --no-workers --no-supervisor` takes the submissions; two `kiln worker`
processes and one `kiln supervisor` share its SQLite database. Each is stopped with
SIGTERM in turn, and a new one started in its place once the old one exited.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path

import httpx
import pytest

import kiln
from kiln.models import Task, TaskEvent

from .conftest import Process, Processes, Server, free_port, wait_until

pytestmark = pytest.mark.slow

TASKS = 50
#: Workers and supervisors of this test: short grace, so a restart takes about a second.
ENV = {"KILN_SHUTDOWN_GRACE_S": "1", "KILN_LEASE_TTL_S": "5"}


def start(processes: Processes, api: Server, command: str, *args: str) -> Process:
    """A worker or supervisor on the API's data, ready once its metrics answer."""
    port = free_port()
    process = processes.start(
        command,
        [command, "--data-dir", str(api.data_dir), "--metrics-port", str(port), *args],
        {**api.env, **ENV},
    )
    wait_until(lambda: _answers(port, process), 30, f"kiln {command} to start")
    return process


def _answers(port: int, process: Process) -> bool:
    assert process.alive(), process.output()
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def restart(processes: Processes, api: Server, old: Process, *args: str) -> Process:
    """SIGTERM ``old``, wait for it to exit 0, then start its successor."""
    assert processes.stop(old, timeout_s=30) == 0, old.output()
    return start(processes, api, old.name, *args)


def final_log(data_dir: Path, ids: list[str]) -> dict[str, tuple[Task, list[TaskEvent]]]:
    async def read() -> dict[str, tuple[Task, list[TaskEvent]]]:
        found = {}
        async with kiln.App(settings=kiln.Settings(data_dir=data_dir)) as app:
            for task_id in ids:
                task = await app.engine.store.get(task_id)
                assert task is not None
                found[task_id] = (task, await app.engine.store.events(task_id=task_id, limit=1000))
        return found

    return asyncio.run(read())


def test_rolling_restart_of_every_worker_and_the_supervisor_loses_and_counts_nothing(
    processes: Processes, tmp_path: Path
) -> None:
    api = processes.serve(tmp_path / "data", "--no-workers", "--no-supervisor")
    workers = [start(processes, api, "worker", "--concurrency", "2") for _ in range(2)]
    supervisor = start(processes, api, "supervisor")
    submitted: list[str] = []
    pace = threading.Event()  # never set: its waits space the submissions out

    def submit_a_stream() -> None:
        with kiln.Client(api.url) as client:
            for n in range(TASKS):
                body = {"prompt": f"rolling {n} {uuid.uuid4().hex[:6]}", "width": 64,
                        "height": 64, "steps": 8, "simulate": {"step_ms": 60}}  # fmt: skip
                submitted.append(client.submit(params=body, max_attempts=1)["id"])
                pace.wait(0.08)  # a stream, not a burst: tasks keep arriving during restarts

    stream = threading.Thread(target=submit_a_stream)
    stream.start()
    try:
        # Given tasks running on both workers
        wait_until(lambda: len(submitted) >= 10, 30, "the first tasks")
        # When every worker, then the supervisor, is restarted one at a time
        for n, old in enumerate(list(workers)):
            workers[n] = restart(processes, api, old, "--concurrency", "2")
        supervisor = restart(processes, api, supervisor)
    finally:
        stream.join(timeout=60)
    assert len(submitted) == TASKS

    # Then every task ends SUCCESS on its first attempt, and none timed out or failed
    with kiln.Client(api.url) as client:
        for task_id in submitted:
            client.wait(task_id, timeout_s=60)
    tasks = final_log(api.data_dir, submitted)
    for task, events in tasks.values():
        assert (task.status, task.attempt, task.max_attempts) == ("SUCCESS", 1, 1), events
        assert not [e for e in events if e.event in ("fail", "expire", "deadline")]
        assert all(e.attempt <= 1 for e in events)
    released = sum(1 for _, events in tasks.values() for e in events if e.event == "release")
    print(f"{released} attempts given back during the restarts")
