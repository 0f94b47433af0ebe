"""The lifecycle benchmark runs end to end and ends with its one-line JSON summary.

Timings are never asserted: only that a tiny run completes every task and reports
positive figures in the documented shape.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.postgres import PostgresServer

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "lifecycle.py"
FIGURES = ("lifecycles_per_s", "transitions_per_s", "raw_tx_per_s", "ratio")


def run_benchmark(tmp_path: Path, *options: str, tasks: int = 200) -> tuple[dict[str, Any], str]:
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), "--tasks", str(tasks), "--raw-seconds", "0.3", *options],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr
    last = completed.stdout.strip().splitlines()[-1]
    summary = json.loads(last)
    assert isinstance(summary, dict)
    return summary, completed.stdout


def assert_positive(summary: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = summary[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), key
        assert math.isfinite(value) and value > 0, (key, value)


def test_default_run_prints_both_figures_and_ends_with_the_json_summary(tmp_path: Path) -> None:
    # Given a tiny run with the default settings (no-op and 1 KiB figures, NORMAL)
    # When it finishes
    summary, stdout = run_benchmark(tmp_path)

    # Then the human summary comes first and the JSON object is the very last line
    assert "lifecycles/s" in stdout and "raw single-row" in stdout
    assert_positive(summary, FIGURES)
    assert_positive(summary, ("lifecycles_per_s_1k", "transitions_per_s_1k", "ratio_1k"))
    assert summary["synchronous"] == "NORMAL"
    assert summary["tasks"] == 200
    # And every lifecycle counted its five transitions (submit, claim, acquire, generated,
    # uploaded), so the two rates agree
    assert summary["transitions_per_s"] == pytest.approx(5 * summary["lifecycles_per_s"], rel=0.01)


def test_json_only_full_run_prints_one_json_line_of_the_same_shape(tmp_path: Path) -> None:
    # Given a no-op-only run with synchronous=FULL and --json-only
    # When it finishes
    summary, stdout = run_benchmark(
        tmp_path, "--synchronous", "FULL", "--output-bytes", "0", "--json-only"
    )

    # Then the JSON line is all it printed, with the same keys and FULL named
    assert len(stdout.strip().splitlines()) == 1
    assert_positive(summary, FIGURES)
    assert summary["synchronous"] == "FULL"
    assert summary["output_bytes"] == 0
    assert "lifecycles_per_s_1k" not in summary


def test_postgres_run_counts_transactions_and_compares_with_pgbench(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    # Given the test cluster and a tiny run with two worker processes and a short pgbench
    url = postgres_server.new_database()

    # When it finishes
    summary, stdout = run_benchmark(
        tmp_path, "--database", url, "--workers", "2", "--concurrency", "8",
        "--pgbench-seconds", "1", tasks=60,
    )  # fmt: skip

    # Then it reports the lifecycle rate, the server-counted transactions per lifecycle,
    # pgbench's rate as the raw rate, and the ratio against the aim
    assert "pgbench -N" in stdout and "write transactions" in stdout
    assert_positive(summary, (*FIGURES, "tx_per_lifecycle", "commits_per_lifecycle"))
    assert summary["database"] == "postgresql"
    assert summary["tasks"] == 60 and summary["workers"] == 2 and summary["aim"] == 0.6
    assert summary["ratio"] == pytest.approx(
        summary["lifecycles_per_s"] * summary["tx_per_lifecycle"] / summary["raw_tx_per_s"],
        rel=0.01,
    )
    # And the server counted at most one transaction per transition (five a lifecycle):
    # writes of many tasks share transactions (the store's batch), never the reverse
    assert 0 < summary["tx_per_lifecycle"] <= 5


def test_postgres_drain_queues_every_task_before_the_workers_start_and_says_so(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    # Given the test cluster and a tiny drain: tasks submitted in batches of 25, then two
    # worker processes started
    url = postgres_server.new_database()

    # When it finishes
    summary, stdout = run_benchmark(
        tmp_path, "--database", url, "--workers", "2", "--concurrency", "8",
        "--pgbench-seconds", "1", "--drain", "--submit-batch", "25", tasks=60,
    )  # fmt: skip

    # Then the summary names the drain and the batch, with the workers' CPU per lifecycle
    assert "mode=drain submit_batch=25" in stdout
    assert summary["mode"] == "drain" and summary["submit_batch"] == 25
    assert summary["tasks"] == 60 and summary["workers"] == 2
    assert_positive(
        summary,
        (*FIGURES, "tx_per_lifecycle", "cpu_us_per_lifecycle", "worker_cpu_us_per_lifecycle"),
    )
    # And every task's five transitions were counted, submits included
    assert summary["transitions_per_s"] == pytest.approx(5 * summary["lifecycles_per_s"], rel=0.01)


def test_the_store_operations_benchmark_ends_with_its_json_line(tmp_path: Path) -> None:
    script = BENCHMARK.parent / "store_ops.py"
    completed = subprocess.run(
        [sys.executable, str(script), "--tasks", "50", "--concurrency", "8"],
        capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert summary["database"] == "sqlite (FULL)" and summary["tasks"] == 50
    assert_positive(summary, ("submit_us", "claim_us_per_task", "acquire_us", "heartbeat_us"))


def test_the_log_lines_benchmark_ends_with_its_json_line(tmp_path: Path) -> None:
    script = BENCHMARK.parent / "log_lines.py"
    completed = subprocess.run(
        [sys.executable, str(script), "--lines", "200"],
        capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr == ""  # the lines went to the benchmark's own file
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert set(summary) == {"text log.info", "text logs.line", "json log.info", "json logs.line"}
    assert_positive(summary, tuple(summary))


def test_the_gpu_benchmark_counts_model_loads_and_ends_with_its_json(tmp_path: Path) -> None:
    script = BENCHMARK.parent / "gpu.py"
    completed = subprocess.run(
        [sys.executable, str(script), "--tasks", "6", "--rounds", "1", "--load-s", "0.05",
         "--skip-batching"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    for order in ("routing_alternating", "routing_random"):
        for mode in ("routed", "plain"):
            # Two models on two workers: each loads at least once, never more than a task
            assert 2 <= summary[order][mode]["loads_median"] <= 6, summary
            assert summary[order][mode]["wall_s_median"] > 0
