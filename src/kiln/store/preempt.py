"""Preemption at step boundaries (KILN_PREEMPT_AFTER_S): which running attempt of a full
pool is asked to yield its slot to a task of higher priority that waited too long.

The leading supervisor asks; the store decides and records the request in one
transaction (:meth:`PreemptOps.request_yields`): per shared pool whose line has a waiter
that joined it more than ``waited_s`` ago,

- the pool must be full: its first waiter cannot take its slot now (a slot just given
  back is left to the line);
- no holder of the pool is asked already (one request per pool at a time);
- the slot a yield frees goes to the head of the line (first come, first served), so a
  long waiter counts with the lowest priority of the line up to it: a holder yields only
  to a line whose every task ahead outranks it, never to swap equals;
- among the GENERATING holders of lower priority than that, the one asked is the lowest
  priority, then the most recently started (it loses the least work), then the last id.

The request is ``tasks.yield_requested_at``; the worker learns it at its next heartbeat
and the handler yields at its next step (``ctx.should_yield()``); the attempt goes back
to the queue uncounted (``release``), which clears it. Every claim clears it too. Each
request is counted in ``counters`` as ``("preemptions", <pool>)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln import counters as names
from kiln.errors import NotLeader
from kiln.states import Status
from kiln.store.pools import SlotRow, standing
from kiln.store.records import LeaderToken
from kiln.store.tx import Ops, Refused, Tx


@dataclass(frozen=True, slots=True)
class LineRow:
    """A live row of a pool's line with what preemption reads of its task."""

    task_id: str
    units: int
    held: bool
    #: When it joined the line.
    since: float
    priority: int
    status: Status
    #: When the task entered its status (GENERATING: when it took its slot).
    status_since: float
    epoch: int
    asked: bool


@dataclass(frozen=True, slots=True)
class Preemption:
    """One request to yield: ``task_id`` (at ``epoch``) gives its slot of ``pool`` up for
    the line that ``waiter`` waits in."""

    pool: str
    task_id: str
    epoch: int
    priority: int
    waiter: str
    waiter_priority: int


def choose(
    pool: str,
    rows: Sequence[LineRow],
    capacity: int,
    waited_before: float,
    skip: Iterable[str] = (),
) -> Preemption | None:
    """The holder of ``pool`` to ask to yield, or None (see the module docstring).
    ``waited_before``: a waiter counts when it joined the line before it; ``skip``: tasks
    asked already in this pass (for another pool)."""
    holders = [r for r in rows if r.held]
    if any(h.asked for h in holders):
        return None
    line = sorted((r for r in rows if not r.held), key=lambda r: (r.since, r.task_id))
    if not line:
        return None
    slots = [SlotRow(r.task_id, r.units, r.held, r.since) for r in rows]
    if standing(pool, slots, line[0].task_id, capacity) is None:
        return None  # room for the head of the line: not full
    waiter, bar = None, 0
    floor: int | None = None
    for row in line:
        floor = row.priority if floor is None else min(floor, row.priority)
        if row.since < waited_before and (waiter is None or floor > bar):
            waiter, bar = row, floor
    if waiter is None:
        return None
    skipped = set(skip)
    victims = [
        h
        for h in holders
        if h.status is Status.GENERATING and h.priority < bar and h.task_id not in skipped
    ]
    if not victims:
        return None
    victim = max(victims, key=lambda h: (-h.priority, h.status_since, h.task_id))
    return Preemption(
        pool, victim.task_id, victim.epoch, victim.priority, waiter.task_id, waiter.priority
    )


def line_rows(rows: Iterable[Sequence[Any]]) -> tuple[dict[str, list[LineRow]], dict[str, int]]:
    """Rows of ``preempt_rows`` as each pool's line, and the pools' capacities."""
    lines: dict[str, list[LineRow]] = {}
    capacities: dict[str, int] = {}
    for r in rows:
        pool = str(r[0])
        capacities[pool] = int(r[10])
        row = LineRow(
            task_id=str(r[1]),
            units=int(r[2]),
            held=bool(r[3]),
            since=float(r[4]),
            priority=int(r[5]),
            status=Status(r[6]),
            status_since=float(r[7]),
            epoch=int(r[8]),
            asked=r[9] is not None,
        )
        lines.setdefault(pool, []).append(row)
    return lines, capacities


class PreemptOps(Ops):
    """Preemption requests, for :class:`kiln.store.sqlstore.Store`."""

    async def request_yields(self, *, waited_s: float, leader: LeaderToken) -> list[Preemption]:
        """Ask at most one GENERATING holder of each full pool to yield to a task of
        higher priority that has waited in its line more than ``waited_s`` (see the
        module docstring); the requests made. Raises NotLeader when ``leader`` no longer
        leads. Cheap when no line has such a waiter: one read of the lines' waiters."""

        async def write(tx: Tx) -> list[Preemption] | Refused:
            now = self.clock()
            held = (leader.name, leader.owner, leader.epoch, now)
            if await tx.one(self.q.holds, held) is None:
                return Refused(NotLeader(f"{leader.owner} no longer leads"))
            before = now - waited_s
            pools = [str(r[0]) for r in await tx.all(self.q.preempt_pools, (before, now))]
            if not pools:
                return []
            await tx.all(self.q.lock_pools, (pools,))  # the lines hold still meanwhile
            lines, capacities = line_rows(await tx.all(self.q.preempt_rows, (pools, now)))
            made: list[Preemption] = []
            for pool in sorted(lines):
                asked = [p.task_id for p in made]
                pick = choose(pool, lines[pool], capacities[pool], before, asked)
                if pick is None:
                    continue
                args = (now, now, pick.task_id, pick.epoch)
                if await tx.one(self.q.request_yield, args) is not None:
                    tx.bump(names.PREEMPTIONS, pool)
                    made.append(pick)
            return made

        return await self._write(write)
