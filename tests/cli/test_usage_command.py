"""`kiln usage` and Client.usage: the GPU-second ledger against a real `kiln serve`."""

from __future__ import annotations

import json
import uuid

from typer.testing import CliRunner

import kiln
from kiln.cli import cli

from .conftest import Server

runner = CliRunner()


def test_kiln_usage_prints_the_ledger_as_a_table_and_as_json(server: Server) -> None:
    # Given a task that ran to SUCCESS on the server
    with kiln.Client(server.url) as client:
        params = {"prompt": f"a heron {uuid.uuid4().hex[:8]}", "width": 64, "height": 64,
                  "steps": 2, "simulate": {"step_ms": 1}}  # fmt: skip
        done = client.wait(client.submit(params=params)["id"], timeout_s=30)
        assert done["status"] == "SUCCESS"
        # And the client's view of the ledger by kind and outcome
        through_client = client.usage(group_by=["kind", "outcome"])
    # When `kiln usage` is asked for the same, as JSON and as a table
    as_json = runner.invoke(cli, ["usage", "--group-by", "kind,outcome", "--json",
                                  "--server", server.url])  # fmt: skip
    table = runner.invoke(cli, ["usage", "--group-by", "kind,outcome", "--server", server.url])
    # Then the JSON is the API's answer, with the successful attempt counted
    assert as_json.exit_code == 0, as_json.stderr
    found = json.loads(as_json.stdout)
    assert found["group_by"] == through_client["group_by"] == ["kind", "outcome"]
    success = next(i for i in found["items"] if i["outcome"] == "success")
    assert success["kind"] == "image.generate" and success["attempts"] >= 1
    assert success["gpu_seconds"] == success["generating_s"] > 0
    # And the table has a column per key and per sum
    assert table.exit_code == 0, table.stderr
    header = table.stdout.splitlines()[0].split()
    assert header == ["KIND", "OUTCOME", "ATTEMPTS", "WAITING_S", "LOADING_S", "GENERATING_S",
                      "GPU_S"]  # fmt: skip
    assert any(
        line.split()[:2] == ["image.generate", "success"] for line in table.stdout.splitlines()
    )


def test_kiln_usage_refuses_an_unknown_grouping(server: Server) -> None:
    result = runner.invoke(cli, ["usage", "--group-by", "colour", "--server", server.url])
    assert result.exit_code == 2
    assert result.stderr.startswith("kiln: invalid_request: group_by takes tenant, kind")
