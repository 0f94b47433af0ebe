"""Stopping and starting real `kiln serve` processes without losing work (DESIGN.md, I9).

SIGTERM never fails a task nor counts its attempt: running attempts finish within
KILN_SHUTDOWN_GRACE_S or go back to the queue (``release``) and the next process runs
them. A server that cannot start (a busy port, an unreachable database, a missing extra)
exits 2 with one line and touches no task.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

import kiln
from kiln.models import Task, TaskEvent

from .conftest import Processes, Server, clean_env, free_port, wait_until

pytestmark = pytest.mark.slow

#: A task that generates for about 4 s: long enough to be running when a signal comes.
LONG = {"steps": 40, "step_ms": 100}
#: A task that generates for about 0.5 s: it ends within a grace of a few seconds.
SHORT = {"steps": 5, "step_ms": 100}
PASSWORD = "s3cret-pw"


def params(steps: int, step_ms: int) -> dict[str, Any]:
    return {
        "prompt": f"restart me once {uuid.uuid4().hex[:8]}",
        "width": 64,
        "height": 64,
        "steps": steps,
        "simulate": {"step_ms": step_ms},
    }


def generating(client: kiln.Client, task_id: str) -> bool:
    task = client.get(task_id)
    return task["status"] == "GENERATING" and task["progress"] is not None


def statuses(client: kiln.Client, task_id: str) -> list[dict[str, Any]]:
    return [m for m in client.stream(task_id) if m["type"] == "status"]


def stored(data_dir: Path, task_id: str) -> tuple[Task, list[TaskEvent]]:
    """The task and its event log as the store holds them (read beside the processes)."""

    async def read() -> tuple[Task, list[TaskEvent]]:
        async with kiln.App(settings=kiln.Settings(data_dir=data_dir)) as app:
            task = await app.engine.store.get(task_id)
            assert task is not None
            return task, await app.engine.store.events(task_id=task_id, limit=1000)

    return asyncio.run(read())


def stop_within(server: Server, timeout_s: float) -> int:
    """SIGTERM the server and wait for it to exit; its exit code."""
    os.kill(server.process.pid, signal.SIGTERM)
    return server.process.popen.wait(timeout=timeout_s)


def run_kiln(args: list[str], env: dict[str, str], timeout_s: float = 30) -> tuple[int, str, str]:
    """Run `python -m kiln ARGS` to its end: (exit code, stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


# SIGTERM of kiln serve ---------------------------------------------------------------------


def test_sigterm_lets_a_running_attempt_finish_within_the_grace(
    processes: Processes, tmp_path: Path
) -> None:
    # Given a task on its last attempt, running in `kiln serve` with a 20 s grace
    server = processes.serve(tmp_path / "data", "--workers", "1", KILN_SHUTDOWN_GRACE_S="20")
    with kiln.Client(server.url) as client:
        task = client.submit(params=params(**SHORT), max_attempts=1)
        wait_until(lambda: generating(client, task["id"]), 20, "GENERATING")

        # When the server is stopped with SIGTERM
        exit_code = stop_within(server, 30)

    # Then it exited 0 after the attempt ended: SUCCESS on attempt 1 of 1, nothing given back
    assert exit_code == 0
    done, events = stored(tmp_path / "data", task["id"])
    assert (done.status, done.attempt, done.max_attempts) == ("SUCCESS", 1, 1)
    assert [e.event for e in events][-1] == "uploaded"
    assert "release" not in [e.event for e in events]


def test_an_attempt_running_when_the_grace_ends_is_given_back_and_finished_by_the_next_server(
    processes: Processes, tmp_path: Path
) -> None:
    # Given a task on its last attempt, generating in `kiln serve` with a short grace
    server = processes.serve(tmp_path / "data", "--workers", "1", KILN_SHUTDOWN_GRACE_S="0.2")
    with kiln.Client(server.url) as client:
        task = client.submit(params=params(**LONG), max_attempts=1)
        wait_until(lambda: generating(client, task["id"]), 20, "GENERATING")

        # When the server is stopped with SIGTERM before the attempt can end
        exit_code = stop_within(server, 30)
    assert exit_code == 0

    # Then the task is back in the queue, uncounted: PENDING, attempt 0, a release event
    back, log = stored(tmp_path / "data", task["id"])
    assert (back.status, back.attempt, back.max_attempts) == ("PENDING", 0, 1)
    assert back.error is None
    assert [e.event for e in log] == ["submit", "claim", "acquire", "release"]
    assert (log[-1].from_status, log[-1].attempt) == ("GENERATING", 0)

    # And the next `kiln serve` finishes it on attempt 1 of 1
    again = processes.serve(tmp_path / "data", "--workers", "1")
    with kiln.Client(again.url) as client:
        done = client.wait(task["id"], timeout_s=60)
        events = statuses(client, task["id"])
    assert (done["status"], done["attempt"], done["max_attempts"]) == ("SUCCESS", 1, 1)
    assert all(e["attempt"] <= 1 for e in events)
    assert not any(e["status"] in ("FAILED", "TIMEOUT") for e in events)


def test_every_answered_submission_survives_a_sigterm_during_a_burst(
    processes: Processes, tmp_path: Path
) -> None:
    # Given a burst of submissions from four clients
    server = processes.serve(tmp_path / "data", "--workers", "2", KILN_SHUTDOWN_GRACE_S="5")
    answered: list[str] = []
    stop = threading.Event()

    def submit_until_refused() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            while not stop.is_set():
                body = {"kind": "image.generate", "params": params(steps=2, step_ms=5)}
                try:
                    response = http.post("/v1/tasks", json=body)
                except httpx.TransportError:
                    return  # the server stopped listening
                if response.status_code == 201:
                    answered.append(response.json()["id"])

    clients = [threading.Thread(target=submit_until_refused) for _ in range(4)]
    for thread in clients:
        thread.start()
    try:
        wait_until(lambda: len(answered) >= 20, 30, "20 answered submissions")
        # When the server gets SIGTERM in the middle of it
        exit_code = stop_within(server, 30)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=30)

    # Then every submission that was answered 201 is in the store afterwards, none failed
    assert exit_code == 0
    assert len(answered) >= 20
    for task_id in answered:
        task, _ = stored(tmp_path / "data", task_id)
        assert task.status not in ("FAILED", "TIMEOUT")
        assert task.attempt <= task.max_attempts


