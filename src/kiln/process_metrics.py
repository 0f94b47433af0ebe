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
        "kiln_supervisor_ghost_tasks": lambda: process.last.ghosts,
    }
    return counters, gauges


class LiveMetrics:
    """A Prometheus collector that reads a process's counters and gauges when scraped."""

    def __init__(self, counters: dict[str, Reading], gauges: dict[str, Reading]) -> None:
        self.counters = counters
        self.gauges = gauges

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, read in self.counters.items():
            yield CounterMetricFamily(name, name.replace("_", " "), value=read())
        for name, read in self.gauges.items():
            yield GaugeMetricFamily(name, name.replace("_", " "), value=read())
