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

Both backends run the same steps in one transaction (on PostgreSQL it serialises on the
pools' rows, taken in name order) and leave the decision to :func:`decide`.

The other limits every process shares live here too: token buckets (tenant rate limits,
:mod:`kiln.limits`), circuit breaker states and the retry clock (:mod:`kiln.breakers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kiln import counters as names
from kiln.errors import LeaseLost
from kiln.limits import Rate, bucket_take
from kiln.models import JSON
from kiln.store.records import BreakerRecord
from kiln.store.tx import Concern, Driver, Refused, Tx

T = TypeVar("T")


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


class Pools(Concern[Driver]):
    """The shared resource pools' lines (``store.pools``)."""

    async def acquire(
        self,
        task_id: str,
        epoch: int,
        needs: Mapping[str, int],
        capacities: Mapping[str, int],
        *,
        in_line: bool = False,
    ) -> PoolWait | None:
        """Take ``needs`` units of each pool named in ``capacities`` for the attempt at
        ``epoch`` (WAITING_FOR_RESOURCE), all or none. None: granted (or nothing to take);
        else the task's place in the line, kept for the next call. The slots come back by
        themselves when the task leaves GENERATING or its lease lapses (kiln/store/pools.py).
        ``in_line``: the task asked before, so a plain read may answer that it still
        waits. Raises LeaseLost when the task is not held at ``epoch``."""

        units = units_needed(needs, capacities)
        if not units:
            return None
        names_ = sorted(units)
        if in_line:

            async def look(tx: Tx) -> PoolWait | None:
                rows = await tx.all(self.q.live_slot_rows, (names_, self.clock()))
                return peek(rows, task_id, units, capacities)

            still = await self._read(look)
            if still is not None:  # in line, and no slot for it yet: nothing to write
                return still
        return await self._write(lambda tx: self._take_slots(tx, task_id, epoch, units, capacities))

    async def _take_slots(
        self,
        tx: Tx,
        task_id: str,
        epoch: int,
        units: dict[str, int],
        capacities: Mapping[str, int],
    ) -> PoolWait | Refused | None:
        pools = sorted(units)
        now = self.clock()
        # One acquirer per pool at a time (rows locked in name order, so two never wait
        # on each other): the lines read below must not change under it.
        known: dict[str, int] = dict(await tx.all(self.q.lock_pools, (pools,)))
        if any(known.get(pool) != capacities[pool] for pool in pools):  # new or resized
            await tx.many(self.q.save_pool, [(pool, capacities[pool]) for pool in pools])
            await tx.all(self.q.lock_pools, (pools,))
        joins = [(pool, units[pool], now, task_id, epoch, now) for pool in pools]
        await tx.many(self.q.join_line, joins)
        rows = await tx.all(self.q.slot_rows, (now, pools))
        dead = [(r[0], r[1]) for r in rows if not r[5]]
        if dead:  # their attempts moved on or their holders died: the slots are free
            await tx.many(self.q.drop_slot, dead)
        lines = live_lines(rows, pools)
        if not in_every_line(lines, task_id):
            return Refused(LeaseLost(f"task {task_id} is not waiting at epoch {epoch}"))
        wait = decide(lines, task_id, capacities)
        if wait is None:
            await tx.run(self.q.hold_slots, (task_id,))
        return wait

    async def wait(self, task_id: str) -> PoolWait | None:
        """Where a waiting task stands in the line of a pool, or None."""

        async def read(tx: Tx) -> PoolWait | None:
            now = self.clock()
            for pool, capacity in await tx.all(self.q.waiting_in, (task_id, now)):
                rows = await tx.all(self.q.live_slot_rows, ([pool], now))
                wait = standing(pool, slot_rows(r[1:5] for r in rows), task_id, capacity)
                if wait is not None:
                    return wait
            return None

        return await self._read(read)

    async def usage(self) -> list[PoolUsage]:
        """Every pool ever acquired, with its capacity, units held and tasks waiting."""

        usage = lambda r: PoolUsage(r[0], int(r[1]), int(r[2]), int(r[3]))  # noqa: E731
        return await self._rows(self.q.pool_usage, (self.clock(),), usage)


class Limits(Concern[Driver]):
    """The other limits every process shares (``store.limits``): token buckets (tenant
    rate limits, :mod:`kiln.limits`), circuit breaker states (:mod:`kiln.breakers`) and the
    retry clock (:mod:`kiln.retry`)."""

    async def take_token(self, name: str, rate: Rate, n: int = 1) -> float:
        """Take ``n`` tokens from the bucket ``name`` (kiln.limits.bucket_take): 0.0 when
        taken, else the seconds until they are there (nothing taken). Shared by every
        process on the store."""
        return await self._write(lambda tx: self.take_in(tx, name, rate, n))

    async def take_in(self, tx: Tx, name: str, rate: Rate, n: int) -> float:
        """``take_token`` inside ``tx`` (a schedule's tick takes its tokens in the
        transaction that fires it)."""
        now = self.clock()
        await tx.run(self.q.new_bucket, (name, rate.burst, now))
        row = await tx.one(self.q.lock_bucket, (name,))
        assert row is not None
        left, wait_s = bucket_take(row[0], row[1], now, rate, n)
        if wait_s == 0.0:
            await tx.run(self.q.save_bucket, (left, now, name))
        return wait_s

    async def breakers(self) -> list[BreakerRecord]:
        """Every breaker's shared state, by name (one small read)."""

        return await self._rows(self.q.breakers, (), lambda row: BreakerRecord(*row))

    async def save_breaker(self, record: BreakerRecord, *, only_if_due: bool = False) -> bool:
        """Write ``record`` (insert or replace) and count the transition in ``counters`` as
        ``("breaker_transitions", "<name>><state>")``. With ``only_if_due`` it is written
        only when no row exists or the stored one is open or half-open with
        ``opened_until`` at or before ``record.updated_at``: the compare-and-set that lets
        one process take the half-open probe. Whether it was written."""

        sql = self.q.save_breaker_if_due if only_if_due else self.q.save_breaker
        args = (record.name, record.state, record.opened_until, record.updated_at, record.by)

        async def write(tx: Tx) -> bool:
            saved = await tx.one(sql, args) is not None
            if saved:
                tx.bump(names.BREAKER_TRANSITIONS, f"{record.name}>{record.state}")
            return saved

        return await self._write(write)

    async def reserve_retry(self, earliest: float, interval_s: float) -> float:
        """The retry slot for a retry due at ``earliest``: max(earliest, the clock's next
        free slot); the clock moves to that slot + ``interval_s``, atomically, so retries
        from every process are spread ``interval_s`` apart."""

        async def write(tx: Tx) -> float:
            args = (earliest, interval_s, interval_s, interval_s, interval_s)
            row = await tx.one(self.q.reserve_retry, args)
            assert row is not None
            return float(row[0])

        return await self._write(write)