def test_a_second_sigterm_stops_the_server_at_once(processes: Processes, tmp_path: Path) -> None:
    # Given a server draining with a long grace while an attempt runs
    server = processes.serve(tmp_path / "data", "--workers", "1", KILN_SHUTDOWN_GRACE_S="60")
    with kiln.Client(server.url) as client:
        task = client.submit(params=params(steps=100, step_ms=100), max_attempts=1)
        wait_until(lambda: generating(client, task["id"]), 20, "GENERATING")
    os.kill(server.process.pid, signal.SIGTERM)
    wait_until(lambda: "worker_draining" in server.process.output(), 10, "the drain")

    # When it gets a second SIGTERM
    started = time.monotonic()
    os.kill(server.process.pid, signal.SIGTERM)
    server.process.popen.wait(timeout=30)

    # Then it stopped well before the grace, and the task went back uncounted
    assert time.monotonic() - started < 15
    back, log = stored(tmp_path / "data", task["id"])
    assert (back.status, back.attempt) == ("PENDING", 0)
    assert log[-1].event == "release"
    # And it ended its lifespan too: no traceback of a cancelled one
    assert "Traceback" not in server.process.output()
    assert "Application shutdown complete" in server.process.output()


def test_sigterm_closes_an_open_stream_with_a_reconnect_hint(
    processes: Processes, tmp_path: Path
) -> None:
    server = processes.serve(tmp_path / "data", "--workers", "1", KILN_SHUTDOWN_GRACE_S="0.2")
    with kiln.Client(server.url) as client:
        task = client.submit(params=params(**LONG))
    lines: list[str] = []
    with httpx.stream("GET", f"{server.url}/v1/tasks/{task['id']}/events", timeout=20) as stream:
        for line in stream.iter_lines():
            lines.append(line)
            if line == "event: status" and lines.count(line) == 1:
                os.kill(server.process.pid, signal.SIGTERM)  # once: a second would halt

    assert server.process.popen.wait(timeout=30) == 0
    assert "retry: 1000" in lines


# safe startup ---------------------------------------------------------------------------


def test_a_second_server_on_a_busy_port_exits_2_and_touches_no_task(
    processes: Processes, tmp_path: Path
) -> None:
    # Given a server without workers holding a port, and a task waiting in its queue
    first = processes.serve(tmp_path / "data", "--no-workers", "--no-supervisor")
    with kiln.Client(first.url) as client:
        task = client.submit(params=params(**SHORT))
    port = first.url.rsplit(":", 1)[1]

    # When a second server with workers starts on the same port and the same data
    code, out, err = run_kiln(
        ["serve", "--port", port, "--data-dir", str(tmp_path / "data"), "--workers", "2"],
        first.env,
    )

    # Then it exits 2 with one line, and claimed nothing
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kiln: ")
    assert f"127.0.0.1:{port} is already in use" in err
    assert "Traceback" not in out + err
    after, log = stored(tmp_path / "data", task["id"])
    assert (after.status, after.attempt) == ("PENDING", 0)
    assert [e.event for e in log] == ["submit"]


