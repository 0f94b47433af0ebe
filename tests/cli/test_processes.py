"""`kiln serve --no-workers` with separate `kiln worker` and `kiln supervisor` processes:
work done across processes, a graceful stop, and recovery from a worker killed by SIGKILL."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

import kiln

from .conftest import Process, Processes, Server, free_port, wait_until


@pytest.fixture(scope="module")
def api_only(module_processes: Processes) -> Server:
    """API and supervisor only; 1 s leases swept every 0.1 s."""
    return module_processes.serve(
        module_processes.root / "shared-data", "--no-workers", KILN_LEASE_TTL_S="1"
    )


def params(steps: int, step_ms: int, **simulate: Any) -> dict[str, Any]:
    return {
        "prompt": f"a red fox {uuid.uuid4().hex[:8]}",
        "width": 64,
        "height": 64,
        "steps": steps,
        "simulate": {"step_ms": step_ms, **simulate},
    }


def status_events(client: kiln.Client, task_id: str) -> list[dict[str, Any]]:
    return [m for m in client.stream(task_id) if m["type"] == "status"]


def generating_with_progress(client: kiln.Client, task_id: str) -> bool:
    task = client.get(task_id)
    return task["status"] == "GENERATING" and task["progress"] is not None


def metrics(port: int, process: Process) -> str:
    assert process.alive(), process.output()
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
    except httpx.TransportError:
        return ""
    return response.text if response.status_code == 200 else ""


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_separate_worker_and_supervisor_processes_run_a_task_and_serve_metrics(
    api_only: Server, processes: Processes
) -> None:
    worker_port, supervisor_port = free_port(), free_port()
    with kiln.Client(api_only.url) as client:
        task = client.submit(params=params(steps=3, step_ms=5))
        queued = client.get(task["id"])
        worker = processes.worker(
            api_only, "--concurrency", "1", "--metrics-port", str(worker_port)
        )
        supervisor = processes.start(
            "supervisor",
            ["supervisor", "--data-dir", str(api_only.data_dir),
             "--metrics-port", str(supervisor_port)],
            api_only.env,
        )  # fmt: skip
        done = client.wait(task["id"], timeout_s=30)
    worker_metrics = str(wait_until(lambda: metrics(worker_port, worker), 10, "worker metrics"))
    supervisor_metrics = str(
        wait_until(
            lambda: (sample(metrics(supervisor_port, supervisor), "kiln_supervisor_sweeps_total")
                     or 0) >= 2 and metrics(supervisor_port, supervisor),
            15,
            "two supervisor sweeps",
        )
    )  # fmt: skip

    assert queued["status"] == "PENDING"
    assert queued["queue_position"] == 1
    assert done["status"] == "SUCCESS"
    assert done["attempt"] == 1
    assert (sample(worker_metrics, "kiln_worker_attempts_completed_total") or 0) >= 1
    assert sample(worker_metrics, "kiln_worker_attempts_running") == 0
    assert sample(supervisor_metrics, "kiln_supervisor_leading") in (0.0, 1.0)
    assert processes.stop(worker) == 0
    assert processes.stop(supervisor) == 0


def test_worker_stopped_by_sigterm_gives_its_attempt_back_uncounted(
    api_only: Server, processes: Processes
) -> None:
    with kiln.Client(api_only.url) as client:
        task = client.submit(params=params(steps=40, step_ms=100), max_attempts=1)
        first = processes.start(
            "worker", ["worker", "--data-dir", str(api_only.data_dir), "--concurrency", "1"],
            {**api_only.env, "KILN_SHUTDOWN_GRACE_S": "0.2"},
        )  # fmt: skip
        wait_until(lambda: generating_with_progress(client, task["id"]), 20, "GENERATING")
        processes.worker(api_only, "--concurrency", "1")

        exit_code = processes.stop(first)
        done = client.wait(task["id"], timeout_s=30)
        events = status_events(client, task["id"])

    assert exit_code == 0
    release = next(e for e in events if e["event"] == "release")
    assert (release["from"], release["status"]) == ("GENERATING", "PENDING")
    assert release["attempt"] == 0
    assert not any(e["event"] in ("fail", "expire") for e in events)
    assert done["status"] == "SUCCESS"
    assert (done["attempt"], done["max_attempts"]) == (1, 1)


def test_worker_killed_mid_generation_is_recovered_by_another_worker(
    api_only: Server, processes: Processes
) -> None:
    with kiln.Client(api_only.url) as client:
        task = client.submit(params=params(steps=20, step_ms=60))
        first = processes.worker(api_only, "--concurrency", "1")
        wait_until(lambda: generating_with_progress(client, task["id"]), 20, "progress")
        processes.worker(api_only, "--concurrency", "1")

        processes.kill(first)
        done = client.wait(task["id"], timeout_s=30)
        events = status_events(client, task["id"])

    assert first.popen.returncode == -9
    expire = next(e for e in events if e["event"] == "expire")
    assert expire["from"] == "GENERATING"
    assert expire["error"]["code"] == "lease_expired"
    assert expire["attempt"] == 1
    assert done["status"] == "SUCCESS"
    assert done["attempt"] == 2
    assert [e["status"] for e in events][-3:] == ["GENERATING", "UPLOADING", "SUCCESS"]


def test_serve_stops_on_sigterm_with_a_stream_open_and_never_logs_the_access_token(
    processes: Processes, tmp_path: Path
) -> None:
    token = f"secret-{uuid.uuid4().hex}"
    server = processes.serve(
        tmp_path / "data", "--workers", "1", KILN_API_KEYS=f"acme:{token}",
        KILN_SHUTDOWN_GRACE_S="1",  # the stalled attempt goes back after a second
        KILN_ACCESS_LOG="1",  # a line per request, the token redacted
    )  # fmt: skip
    with kiln.Client(server.url, token) as client:
        task = client.submit(params=params(steps=9, step_ms=5, stall_attempts=1))
    url = f"{server.url}/v1/tasks/{task['id']}/events?access_token={token}"
    with httpx.stream("GET", url, timeout=10) as stream:
        first = next(stream.iter_lines())

        exit_code = processes.stop(server.process)

    assert first.startswith(("id:", "event:", "data:", ":"))
    assert exit_code == 0
    log = server.process.output()
    assert "Finished server process" in log
    assert "access_token=[redacted]" in log
    assert token not in log


def test_serve_logs_no_line_per_request_unless_asked(processes: Processes, tmp_path: Path) -> None:
    # Given kiln serve with its defaults
    server = processes.serve(tmp_path / "data", "--no-workers")
    # When it answers requests, and then stops
    with kiln.Client(server.url) as client:
        task = client.submit(params=params(steps=1, step_ms=0))
        client.get(task["id"])
    exit_code = processes.stop(server.process)
    # Then its log holds no access line (the submit's transition is logged)
    log = server.process.output()
    assert exit_code == 0 and "Finished server process" in log
    assert f"/v1/tasks/{task['id']} HTTP/1.1" not in log and "POST /v1/tasks" not in log
    assert task["id"] in log
