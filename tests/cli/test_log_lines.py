"""`kiln serve` logs in JSON: each transition shows up while the server runs, and the lines
of its graceful stop are all written before it exits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kiln

from .conftest import Processes, wait_until
from .test_processes import params


def json_lines(output: str) -> list[dict[str, Any]]:
    """The JSON log lines of a process's output (uvicorn and the banner print text)."""
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def transitions_of(output: str, task_id: str) -> list[str]:
    return [
        str(body["to"])
        for body in json_lines(output)
        if body.get("task_id") == task_id and "to" in body
    ]


def test_serve_writes_transitions_while_running_and_every_line_before_exit(
    processes: Processes, tmp_path: Path
) -> None:
    # Given `kiln serve` logging JSON, with one worker
    server = processes.serve(tmp_path / "data", "--workers", "1", KILN_LOG_FORMAT="json")

    # When a task runs to its end
    with kiln.Client(server.url) as client:
        task = client.submit(params=params(steps=2, step_ms=1))
        assert client.wait(task["id"], timeout_s=30)["status"] == "SUCCESS"

    # Then its transitions are in the output soon after, while the server still runs
    wait_until(
        lambda: transitions_of(server.process.output(), task["id"])[-1:] == ["SUCCESS"],
        2, "the SUCCESS transition line",
    )  # fmt: skip
    assert transitions_of(server.process.output(), task["id"])[0] == "PENDING"

    # And when SIGTERM stops it, the lines it logs on the way out are written before exit
    assert processes.stop(server.process) == 0
    bodies = json_lines(server.process.output())
    events = [body["event"] for body in bodies]
    assert "api_signalled" in events and "api_stopping" in events
    assert all({"ts", "level", "logger", "event"} <= set(body) for body in bodies)