@pytest.fixture
def without_psycopg(tmp_path: Path) -> dict[str, str]:
    """An environment where `import psycopg` fails, as without `kiln[postgres]`."""
    stub = tmp_path / "no-psycopg" / "psycopg"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('psycopg is not installed here')\n")
    kiln_root = Path(kiln.__file__).resolve().parents[1]  # where this kiln imports from
    paths = [str(stub.parent), str(kiln_root), os.environ.get("PYTHONPATH", "")]
    return clean_env(PYTHONPATH=os.pathsep.join(filter(None, paths)))


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["worker"], ["supervisor"]])
def test_a_missing_extra_exits_2_with_one_line(
    command: list[str], without_psycopg: dict[str, str], tmp_path: Path
) -> None:
    url = f"postgresql://kiln:{PASSWORD}@127.0.0.1:{free_port()}/kiln"

    code, out, err = run_kiln([*command, "--database-url", url], without_psycopg)

    assert code == 2
    assert err == "kiln: PostgreSQL support is not installed: pip install 'kiln[postgres]'\n"
    assert PASSWORD not in out + err


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["worker"], ["supervisor"]])
def test_an_unreachable_database_exits_2_in_bounded_time_without_its_password(
    command: list[str], tmp_path: Path
) -> None:
    # Given a PostgreSQL URL on a closed port
    url = f"postgresql://kiln:{PASSWORD}@127.0.0.1:{free_port()}/kiln"
    env = clean_env(KILN_STARTUP_TIMEOUT_S="1", KILN_DATA_DIR=str(tmp_path / "data"))

    # When a process starts on it
    started = time.monotonic()
    code, out, err = run_kiln([*command, "--database-url", url], env)

    # Then it gives up after the startup timeout with one line naming the database
    assert code == 2
    assert time.monotonic() - started < 20
    assert err.count("\n") == 1
    assert err.startswith("kiln: cannot reach the database at postgresql://kiln:***@127.0.0.1:")
    assert "KILN_DATABASE_URL" in err
    assert PASSWORD not in out + err
    assert "Traceback" not in out + err


def test_an_unreachable_storage_exits_2_in_bounded_time(tmp_path: Path) -> None:
    # Given an S3 URL whose server does not answer
    url = f"s3://kiln/prefix?endpoint_url=http://127.0.0.1:{free_port()}"
    env = clean_env(
        KILN_STARTUP_TIMEOUT_S="1", AWS_ACCESS_KEY_ID="kiln", AWS_SECRET_ACCESS_KEY=PASSWORD
    )

    # When `kiln serve` starts on it
    started = time.monotonic()
    code, out, err = run_kiln(
        ["serve", "--port", "0", "--data-dir", str(tmp_path), "--storage-url", url], env
    )

    # Then it gives up with one line naming the storage
    assert code == 2
    assert time.monotonic() - started < 20
    assert err.count("\n") == 1
    assert err.startswith(f"kiln: cannot reach the storage at {url} within 1 s (")
    assert err.endswith("): check KILN_STORAGE_URL and that it is up\n")
    assert PASSWORD not in out + err


def test_sigterm_while_waiting_for_the_database_stops_at_once(
    processes: Processes, tmp_path: Path
) -> None:
    # Given a server waiting (up to a minute) for a database that does not answer
    url = f"postgresql://kiln:{PASSWORD}@127.0.0.1:{free_port()}/kiln"
    env = clean_env(KILN_STARTUP_TIMEOUT_S="60", KILN_LOG_LEVEL="DEBUG")
    process = processes.start(
        "serve", ["serve", "--port", "0", "--database-url", url, "--data-dir", str(tmp_path)], env
    )
    wait_until(lambda: "startup_waiting" in process.output(), 20, "the startup wait")

    # When it gets SIGTERM
    started = time.monotonic()
    os.kill(process.pid, signal.SIGTERM)

    # Then it exits at once, and never printed the password
    assert process.popen.wait(timeout=10) == 0
    assert time.monotonic() - started < 5
    assert PASSWORD not in process.output()


def test_sigterm_closes_an_open_websocket_with_service_restart(
    processes: Processes, tmp_path: Path
) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server = processes.serve(tmp_path / "data", "--workers", "1", KILN_SHUTDOWN_GRACE_S="0.2")
    with kiln.Client(server.url) as client:
        task = client.submit(params=params(**LONG))
    url = server.url.replace("http://", "ws://") + f"/v1/tasks/{task['id']}/ws"
    with connect(url) as socket, pytest.raises(ConnectionClosed) as closed:
        socket.recv(timeout=20)
        os.kill(server.process.pid, signal.SIGTERM)
        while True:
            socket.recv(timeout=20)

    assert server.process.popen.wait(timeout=30) == 0
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1012


@pytest.mark.parametrize(
    ("url", "error", "shown"),
    [
        ("postgresql://kiln:s3cret@db/kiln", "auth failed for s3cret\nhint", "auth failed for ***"),
        ("postgresql://kiln:p%40ss@db/kiln", "bad p@ss and p%40ss", "bad *** and ***"),
        ("sqlite:///kiln.db", "  disk   I/O error  ", "disk I/O error"),
    ],
)
def test_a_startup_error_is_one_line_without_the_password(url: str, error: str, shown: str) -> None:
    from kiln.cli.processes import _hidden, _one_line

    assert _one_line(RuntimeError(error), url) == shown
    assert _one_line(TimeoutError(), url) == "no answer"
    assert "s3cret" not in _hidden(url) and "p%40ss" not in _hidden(url)
