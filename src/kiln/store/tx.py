"""One transaction of a store driver, as the store's operations see it.

Every operation of :class:`kiln.store.sqlstore.Store` is an ``async`` function of a
:class:`Tx`. A driver runs it: SQLite on its writer thread, inside the group commit, where
the awaits never suspend (:func:`run_sync`); PostgreSQL on a pooled connection. An
operation that must refuse returns :class:`Refused`: what it wrote (a stale write's
counter) commits, and the driver raises the error after.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kiln.counters import FAILURE_BUCKETS_KEPT_MIN, FAILURES_BY_MINUTE
from kiln.errors import KilnError, StoreUnavailable
from kiln.models import JSON, Task, TaskEvent
from kiln.states import Event, Status
from kiln.store.queries import Queries

T = TypeVar("T")
Row = tuple[Any, ...]
#: A statement's parameters: in order (``?``), or by name (``:name``).
Args = Sequence[Any] | Mapping[str, Any]


class Tally(collections.Counter[tuple[str, str, str]]):
    """Counter deltas a transaction adds at commit, summed per row: ``("task_counts",
    tenant, status)`` and ``("counters", name, labels)``. A driver writes each distinct row
    once per commit, so counts stay off the hot path and never drift from what they count."""

    def count_status(self, tenant: str, status: Status, delta: int) -> None:
        self[("task_counts", tenant, str(status))] += delta

    def bump(self, name: str, labels: str = "", delta: int = 1) -> None:
        self[("counters", name, labels)] += delta

    def rows(self, table: str) -> list[tuple[str, str, int]]:
        """The non-zero deltas of ``table``, in a fixed order (no deadlocks)."""
        return sorted((a, b, n) for (t, a, b), n in self.items() if t == table and n)

    def stale_buckets(self) -> str | None:
        """When this commit adds to a per-minute failure bucket: the label below which
        buckets are older than a day and are dropped (``prune_counter``), else None."""
        buckets = [b for (t, a, b) in self if t == "counters" and a == FAILURES_BY_MINUTE]
        if not buckets:
            return None
        newest = int(max(buckets).split(":", 1)[0])
        return f"{newest - FAILURE_BUCKETS_KEPT_MIN:010d}:"


class Counting:
    """``count_status`` and ``bump`` of a :class:`Tx` that adds its deltas to ``tally``."""

    __slots__ = ()
    tally: Tally

    def count_status(self, tenant: str, status: Status, delta: int) -> None:
        self.tally.count_status(tenant, status, delta)

    def bump(self, name: str, labels: str = "", delta: int = 1) -> None:
        self.tally.bump(name, labels, delta)


def violation(message: str, *, unique: bool) -> IntegrityViolation:
    """A driver's constraint error as the store's."""
    return UniqueViolation(message) if unique else IntegrityViolation(message)


class IntegrityViolation(Exception):
    """A constraint refused a statement (drivers translate their driver's error)."""


class UniqueViolation(IntegrityViolation):
    """A unique index refused a statement."""


@dataclass(slots=True)
class Refused:
    """An operation's answer to raise once its transaction committed."""

    error: Exception


@dataclass(slots=True)
class EventRow:
    """An event row to insert (its seq comes from the database)."""

    task: Task
    version: int
    event: Event
    source: Status | None
    target: Status
    error: JSON | None
    at: float
    dwell_s: float | None
    final: bool = False
    #: Seconds the attempt spent loading models in the status this event leaves.
    loading_s: float | None = None

    def event_for(self, seq: int) -> TaskEvent:
        return TaskEvent(
            seq=seq,
            id=f"{self.task.id}:{self.version}",
            task_id=self.task.id,
            tenant=self.task.tenant,
            event=self.event,
            from_status=self.source,
            status=self.target,
            attempt=self.task.attempt,
            epoch=self.task.epoch,
            error=self.error,
            at=self.at,
            dwell_s=self.dwell_s,
            final=self.final,
            loading_s=self.loading_s,
        )


class Tx(Protocol):
    """One transaction of a driver, with the counter deltas it adds at commit."""

    async def one(self, sql: str, args: Args = ()) -> Row | None: ...

    async def all(self, sql: str, args: Args = ()) -> list[Row]: ...

    async def run(self, sql: str, args: Args = ()) -> int:
        """Execute; the rows it changed."""
        ...

    async def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        """Execute once per parameter row; the rows changed in all."""
        ...

    def savepoint(self) -> contextlib.AbstractAsyncContextManager[None]:
        """A nested transaction: an error inside rolls back only what it wrote."""
        ...

    async def insert_events(self, rows: Sequence[EventRow]) -> list[TaskEvent]: ...

    async def lock_tenant(self, tenant: str) -> bool:
        """Hold the claim lock of a capped tenant until commit; whether another claim held
        it first, so this one waited (a serial driver never waits)."""
        ...

    async def notify_ready(self) -> None:
        """Tell idle workers elsewhere that work became claimable."""
        ...

    tally: Tally

    def count_status(self, tenant: str, status: Status, delta: int) -> None: ...

    def bump(self, name: str, labels: str = "", delta: int = 1) -> None: ...


#: An operation: an async function of one transaction.
Op = Callable[[Tx], Awaitable[T | Refused]]


class Runs:
    """How an operation runs: in a write transaction (``_write``) or on a read connection
    (``_read``), and the two reads every group of operations makes over ``_read``."""

    async def _write(self, op: Op[T]) -> T:
        """Run ``op`` in a write transaction; raise what it refused after the commit."""
        raise NotImplementedError

    async def _read(self, op: Callable[[Tx], Awaitable[T]]) -> T:
        """Run ``op`` on a read connection."""
        raise NotImplementedError

    async def _rows(self, sql: str, args: Sequence[Any], row: Callable[[Row], T]) -> list[T]:
        """The rows of one query, each as ``row`` makes it."""

        async def read(tx: Tx) -> list[T]:
            return [row(found) for found in await tx.all(sql, args)]

        return await self._read(read)

    async def _count(self, sql: str, args: Sequence[Any] = ()) -> int:
        """The number one query answers (0 without a row)."""

        async def read(tx: Tx) -> int:
            found = await tx.one(sql, args)
            return 0 if found is None else int(found[0])

        return await self._read(read)


class Ops(Runs):
    """What the store's own groups of operations share: the dialect's queries, the clock, and
    how an operation runs (a driver, :class:`~kiln.store.sqlite.SqliteStore` or
    :class:`~kiln.store.postgres.PostgresStore`, says how)."""

    q: Queries
    clock: Callable[[], float]


class Driver(Protocol):
    """What a :class:`Concern` needs of the store it belongs to: the driver's primitives."""

    q: Queries
    clock: Callable[[], float]

    async def _write(self, op: Op[T]) -> T: ...

    async def _read(self, op: Callable[[Tx], Awaitable[T]]) -> T: ...


D = TypeVar("D", bound=Driver)


class Concern(Runs, Generic[D]):
    """One concern of the store (``store.schedules``, ``store.outbox``, ...): its
    operations, written once over the primitives of the store's driver (``_write``,
    ``_read``, ``q``, ``clock``), which it reaches through the store it belongs to."""

    def __init__(self, store: D) -> None:
        self._store = store

    @property
    def q(self) -> Queries:
        return self._store.q

    def clock(self) -> float:
        return self._store.clock()

    async def _write(self, op: Op[T]) -> T:
        return await self._store._write(op)

    async def _read(self, op: Callable[[Tx], Awaitable[T]]) -> T:
        return await self._store._read(op)


async def alone(tx: Tx, op: Op[T]) -> T | Exception:
    """Run ``op`` in a savepoint of ``tx``: a constraint it breaks, or a refusal it raises
    (a :class:`~kiln.errors.KilnError`: a pipeline purged meanwhile, a conflict), rolls
    back its writes and its counts alone and comes back as the error, as does what it
    refused. The transaction goes on with the other operations. The counts go back in
    place: the driver adds up the very tally it gave the transaction (SQLite: the
    connection's), so a new one would lose every later count and keep the refused ones."""
    before = Tally(tx.tally)
    try:
        async with tx.savepoint():
            result = await op(tx)
    except (IntegrityViolation, KilnError) as exc:
        if isinstance(exc, StoreUnavailable):  # the database failed: the whole unit does
            raise
        tx.tally.clear()
        tx.tally.update(before)
        return exc
    return result.error if isinstance(result, Refused) else result


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run an operation whose awaits never suspend (a serial driver's Tx) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a store operation suspended inside a synchronous transaction")
