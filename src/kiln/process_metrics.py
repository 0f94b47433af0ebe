"""What a worker or supervisor loop reports about itself, read when Prometheus scrapes.

The same readings go to ``kiln worker/supervisor --metrics-port`` and, for the loops that
``kiln serve`` runs in process, to the API's own ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.supervisor import Supervisor
    from kiln.worker import Worker

Reading = Callable[[], float]
Readings = tuple[dict[str, Reading], dict[str, Reading]]  # (counters, gauges)


def worker_readings(process: Worker) -> Readings:
    counters: dict[str, Reading] = {"kiln_worker_attempts_completed": lambda: process.completed}
    gauges: dict[str, Reading] = {
        "kiln_worker_attempts_running": lambda: len(process.attempts),
        "kiln_worker_concurrency": lambda: process.concurrency,
    }
    return counters, gauges


def supervisor_readings(process: Supervisor) -> Readings:
    counters: dict[str, Reading] = {"kiln_supervisor_sweeps": lambda: process.sweeps}
    gauges: dict[str, Reading] = {
        "kiln_supervisor_leading": lambda: int(process.last.leading),
        "kiln_supervisor_last_sweep_seconds": lambda: process.last.duration_s,
        "kiln_supervisor_last_sweep_expired": lambda: process.last.expired,
        "kiln_supervisor_last_sweep_recovered": lambda: process.last.recovered,
        "kiln_supervisor_last_sweep_preempted": lambda: process.last.preempted,
        "kiln_supervisor_ghost_tasks": lambda: process.last.ghosts,
        "kiln_supervisor_webhooks_leading": lambda: int(process.webhooks.token is not None),
        "kiln_supervisor_webhooks_in_flight": lambda: len(process.webhooks.inflight),
    }
    ticks = process.scheduler.totals  # this process's; the API's /metrics has everyone's
    counters |= {
        'kiln_supervisor_schedule_ticks{outcome="fired"}': lambda: ticks.fired,
        'kiln_supervisor_schedule_ticks{outcome="skipped_overlap"}': lambda: ticks.skipped_overlap,
        'kiln_supervisor_schedule_ticks{outcome="skipped_missed"}': lambda: ticks.skipped_missed,
    }
    more_counters, more_gauges = reconcile_readings(process)
    return counters | more_counters, gauges | more_gauges


def reconcile_readings(process: Supervisor) -> Readings:
    """The supervisor's reconciliation passes; the gauges describe the last one (0 before)."""
    totals = process.reconciles
    counters: dict[str, Reading] = {
        "kiln_reconcile_runs": lambda: totals.runs,
        "kiln_reconcile_objects_checked": lambda: totals.objects_checked,
        'kiln_reconcile_repaired{action="deleted"}': lambda: totals.deleted,
        'kiln_reconcile_repaired{action="rerun"}': lambda: totals.rerun,
        'kiln_reconcile_repaired{action="failed"}': lambda: totals.failed,
    }
    gauges: dict[str, Reading] = {
        "kiln_reconcile_orphans": lambda: totals.last.orphan_count if totals.last else 0,
        "kiln_reconcile_missing": lambda: (
            totals.last.missing_count + totals.last.corrupt_count if totals.last else 0
        ),
        "kiln_reconcile_last_run_timestamp_seconds": lambda: (
            totals.last.started_at + totals.last.duration_s if totals.last else 0
        ),
    }
    return counters, gauges


class LiveMetrics:
    """A Prometheus collector that reads a process's counters and gauges when scraped.

    A reading named ``name{label="value"}`` is one sample of the family ``name``.
    """

    def __init__(self, counters: dict[str, Reading], gauges: dict[str, Reading]) -> None:
        self.counters = counters
        self.gauges = gauges

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kinds = ((CounterMetricFamily, self.counters), (GaugeMetricFamily, self.gauges))
        for family, readings in kinds:
            for name, samples in _families(readings).items():
                metric = family(name, name.replace("_", " "), labels=samples[0][0])
                for _, values, read in samples:
                    metric.add_metric(values, read())
                yield metric


Sample = tuple[list[str], list[str], Reading]  # (label names, label values, reading)


def _families(readings: dict[str, Reading]) -> dict[str, list[Sample]]:
    """Readings grouped by family: ``a{k="v"}`` and ``a{k="w"}`` are two samples of ``a``."""
    families: dict[str, list[Sample]] = {}
    for key, read in readings.items():
        name, _, rest = key.partition("{")
        pairs = [pair.split("=", 1) for pair in rest.rstrip("}").split(",") if pair]
        names = [label for label, _ in pairs]
        values = [value.strip('"') for _, value in pairs]
        families.setdefault(name, []).append((names, values, read))
    return families
