"""Resource pools: named counting semaphores shared by every worker on every machine.

A pool (``gpu-a100: 8``) is a row with its capacity; each task that needs it has one
``pool_slots`` row per pool, first waiting, then held. A row counts only while its attempt
is alive: the task is still at the row's epoch, in WAITING_FOR_RESOURCE or GENERATING,
with an unexpired lease. So a slot needs no renewal and no release of its own: it comes
back by itself when the task moves on (generated, failed, cancelled, expired) or when its
holder dies and the lease lapses. Dead rows are deleted by the next acquire of that pool.

A waiter asks again and again; most asks find the line unchanged. So an ask first reads
the live lines (one plain query, no lock, no write) and returns the task's place when it
is in every line and still has to wait; only a first ask, or one where a slot looks free,
takes the write path.

The line is first come, first served: a waiter gets its slots when the units held plus the
units of every waiter up to and including it fit the capacity. A task that needs several
pools takes all or none, and keeps its place in every line while it waits.

Both backends run the same steps in one transaction (the PostgreSQL one serialises on the
pools' rows, taken in name order) and leave the decision to :func:`decide`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kiln.models import JSON

#: The statuses in which an attempt's slot rows count.
SLOT_STATUSES = "('WAITING_FOR_RESOURCE', 'GENERATING')"


def live_sql(placeholder: str) -> str:
    """SQL true when a ``pool_slots`` row's attempt is alive at ``now`` (one parameter)."""
    return (
        "EXISTS (SELECT 1 FROM tasks t WHERE t.id = pool_slots.task_id"
        f" AND t.epoch = pool_slots.epoch AND t.status IN {SLOT_STATUSES}"
        f" AND t.lease_expires_at > {placeholder})"
    )


#: Every pool with its capacity, units held and tasks waiting (live rows only); ``{live}``
#: is :func:`live_sql` with the backend's placeholder (one parameter: now).
POOL_USAGE_SQL = (
    "SELECT pools.name, pools.capacity,"
    " coalesce(sum(CASE WHEN pool_slots.held THEN pool_slots.units ELSE 0 END), 0),"
    " count(pool_slots.task_id) - count(CASE WHEN pool_slots.held THEN 1 END)"
    " FROM pools LEFT JOIN pool_slots ON pool_slots.pool = pools.name AND {live}"
    " GROUP BY pools.name, pools.capacity ORDER BY pools.name"
)


@dataclass(frozen=True, slots=True)
class SlotRow:
    task_id: str
    units: int
    held: bool
    since: float


@dataclass(frozen=True, slots=True)
class PoolWait:
    """Where a task stands in the line of a pool it waits for."""

    pool: str
    #: 1 for the next waiter to get a slot.
    position: int
    capacity: int
    #: Units held now, and tasks waiting (this one included).
    held: int
    waiting: int

    def to_json(self) -> JSON:
        return {
            "pool": self.pool,
            "position": self.position,
            "capacity": self.capacity,
            "held": self.held,
            "waiting": self.waiting,
        }


@dataclass(frozen=True, slots=True)
class PoolUsage:
    name: str
    capacity: int
    held: int
    waiting: int

    def to_json(self) -> JSON:
        return {"capacity": self.capacity, "held": self.held, "waiting": self.waiting}


def units_needed(needs: Mapping[str, int], capacities: Mapping[str, int]) -> dict[str, int]:
    """The units of each configured pool a task takes (at most the pool's capacity, so a
    need larger than the pool still runs, alone); pools not configured do not limit."""
    return {
        name: max(1, min(int(n), capacities[name]))
        for name, n in needs.items()
        if name in capacities and n > 0
    }


def standing(pool: str, rows: Iterable[SlotRow], task_id: str, capacity: int) -> PoolWait | None:
    """None when ``task_id`` holds (or may take now) its slot in this pool, else its place."""
    rows = list(rows)
    held = sum(r.units for r in rows if r.held)
    if any(r.held and r.task_id == task_id for r in rows):
        return None
    line = sorted((r for r in rows if not r.held), key=lambda r: (r.since, r.task_id))
    ahead = 0
    for position, row in enumerate(line, start=1):
        ahead += row.units
        if row.task_id == task_id:
            if held + ahead <= capacity:
                return None
            return PoolWait(pool, position, capacity, held, len(line))
    raise ValueError(f"task {task_id} is not in the line of pool {pool!r}")


def decide(
    lines: Mapping[str, Iterable[SlotRow]], task_id: str, capacities: Mapping[str, int]
) -> PoolWait | None:
    """All or none: None when every pool can serve the task now, else where it waits
    (the first pool in name order that cannot)."""
    for pool in sorted(lines):
        wait = standing(pool, lines[pool], task_id, capacities[pool])
        if wait is not None:
            return wait
    return None


def slot_rows(rows: Iterable[Any]) -> list[SlotRow]:
    """Rows of ``SELECT task_id, units, held, since`` as SlotRows."""
    return [SlotRow(str(r[0]), int(r[1]), bool(r[2]), float(r[3])) for r in rows]


def lines_sql(ph: str, count: int) -> str:
    """The live rows of some pools, for a read-only look at the lines:
    (pool, ..., now); rows are (pool, task_id, units, held, since)."""
    marks = ", ".join([ph] * count)
    return (
        "SELECT pool, task_id, units, held, since FROM pool_slots"
        f" WHERE pool IN ({marks}) AND {live_sql(ph)}"
    )


def peek(
    rows: Iterable[Any], task_id: str, units: Mapping[str, int], capacities: Mapping[str, int]
) -> PoolWait | None:
    """From a read of the live lines (:func:`lines_sql`): the task's place when it is in
    every line and must still wait; None when the write path must decide (a first ask, a
    lost place, or a slot that looks free)."""
    lines = by_pool(rows, units)
    if not in_every_line(lines, task_id):
        return None
    return decide(lines, task_id, capacities)


def by_pool(rows: Iterable[Any], names: Iterable[str]) -> dict[str, list[SlotRow]]:
    """Rows of (pool, task_id, units, held, since) as each named pool's line."""
    lines: dict[str, list[SlotRow]] = {pool: [] for pool in names}
    for row in rows:
        lines[str(row[0])] += slot_rows([row[1:5]])
    return lines


def live_lines(rows: Iterable[Any], names: Iterable[str]) -> dict[str, list[SlotRow]]:
    """Rows of (pool, task_id, units, held, since, alive) as each pool's live line."""
    return by_pool((row for row in rows if row[5]), names)


def in_every_line(lines: Mapping[str, list[SlotRow]], task_id: str) -> bool:
    return all(any(r.task_id == task_id for r in line) for line in lines.values())
