"""Autoscaling signals: what each kind and each pool asks of the workers, and what they offer.

Per kind: tasks waiting (ready to claim: PENDING and due RETRYING; plus claimed ones
WAITING_FOR_RESOURCE), tasks running (GENERATING, UPLOADING), how long the oldest waiting
one has waited since it became ready, and the slots the live workers serving the kind
offer. Per pool: its capacity, the tasks in its line and holding it, the oldest wait in
its line, and the slots of the live workers whose kinds take it. ``/metrics`` shows them as
``kiln_queue_*``, ``kiln_worker_slots`` and ``kiln_pool_*``; ``/v1/stats`` (admin) as
``autoscaling``. docs/autoscaling.md turns them into a worker count.

Everything here is pure: the numbers come from one read (``store.load.read()``), the
worker registry and the pools' usage, all read once per scrape.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kiln.models import JSON
from kiln.states import Status
from kiln.store.load import QueueLoad
from kiln.store.pools import PoolUsage
from kiln.store.workers import WorkerRecord


@dataclass(frozen=True, slots=True)
class KindSignals:
    """One kind's demand and the live workers' supply."""

    ready: int = 0
    waiting_for_resource: int = 0
    running: int = 0
    oldest_waiting_age_s: float = 0.0
    workers: int = 0
    worker_slots: int = 0

    @property
    def waiting(self) -> int:
        """Tasks that wait for a worker or a resource: the backlog."""
        return self.ready + self.waiting_for_resource

    def to_json(self) -> JSON:
        return {
            "waiting": self.waiting,
            "ready": self.ready,
            "waiting_for_resource": self.waiting_for_resource,
            "running": self.running,
            "oldest_waiting_age_s": round(self.oldest_waiting_age_s, 3),
            "workers": self.workers,
            "worker_slots": self.worker_slots,
        }


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One shared pool's line, its holders, and the live workers whose kinds take it."""

    capacity: int = 0
    waiting: int = 0
    running: int = 0
    oldest_waiting_age_s: float = 0.0
    worker_slots: int = 0

    def to_json(self) -> JSON:
        return {
            "capacity": self.capacity,
            "waiting": self.waiting,
            "running": self.running,
            "oldest_waiting_age_s": round(self.oldest_waiting_age_s, 3),
            "worker_slots": self.worker_slots,
        }


@dataclass(frozen=True, slots=True)
class Autoscaling:
    kinds: dict[str, KindSignals]
    pools: dict[str, PoolSignals]

    def to_json(self) -> JSON:
        return {
            "kinds": {name: s.to_json() for name, s in sorted(self.kinds.items())},
            "pools": {name: s.to_json() for name, s in sorted(self.pools.items())},
        }


def desired_workers(
    waiting: int, running: int, slots_per_worker: int, *, minimum: int = 0, maximum: int
) -> int:
    """docs/autoscaling.md's formula: ceil((waiting + running) / slots_per_worker), clamped
    to [minimum, maximum]. Running work counts, so busy workers are never scaled away."""
    if slots_per_worker < 1:
        raise ValueError("slots_per_worker must be at least 1")
    wanted = math.ceil((waiting + running) / slots_per_worker)
    return max(minimum, min(maximum, wanted))


def signals(
    load: QueueLoad,
    workers: Iterable[WorkerRecord],
    pools: Iterable[PoolUsage],
    kinds: Iterable[str] = (),
) -> Autoscaling:
    """Fold one read of the queue, the live workers and the pools into the signals; every
    kind in ``kinds`` (the registered ones) is shown, at zero when idle."""
    workers = list(workers)
    return Autoscaling(_kinds(load, workers, kinds), _pools(load, workers, pools))


def _kinds(
    load: QueueLoad, workers: list[WorkerRecord], kinds: Iterable[str]
) -> dict[str, KindSignals]:
    tally: dict[str, Counter[str]] = {kind: Counter() for kind in kinds}
    oldest: dict[str, float] = {}
    for kind, n, ready_at in load.ready:
        tally.setdefault(kind, Counter())["ready"] += n
        oldest[kind] = min(oldest.get(kind, ready_at), ready_at)
    for kind, status, ready_at in load.claimed:
        if status == Status.WAITING_FOR_RESOURCE:
            tally.setdefault(kind, Counter())["waiting_for_resource"] += 1
            oldest[kind] = min(oldest.get(kind, ready_at), ready_at)
        else:
            tally.setdefault(kind, Counter())["running"] += 1
    for worker in workers:
        for kind in worker.kinds:
            tally.setdefault(kind, Counter()).update(workers=1, worker_slots=worker.slots)
    found = {}
    for kind, t in tally.items():
        age_s = max(0.0, load.at - oldest[kind]) if kind in oldest else 0.0
        found[kind] = KindSignals(oldest_waiting_age_s=age_s, **t)
    return found


def _pools(
    load: QueueLoad, workers: list[WorkerRecord], pools: Iterable[PoolUsage]
) -> dict[str, PoolSignals]:
    capacity = {pool.name: pool.capacity for pool in pools}
    waiting: dict[str, int] = {}
    running: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for pool, held, since in load.lines:
        if held:
            running[pool] = running.get(pool, 0) + 1
        else:
            waiting[pool] = waiting.get(pool, 0) + 1
            oldest[pool] = min(oldest.get(pool, since), since)
    slots: dict[str, int] = {}
    for worker in workers:
        taken = {pool for kind in worker.kinds for pool in worker.resources.get(kind, {})}
        for pool in taken:
            slots[pool] = slots.get(pool, 0) + worker.slots
    found = {}
    for pool in sorted(capacity.keys() | waiting.keys() | running.keys()):
        age_s = max(0.0, load.at - oldest[pool]) if pool in oldest else 0.0
        found[pool] = PoolSignals(
            capacity=capacity.get(pool, 0),
            waiting=waiting.get(pool, 0),
            running=running.get(pool, 0),
            oldest_waiting_age_s=age_s,
            worker_slots=slots.get(pool, 0),
        )
    return found
