"""`kiln submit --run-at/--delay` and the schedule commands, against a real `kiln serve`
(whose supervisor fires the ticks)."""

from __future__ import annotations

import json
import time
import uuid

from typer.testing import CliRunner, Result

from kiln.cli import cli
from kiln.client import Client

from .conftest import Server, wait_until

runner = CliRunner()


def kiln_cli(server: Server, *args: str) -> Result:
    return runner.invoke(cli, [*args, "--server", server.url])


def unique(text: str) -> str:
    return f"{text} {uuid.uuid4().hex[:8]}"


def test_a_delayed_submission_waits_scheduled_and_can_be_cancelled(server: Server) -> None:
    result = kiln_cli(server, "submit", unique("a comet"), "--delay", "3600", "--json")
    assert result.exit_code == 0, result.output
    task = json.loads(result.stdout)
    assert task["status"] == "PENDING" and task["scheduled_for"] is not None
    shown = kiln_cli(server, "status", task["id"])
    assert f"scheduled for: {task['scheduled_for']}" in shown.stdout
    assert kiln_cli(server, "cancel", task["id"]).exit_code == 0


def test_run_at_takes_rfc_3339_and_refuses_both_with_exit_2(server: Server) -> None:
    moment = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 7200))
    ok = kiln_cli(server, "submit", unique("a tide"), "--run-at", moment, "--json")
    assert ok.exit_code == 0, ok.output
    refused = kiln_cli(server, "submit", unique("a tide"), "--run-at", moment, "--delay", "5")
    assert refused.exit_code == 2
    assert "give run_at or delay_s, not both" in refused.stderr


def test_a_schedule_is_added_fires_is_listed_paused_resumed_and_deleted(server: Server) -> None:
    # Given a schedule every second, added from the command line
    added = kiln_cli(server, "schedule", "add", "* * * * * *", unique("a metronome"),
                     "-p", "steps=1", "-p", "width=64", "-p", "height=64",
                     "--overlap", "queue", "--json")  # fmt: skip
    assert added.exit_code == 0, added.output
    schedule = json.loads(added.stdout)
    assert schedule["cron"] == "* * * * * *" and schedule["overlap"] == "queue"

    # When the server's supervisor has had a few seconds: it fired
    with Client(server.url) as client:
        wait_until(lambda: client.schedule(schedule["id"])["fired"] >= 2, 20, "two fires")
    listed = kiln_cli(server, "schedules")
    assert listed.exit_code == 0 and schedule["id"] in listed.stdout

    # Then pause, resume and delete say so, and a deleted schedule is not found (exit 1)
    assert kiln_cli(server, "schedule", "pause", schedule["id"]).stdout.strip().endswith("paused")
    assert "next run" in kiln_cli(server, "schedule", "resume", schedule["id"]).stdout
    assert kiln_cli(server, "schedule", "delete", schedule["id"]).exit_code == 0
    gone = kiln_cli(server, "schedule", "pause", schedule["id"])
    assert gone.exit_code == 1 and "not_found" in gone.stderr


def test_a_bad_cron_is_refused_with_exit_2(server: Server) -> None:
    result = kiln_cli(server, "schedule", "add", "every tuesday", unique("x"))
    assert result.exit_code == 2
    assert "bad cron expression" in result.stderr
