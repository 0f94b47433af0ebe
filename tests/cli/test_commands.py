"""The API commands (`kiln submit`, `status`, `watch`, `cancel`, `retry`, `list`) against a
real `kiln serve` process, with their exit codes."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

import kiln
from kiln import errors
from kiln.cli import cli

from .conftest import Processes, Server

runner = CliRunner()
TASK_ID = re.compile(r"^tsk_[0-9a-z]+$")


def kiln_cli(server: Server, *args: str, api_key: str | None = None) -> Result:
    env = {"KILN_API_KEY": api_key} if api_key else {}
    return runner.invoke(cli, [*args, "--server", server.url], env=env)


def prompt() -> str:
    return f"a red fox {uuid.uuid4().hex[:8]}"


def test_submit_wait_prints_the_task_id_and_the_output_url(server: Server) -> None:
    result = kiln_cli(server, "submit", prompt(), "--steps", "5", "--step-ms", "5",
                      "--width", "64", "--height", "64", "--wait")  # fmt: skip

    assert result.exit_code == 0, result.output
    task_id, url = result.stdout.splitlines()
    assert TASK_ID.match(task_id)
    assert url == f"{server.url}/v1/tasks/{task_id}/outputs/image.png"
    image = httpx.get(url)
    assert image.status_code == 200
    assert image.headers["content-type"] == "image/png"
    assert "SUCCESS" in result.stderr
    assert "attempt 1/3" in result.stderr


def test_submit_without_wait_prints_only_the_id(server: Server) -> None:
    result = kiln_cli(server, "submit", prompt(), "--steps", "2", "--width", "64", "--height", "64")

    assert result.exit_code == 0, result.output
    assert TASK_ID.match(result.stdout.strip())
    with kiln.Client(server.url) as client:
        task = client.get(result.stdout.strip())
    assert task["params"]["steps"] == 2
    assert task["params"]["width"] == 64


def test_submit_wait_of_a_permanent_failure_exits_1(server: Server) -> None:
    result = kiln_cli(server, "submit", prompt(), "--steps", "2", "--width", "64",
                      "--height", "64", "--simulate", '{"permanent": true}', "--wait")  # fmt: skip

    assert result.exit_code == 1
    task_id = result.stdout.strip()
    assert TASK_ID.match(task_id)
    assert f"task {task_id} ended FAILED: simulated_failure" in result.stderr
    assert "Traceback" not in result.output


def test_status_shows_a_task_and_its_output(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.wait(client.submit(params={"prompt": prompt(), "steps": 2})["id"], 30)

    text = kiln_cli(server, "status", task["id"])
    raw = kiln_cli(server, "status", task["id"], "--json")

    assert text.exit_code == 0
    assert f"{task['id']}  image.generate  SUCCESS" in text.stdout
    assert f"output: {server.url}/v1/tasks/{task['id']}/outputs/image.png" in text.stdout
    assert raw.exit_code == 0
    assert json.loads(raw.stdout)["status"] == "SUCCESS"


def test_status_of_a_missing_task_exits_1(server: Server) -> None:
    result = kiln_cli(server, "status", "tsk_missing")

    assert result.exit_code == 1
    assert result.stderr == "kiln: not_found: no task 'tsk_missing'\n"


def test_cancel_of_a_final_task_exits_1(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.wait(client.submit(params={"prompt": prompt(), "steps": 2})["id"], 30)

    result = kiln_cli(server, "cancel", task["id"])

    assert result.exit_code == 1
    assert "already SUCCESS" in result.stderr
    assert result.stderr.count("\n") == 1


def test_cancel_then_retry_then_watch_reaches_success(server: Server) -> None:
    with kiln.Client(server.url) as client:
        params = {"prompt": prompt(), "steps": 10, "simulate": {"step_ms": 5, "stall_attempts": 1}}
        task = client.submit(params=params)

    cancelled = kiln_cli(server, "cancel", task["id"])
    with kiln.Client(server.url) as client:
        client.wait(task["id"], 30)
    retried = kiln_cli(server, "retry", task["id"])
    watched = kiln_cli(server, "watch", task["id"])
    again = kiln_cli(server, "retry", task["id"])

    assert cancelled.exit_code == 0
    assert task["id"] in cancelled.stdout
    assert retried.exit_code == 0
    assert f"{task['id']} RETRYING" in retried.stdout
    assert watched.exit_code == 0, watched.output
    assert watched.stdout.strip().endswith("/outputs/image.png")
    assert again.exit_code == 1
    assert again.stderr.startswith("kiln: ")


def test_watch_of_a_failed_task_exits_1(server: Server) -> None:
    with kiln.Client(server.url) as client:
        params = {"prompt": prompt(), "steps": 2, "simulate": {"permanent": True}}
        task = client.wait(client.submit(params=params)["id"], 30)

    result = kiln_cli(server, "watch", task["id"])

    assert task["status"] == "FAILED"
    assert result.exit_code == 1
    assert "ended FAILED" in result.stderr


def test_list_shows_tasks_in_a_table(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.wait(client.submit(params={"prompt": prompt(), "steps": 2})["id"], 30)

    result = kiln_cli(server, "list", "--status", "SUCCESS", "--limit", "200")

    assert result.exit_code == 0
    row = next(line for line in result.stdout.splitlines() if task["id"] in line)
    assert "SUCCESS" in row
    assert "FAILED" not in result.stdout


# authentication


@pytest.fixture(scope="module")
def auth_server(module_processes: Processes) -> Server:
    return module_processes.serve(
        module_processes.root / "auth-data",
        "--workers", "1",
        KILN_API_KEYS="acme:acme-key", KILN_ADMIN_KEY="admin-key",
    )  # fmt: skip


def test_wrong_api_key_exits_2(auth_server: Server) -> None:
    result = kiln_cli(auth_server, "list", api_key="wrong-key")
    missing = kiln_cli(auth_server, "status", "tsk_x")

    assert result.exit_code == 2
    assert result.stderr.startswith("kiln: ")
    assert result.stderr.count("\n") == 1
    assert missing.exit_code == 2


def test_right_api_key_submits_and_waits(auth_server: Server) -> None:
    result = kiln_cli(auth_server, "submit", prompt(), "--steps", "2", "--width", "64",
                      "--height", "64", "--wait", api_key="acme-key")  # fmt: skip

    assert result.exit_code == 0, result.output
    task_id = result.stdout.splitlines()[0]
    with kiln.Client(auth_server.url, "acme-key") as client:
        assert client.get(task_id)["status"] == "SUCCESS"


def test_auth_errors_map_to_their_classes(auth_server: Server) -> None:
    with kiln.Client(auth_server.url, "acme-key") as tenant:
        task = tenant.submit(params={"prompt": prompt(), "steps": 2})
        with pytest.raises(errors.Forbidden) as forbidden:
            tenant.review(task["id"], "approve")
    with (
        kiln.Client(auth_server.url, "wrong") as stranger,
        pytest.raises(errors.Unauthorized) as unauthorized,
    ):
        stranger.get(task["id"])

    assert forbidden.value.status_code == 403  # type: ignore[attr-defined]
    assert unauthorized.value.status_code == 401  # type: ignore[attr-defined]


def test_serve_prints_the_dashboard_and_data_locations(server: Server) -> None:
    output = server.process.output()

    assert f"kiln dashboard: {server.url}/" in output
    assert f"database: sqlite:///{server.data_dir}/kiln.db" in output
    assert f"storage:  {Path(server.data_dir, 'results').as_uri()}" in output
