"""The task commands say what the API says, take any kind with its params and inputs,
print JSON when asked, say when a task waits for review, and fit 80 columns; against a
real `kiln serve` process."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import httpx
from typer.testing import CliRunner, Result

from images import png
from kiln.cli import cli

from .conftest import Server

runner = CliRunner()


def kiln_cli(server: Server, *args: str, columns: int | None = None) -> Result:
    env = {"COLUMNS": str(columns)} if columns else {}
    return runner.invoke(cli, [*args, "--server", server.url], env=env)


def unique(text: str) -> str:
    return f"{text} {uuid.uuid4().hex[:8]}"


def test_a_refused_submission_prints_the_apis_code_message_and_every_detail(
    server: Server,
) -> None:
    result = kiln_cli(server, "submit", unique("a red fox"), "--steps", "1000")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "kiln: invalid_request: invalid params for image.generate: params.steps: Input should"
        " be less than or equal to 150",
        "  params.steps: Input should be less than or equal to 150 (less_than_equal)",
    ]


def test_a_refused_listing_names_the_query_field(server: Server) -> None:
    result = kiln_cli(server, "list", "--status", "BOGUS")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith("kiln: invalid_request: ")
    assert lines[1].startswith("  query.status: Input should be 'PENDING'")


def test_any_kind_with_params_and_an_uploaded_input(server: Server, tmp_path: Path) -> None:
    # Given an image and params from a file and from the command line
    image = tmp_path / "in.png"
    image.write_bytes(png(64, 48))
    params = tmp_path / "params.json"
    params.write_text(json.dumps({"op": "thumbnail", "width": 999}))
    # When `kiln submit image.transform` uploads it and waits
    result = kiln_cli(server, "submit", "image.transform", "--params-file", str(params),
                      "-p", "width=16", "-p", "height=16", "--input", f"image=@{image}",
                      "--wait", "--json")  # fmt: skip
    # Then the task ends SUCCESS, and the last thing printed is the final task as JSON
    assert result.exit_code == 0, result.output
    task = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert task["kind"] == "image.transform" and task["status"] == "SUCCESS"
    assert task["params"]["width"] == 16 and task["params"]["op"] == "thumbnail"
    assert [i["name"] for i in task["inputs"]] == ["image"]


def test_an_input_that_is_not_a_file_is_refused_before_anything_is_sent(
    server: Server, tmp_path: Path
) -> None:
    result = kiln_cli(server, "submit", "image.transform", "-p", "op=convert",
                      "--input", f"image=@{tmp_path / 'missing.png'}")  # fmt: skip
    assert result.exit_code == 2
    assert "no file" in result.stderr and "missing.png" in result.stderr


def test_json_on_every_command_that_prints_a_task(server: Server) -> None:
    submitted = kiln_cli(server, "submit", unique("a grey wolf"), "--step-ms", "200", "--json")
    task = json.loads(submitted.stdout)
    assert submitted.exit_code == 0 and task["created"] is True
    shown = json.loads(kiln_cli(server, "status", task["id"], "--json").stdout)
    assert shown["id"] == task["id"]
    cancelled = json.loads(kiln_cli(server, "cancel", task["id"], "--json").stdout)
    assert cancelled["id"] == task["id"] and cancelled["status"] in (
        "CANCELLED", "WAITING_FOR_RESOURCE", "GENERATING", "UPLOADING", "SUCCESS",
    )  # fmt: skip
    page = json.loads(kiln_cli(server, "list", "--limit", "3", "--json").stdout)
    assert set(page) == {"items", "next_cursor"} and len(page["items"]) <= 3


def test_wait_says_when_a_task_is_held_for_review_and_can_stop_there(server: Server) -> None:
    result = kiln_cli(server, "submit", unique("a heron"), "--steps", "2", "--step-ms", "1",
                      "--simulate", '{"review": true}', "--wait", "--no-review-wait")  # fmt: skip
    task_id = result.stdout.splitlines()[0]
    assert result.exit_code == 1
    assert f"task {task_id} waits for review: kiln review {task_id} approve" in result.stderr


def test_watch_keeps_waiting_through_review_and_ends_with_the_approval(server: Server) -> None:
    # Given a task that will be held for review, approved once it is
    submitted = kiln_cli(server, "submit", unique("an owl"), "--steps", "2", "--step-ms", "1",
                         "--simulate", '{"review": true}')  # fmt: skip
    task_id = submitted.stdout.strip()
    approver = threading.Thread(target=_approve_when_held, args=(server, task_id), daemon=True)
    approver.start()
    # When `kiln watch` follows it
    result = kiln_cli(server, "watch", task_id)
    approver.join(timeout=30)
    # Then it said the task waits for review, kept waiting, and ended with SUCCESS
    assert f"kiln review {task_id} approve" in result.stderr
    assert result.exit_code == 0, result.output


def _approve_when_held(server: Server, task_id: str) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for _ in range(300):  # up to 30 s
            if http.get(f"/v1/tasks/{task_id}").json()["status"] == "NEEDS_REVIEW":
                http.post(f"/v1/tasks/{task_id}/review", json={"decision": "approve"})
                return
            threading.Event().wait(0.1)


def test_list_fits_80_columns_without_cutting_ids_or_kinds(server: Server) -> None:
    kiln_cli(server, "submit", unique("a lynx"), "--steps", "1", "--step-ms", "1")
    result = kiln_cli(server, "list", "--limit", "5", columns=80)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "KIND", "TRY", "AGE"]
    assert max(len(line) for line in lines) <= 80
    page = httpx.get(f"{server.url}/v1/tasks", params={"limit": 5}).json()
    for task in page["items"]:
        assert task["id"] in result.stdout and task["kind"] in result.stdout


def test_states_and_settings_print_json_too() -> None:
    states = json.loads(runner.invoke(cli, ["states", "--json"]).stdout)
    assert {"event": "claim", "to": ["WAITING_FOR_RESOURCE"]}.items() <= states["transitions"][
        1
    ].items()
    assert {"status": "SUCCESS", "final": True} in states["statuses"]
    settings = json.loads(
        runner.invoke(cli, ["settings", "--json"], env={"KILN_PORT": "8123"}).stdout
    )
    port = next(row for row in settings if row["variable"] == "KILN_PORT")
    assert port["value"] == "8123"
