"""The peers benchmark measures what it says: its load generator is open-loop, pickup
latency runs from the scheduled submit time, and the summary's ratios and pickup figures
come from the medians of the rounds."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS / "peers"))
    return importlib.import_module("common")


@pytest.fixture
def peers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("peers")


async def test_the_generator_fires_every_submit_without_waiting_for_the_one_before(
    common: ModuleType,
) -> None:
    # Given submits that all block until the last one has been fired
    total, entered = 20, []
    gate = asyncio.Event()

    async def submit(i: int) -> None:
        entered.append(i)
        if len(entered) == total:
            gate.set()
        await gate.wait()

    # When the open-loop generator runs 20 of them (a closed loop would wait forever)
    scheduled = await asyncio.wait_for(common.open_loop(1000.0, total / 1000.0, submit), 30)

    # Then every submit was fired in order, each with its scheduled time 1/rate apart
    assert entered == list(range(total))
    assert len(scheduled) == total
    gaps = {round(b - a, 6) for a, b in itertools.pairwise(scheduled)}
    assert gaps == {0.001}


def test_pickup_latency_runs_from_the_scheduled_time_and_skips_warm_up_jobs(
    common: ModuleType, tmp_path: Path
) -> None:
    # Given a done file: a warm-up job, one earlier job, and 100 pickup jobs that each
    # started (i + 1) ms after their scheduled time
    scheduled = [1000.0 + i * 0.01 for i in range(100)]
    lines = ["-1 999.0", "5 999.5"]
    lines += [f"{common.PICKUP + i} {at + (i + 1) / 1000:.6f}" for i, at in enumerate(scheduled)]
    done = tmp_path / "done"
    done.write_text("\n".join(lines) + "\n")

    # When the pickup figures are read
    figures = common.pickup_figures(scheduled, done, started=1000.0)

    # Then the percentiles are those of the delays, and only the pickup jobs count
    assert figures["pickup_p50_ms"] == pytest.approx(51.0, abs=0.01)
    assert figures["pickup_p99_ms"] == pytest.approx(100.0, abs=0.01)
    assert figures["pickup_jobs"] == 100
    assert common.count_lines(done) == 101  # the warm-up line is not counted


def test_a_pickup_job_that_never_started_fails_the_figure(
    common: ModuleType, tmp_path: Path
) -> None:
    done = tmp_path / "done"
    done.write_text(f"{common.PICKUP} 1.0\n")
    with pytest.raises(RuntimeError, match="1 pickup jobs never started"):
        common.pickup_figures([0.5, 0.6], done, started=0.0)


def test_the_summary_takes_medians_and_computes_kiln_ratios(peers: ModuleType) -> None:
    # Given three rounds where each figure's median is the middle round's value
    base = {
        "kiln_sqlite_normal": 3000.0,
        "kiln_sqlite_full": 1500.0,
        "kiln_sqlite_full_one_process": 700.0,
        "kiln_postgres": 800.0,
        "dramatiq": 1000.0,
        "dramatiq_enqueue_drain": 900.0,
        "procrastinate": 100.0,
        "procrastinate_enqueue_drain": 80.0,
        "pgqueuer": 1600.0,
        "pgqueuer_enqueue_drain": 400.0,
    }
    for name in ("kiln_sqlite", "kiln_postgres", "dramatiq", "procrastinate", "pgqueuer"):
        base |= {
            f"{name}_pickup_p50_ms": 5.0,
            f"{name}_pickup_p99_ms": 20.0,
            f"{name}_pickup_started_per_s": 500.0,
        }
    rounds = [{k: v * f for k, v in base.items()} for f in (0.5, 1.0, 3.0)]

    # When summarised
    body = peers.summary(rounds, Path(sys.executable))

    # Then the ratios are kiln's medians over the peers' medians, drain and enqueue + drain
    assert body["ratios"]["sqlite_normal_vs_dramatiq"] == 3.0
    assert body["ratios"]["sqlite_full_vs_dramatiq"] == 1.5
    assert body["ratios"]["postgres_vs_procrastinate"] == 8.0
    assert body["ratios"]["postgres_vs_pgqueuer_drain"] == 0.5
    assert body["ratios"]["postgres_vs_pgqueuer_enqueue_drain"] == 2.0
    assert body["ratios"]["postgres_vs_oban_drain"] is None
    # And the one-process figure has its ratio; a baseline that did not run has none
    assert body["ratios"]["sqlite_full_one_process_vs_dramatiq"] == 0.7
    assert body["ratios"]["sqlite_full_baseline_vs_dramatiq"] is None
    assert body["pickup_ms"]["pgqueuer"] == {"p50": 5.0, "p99": 20.0, "started_per_s": 500.0}
    # And a system that started fewer tasks than offered is shown as saturated
    assert "saturated" in peers.pickup_cell({"p50": 1, "p99": 9, "started_per_s": 120}, 500)
    assert "saturated" not in peers.pickup_cell({"p50": 1, "p99": 9, "started_per_s": 499}, 500)


def test_kiln_postgres_drain_and_batched_figures_are_compared_like_for_like(
    peers: ModuleType,
) -> None:
    # Given one round of a --postgres-only run: kiln's three PostgreSQL figures and the
    # PostgreSQL peers' drain and enqueue + drain
    figures = {
        "kiln_postgres": 800.0,
        "kiln_postgres_cpu_us": 900.0,
        "kiln_postgres_enqueue_drain": 1200.0,
        "kiln_postgres_enqueue_drain_cpu_us": 700.0,
        "kiln_postgres_drain": 2400.0,
        "kiln_postgres_drain_cpu_us": 600.0,
        "procrastinate": 100.0,
        "procrastinate_enqueue_drain": 80.0,
        "pgqueuer": 1600.0,
        "pgqueuer_enqueue_drain": 400.0,
    }
    for name in ("procrastinate", "pgqueuer"):
        figures |= {
            f"{name}_pickup_p50_ms": 5.0,
            f"{name}_pickup_p99_ms": 20.0,
            f"{name}_pickup_started_per_s": 500.0,
        }

    # When summarised and shown
    body = peers.summary([figures], Path(sys.executable))
    body |= {"rate": 500.0, "enqueue_batch": 500}
    lines = peers.table(body)

    # Then drain is compared with drain and enqueue + drain with enqueue + drain
    ratios = body["ratios"]
    assert ratios["postgres_drain_vs_pgqueuer_drain"] == 1.5
    assert ratios["postgres_enqueue_drain_vs_pgqueuer_enqueue_drain"] == 3.0
    assert ratios["postgres_drain_vs_procrastinate_drain"] == 24.0
    assert ratios["postgres_enqueue_drain_vs_procrastinate_enqueue_drain"] == 15.0
    assert ratios["postgres_vs_pgqueuer_enqueue_drain"] == 2.0
    assert ratios["postgres_vs_pgqueuer_drain"] == 0.5
    assert body["pickup_ms"]["pgqueuer"]["p99"] == 20.0
    # And the table has the batched row: drain, enqueue + drain, CPU per lifecycle
    row = next(line for line in lines if "batches of 500" in line)
    assert row.split()[3:6] == ["2,400", "1,200", "600"]
