"""How long the models a worker process loaded took to load (``ctx.loading_model``).

A handler that loads a model marks the load as its attempt's ``loading_model`` stage; the
worker times it, logs ``model_loaded`` with the model and the seconds, and keeps a
histogram per model for ``kiln_model_load_seconds{model}`` (``kiln worker
--metrics-port``, and the API's ``/metrics`` for ``kiln serve``'s in-process workers).
Model names come from tasks, so the histogram names only the models it is told to show
(those the worker holds loaded, and ``KILN_METRICS_MODELS``); the others' loads are summed
under ``other``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

#: The stage an attempt shows while its model loads.
LOADING_MODEL = "loading_model"
#: Histogram buckets of a load, in seconds: a checkpoint from a warm page cache loads in
#: about a second, a cold one from a network disk in minutes.
BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class LoadTimes:
    """One model's loads: how many, their total seconds, and how many took at most each
    bucket's bound."""

    count: int = 0
    total_s: float = 0.0
    within: list[int] = field(default_factory=lambda: [0] * len(BUCKETS_S))

    def merged(self, other: LoadTimes) -> LoadTimes:
        within = [a + b for a, b in zip(self.within, other.within, strict=True)]
        return LoadTimes(self.count + other.count, self.total_s + other.total_s, within)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        for i, bound in enumerate(BUCKETS_S):
            if seconds <= bound:
                self.within[i] += 1


class ModelLoads:
    """The loads one worker process timed, by model."""

    def __init__(self) -> None:
        self.by_model: dict[str, LoadTimes] = {}

    def record(self, model: str, seconds: float) -> None:
        self.by_model.setdefault(model, LoadTimes()).add(seconds)


class ModelLoadMetrics:
    """A Prometheus collector of :class:`ModelLoads`: ``kiln_model_load_seconds{model}``,
    each model not in ``shown()`` (when given) summed under ``other``."""

    def __init__(
        self, loads: ModelLoads, shown: Callable[[], Collection[str]] | None = None
    ) -> None:
        self.loads = loads
        self.shown = shown

    def by_label(self) -> dict[str, LoadTimes]:
        """The loads by the ``model`` label they are shown under."""
        if self.shown is None:
            return dict(self.loads.by_model)
        names = self.shown()
        found: dict[str, LoadTimes] = {}
        for model, times in self.loads.by_model.items():
            label = model if model in names else "other"
            found[label] = found[label].merged(times) if label in found else times
        return found

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import HistogramMetricFamily

        family = HistogramMetricFamily(
            "kiln_model_load_seconds", "Time a worker took to load a model", labels=["model"]
        )
        for model, times in sorted(self.by_label().items()):
            buckets = [(repr(b), n) for b, n in zip(BUCKETS_S, times.within, strict=True)]
            family.add_metric([model], [*buckets, ("+Inf", times.count)], times.total_s)
        yield family
