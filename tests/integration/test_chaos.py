"""The chaos run, short: real worker and supervisor processes killed with SIGKILL, paused
past their lease, storage writes failing, cancellations, failures and duplicates; then
every invariant of DESIGN.md checked, pipelines and inputs by reference among the tasks
(benchmarks/chaos.py, `make chaos` for the full run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"
INVARIANTS = {
    "I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "EO", "RC", "IT", "PL1", "PL2", "PL3", "RF",
    "CF1", "CF2", "CF3", "CH",
}  # fmt: skip


def run_chaos(run_dir: Path, *options: str) -> tuple[int, dict[str, Any], str]:
    """Run chaos.py in a session of its own, so a run that overstays is killed together
    with every process it started."""
    process = subprocess.Popen(
        [sys.executable, str(CHAOS), "--keep", str(run_dir), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=run_dir.parent,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the chaos run did not end in 200 s:\n{stdout}\n{stderr}")
    lines = stdout.strip().splitlines()
    assert lines, stdout + stderr
    return process.returncode, json.loads(lines[-1]), stdout


def logs_of(run_dir: Path) -> str:
    parts = []
    for path in sorted((run_dir / "logs").glob("*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def test_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    # Given 200 tasks through three worker processes and a supervisor process
    run_dir = tmp_path / "run"

    # When workers are killed and paused, the supervisor restarted, writes fail at 5%
    code, summary, stdout = run_chaos(run_dir, "--tasks", "200", "--seed", "11")

    # Then the run ends with every check passing and says so in its last line
    failing = {key: c for key, c in summary["checks"].items() if not c["ok"]}
    assert code == 0 and summary["ok"] is True, f"{stdout}\n{failing}\n{logs_of(run_dir)}"
    assert set(summary["checks"]) == INVARIANTS
    assert all(check["violations"] == 0 for check in summary["checks"].values())
    # And the chaos really happened: kills, faults, cancels, retries, one supervisor restart
    assert summary["tasks"] >= 200
    assert summary["worker_kills"] > 0
    assert summary["storage_faults"] > 0
    assert summary["cancelled_pending"] > 0 and summary["cancelled_running"] > 0
    assert summary["tasks_retried"] > 0 and summary["retries_scheduled"] > 0
    assert summary["supervisor_restarts"] == 1
    assert summary["permanent"] > 0 and summary["outcomes"].get("FAILED", 0) > 0
    # And pipelines ran under it, their steps made by the store, some cancelled; and
    # earlier outputs were transformed by reference
    assert summary["pipelines"] > 0 and summary["pipeline_steps"] > summary["pipelines"]
    assert summary["checks"]["PL3"]["checked"] > 0
    assert summary["pipelines_cancelled_pending"] + summary["pipelines_cancelled_running"] > 0
    assert summary["by_reference"] > 0 and summary["checks"]["RF"]["checked"] > 0
    # And comfy.workflow jobs ran on stand-in ComfyUI instances that were killed: some
    # succeeded (their images checked in storage), those with a failing node failed
    assert summary["comfy_jobs"] >= 10 and summary["comfy_instance_kills"] > 0
    assert summary["checks"]["CF2"]["checked"] > 0
    assert summary["comfy_outcomes"].get("FAILED", 0) >= summary["comfy_failing"] > 0
    # And the table came before the JSON line
    assert "PASS" in stdout and re.search(r"\bFAIL\b", stdout) is None
