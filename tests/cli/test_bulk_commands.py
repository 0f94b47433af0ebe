"""`kiln submit --from-file`, `kiln rerun` and the client's submit_many and rerun, against
a real `kiln serve`."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

import kiln
from kiln.cli import cli
from kiln.client import Client

from .conftest import Server

runner = CliRunner()


def kiln_cli(server: Server, *args: str) -> Result:
    return runner.invoke(cli, [*args, "--server", server.url])


def small(prompt: str, **params: Any) -> dict[str, Any]:
    """Quick image.generate params, with a prompt no other test uses."""
    tag = uuid.uuid4().hex[:8]
    return {"prompt": f"{prompt} {tag}", "steps": 1, "width": 64, "height": 64, **params}


def submission(prompt: str, **params: Any) -> dict[str, Any]:
    return {"kind": "image.generate", "params": small(prompt, **params)}


def test_submit_from_file_prints_a_line_per_item_and_exits_1_on_a_refusal(
    server: Server, tmp_path: Path
) -> None:
    # Given a JSON Lines file: two good submissions, one of them keyed, and a refused one
    key = f"k-{uuid.uuid4().hex}"
    lines = [
        submission("a fox"),
        {**submission("a hare"), "idempotency_key": key},
        submission("a mole", width=13),
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    # When it is submitted
    result = kiln_cli(server, "submit", "--from-file", str(path))
    # Then each item gets a line, in order, and the refusal makes the exit code 1
    assert result.exit_code == 1, result.output
    out = result.stdout.splitlines()
    assert out[0].startswith("0 created tsk_") and out[1].startswith("1 created tsk_")
    assert out[2].startswith("2 refused invalid_request")
    # And sending the file again creates nothing new
    again = kiln_cli(server, "submit", "--from-file", str(path), "--json")
    answers = [json.loads(line) for line in again.stdout.splitlines()]
    assert [a["status"] for a in answers] == ["deduplicated", "replayed", "refused"]


def test_submit_from_file_refuses_a_bad_line_with_exit_2(server: Server, tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(submission("a wren")) + "\nnot json\n")

    result = kiln_cli(server, "submit", "--from-file", str(path))

    assert result.exit_code == 2
    assert "line 2" in result.stderr


def test_rerun_prints_the_new_task_linked_to_the_original(server: Server) -> None:
    with Client(server.url) as client:
        original = client.submit("image.generate", small("a lynx"))
    result = kiln_cli(server, "rerun", original["id"], "-p", "seed=42", "--json")
    assert result.exit_code == 0, result.output
    task = json.loads(result.stdout)
    assert task["rerun_of"] == original["id"] and task["params"]["seed"] == 42
    same = kiln_cli(server, "rerun", original["id"])
    assert same.exit_code == 0 and same.stdout.strip() == original["id"]
    variation = kiln_cli(server, "rerun", original["id"], "--new-variation")
    assert variation.exit_code == 0 and variation.stdout.strip() != original["id"]
    assert kiln_cli(server, "rerun", "tsk_missing").exit_code == 1


async def test_the_async_client_submits_many_and_reruns(server: Server) -> None:
    async with kiln.AsyncClient(server.url) as client:
        answers = await client.submit_many([submission("an owl"), {"kind": "nope", "params": {}}])
        assert [a["status"] for a in answers] == ["created", "refused"]
        assert answers[1]["error"]["code"] == "unknown_kind"
        again = await client.rerun(answers[0]["task"]["id"], {"seed": 3}, dedup=False)
        assert again["created"] and again["rerun_of"] == answers[0]["task"]["id"]


def test_submit_needs_a_prompt_or_a_file_but_not_both(server: Server, tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(submission("a stoat")) + "\n")

    neither = kiln_cli(server, "submit")
    both = kiln_cli(server, "submit", "a stoat", "--from-file", str(path))

    assert neither.exit_code == 2 and both.exit_code == 2
    assert "--from-file" in neither.stderr
