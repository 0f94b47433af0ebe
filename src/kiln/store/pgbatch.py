"""The batch of one-statement writes of a PostgreSQL store's process.

Submissions without a key and workers' plain steps that arrive while a batch commits go
together into the next one: one transaction and one round trip (psycopg's pipeline mode).
Writes of one shape (submissions; steps that set the same columns) go as one statement
over typed arrays passed as named parameters, each the text of an array
(:func:`~kiln.store.pgtx.array_literal`: one C call, not an escape per element) that
the statement reads as its column's type (``submit_many``; steps:
:mod:`kiln.store.pgstep`); each row is still its own compare-and-set with its own event
row, and a write whose row did not match gets no row back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
import psycopg.errors
from psycopg_pool import PoolTimeout

from kiln.errors import StoreUnavailable
from kiln.store.pgstep import StepShape, arrays_of, step_sql
from kiln.store.pgtx import READY_CHANNEL, Conn, PostgresTx, Q
from kiln.store.rows import INSERT_NAMES
from kiln.store.tx import Args, Row, Tally

#: Writes one batch transaction takes at most.
BATCH_MAX = 256
#: The shape of submissions in a batch (a step's shape is the columns it sets).
SUBMIT_SHAPE = "submit"
#: The columns a submission sets (``insert_args``), for the typed arrays of ``submit_many``.
SUBMITTED = INSERT_NAMES
#: The names of a submission's values (``insert_values``, then its event's): ``k_<name>``.
SUBMIT_NAMES = (*SUBMITTED, "event", "at")
#: The tasks table's column types (for the typed arrays).
COLUMN_TYPES = (
    "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute"
    " WHERE attrelid = 'tasks'::regclass AND attnum > 0 AND NOT attisdropped"
)
#: A statement's shape: submissions, or steps that set the same columns.
Shape = StepShape | str


class Host(Protocol):
    """What a batch needs of its store."""

    shapes: Shapes

    def _connection(self) -> contextlib.AbstractAsyncContextManager[Conn]: ...

    async def _statement(self, sql: str, args: Args, *, notify: bool = False) -> Row | None: ...

    async def _drop_broken(self) -> None: ...


class Shapes:
    """The statements over arrays, built once per shape from the columns' types."""

    def __init__(self) -> None:
        self._types: dict[str, str] = {}
        self._sql: dict[Shape, str] = {}
        self._one: dict[StepShape, str] = {}

    async def read_types(self, conn: Conn) -> None:
        """Read the tasks table's column types once (before any statement over arrays)."""
        if not self._types:
            rows = await (await conn.execute(COLUMN_TYPES)).fetchall()
            self._types = {str(name): str(kind) for name, kind in rows}

    def sql(self, shape: Shape) -> str:
        """The statement over arrays of the writes of ``shape``: ``submit_many`` for
        submissions, :func:`kiln.store.pgstep.step_sql` for steps."""
        sql = self._sql.get(shape)
        if sql is None:
            sql = self._sql[shape] = (
                step_sql(shape, self._types, many=True)
                if isinstance(shape, StepShape)
                else self._submit()
            )
        return sql

    def one(self, shape: StepShape) -> str:
        """The statement of one step of ``shape``, its values given as they are."""
        sql = self._one.get(shape)
        if sql is None:
            sql = self._one[shape] = step_sql(shape, self._types, many=False)
        return sql

    def _submit(self) -> str:
        types = [self._types[column] for column in SUBMITTED] + ["text", "double precision"]
        arrays = ", ".join(
            f"%(k_{name})s::{kind}[]" for name, kind in zip(SUBMIT_NAMES, types, strict=True)
        )
        columns = ", ".join(f"k_{name}" for name in SUBMIT_NAMES)
        unnest = f"WITH d AS (SELECT * FROM unnest({arrays}) WITH ORDINALITY AS d({columns}, k_n))"
        return f"{unnest}, {Q.submit_many}"


@dataclass(slots=True)
class Write:
    """One write of a batch: a statement whose row comes back when it wrote, the counts
    that row adds, and whether it makes work claimable (NOTIFY)."""

    order: str
    counted: tuple[str, Args]  # the statement alone, counting itself (autocommit)
    bare: tuple[str, Args]  # the statement in a batch, counted by the batch
    counts: Callable[[Row, Tally], None]
    notify: bool
    future: asyncio.Future[Row | None]
    #: Writes of one shape share one statement over arrays (:meth:`Shapes.sql`);
    #: ``values`` is this write's row of those arrays, by name.
    shape: Shape | None = None
    values: dict[str, Any] = field(default_factory=dict)


class WriteBatch:
    """The one-statement writes of a process (submissions, workers' plain steps) that
    arrive while a batch commits go together into the next one: one transaction and one
    round trip for them all (psycopg's pipeline mode), each still its own compare-and-set. Rows are
    locked in task id order and counts added once, sorted, at the end, so two batches never
    wait on each other in a circle. A write alone runs as its own counted statement."""

    def __init__(self, store: Host) -> None:
        self.store = store
        self.waiting: list[Write] = []
        self.draining: asyncio.Task[None] | None = None
        self.batches = 0
        self.writes = 0
        self.statements = 0

    async def run(self, write: Write) -> Row | None:
        self.waiting.append(write)
        if self.draining is None or self.draining.done():
            self.draining = asyncio.create_task(self._drain(), name="kiln-pg-batch")
        return await write.future

    async def _drain(self) -> None:
        while self.waiting:
            batch, self.waiting = self.waiting[:BATCH_MAX], self.waiting[BATCH_MAX:]
            batch = [write for write in batch if not write.future.done()]  # a caller gave up
            if not batch:
                continue
            try:
                rows = await self._commit(sorted(batch, key=lambda s: s.order))
            except BaseException as exc:  # every waiter gets the failure
                for write in batch:
                    if not write.future.done():
                        write.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for write in batch:
                if not write.future.done():
                    write.future.set_result(rows[id(write)])

    async def _commit(self, batch: list[Write]) -> dict[int, Row | None]:
        self.batches += 1
        self.writes += len(batch)
        if len(batch) == 1:
            (write,) = batch
            sql, args = write.counted
            return {id(write): await self.store._statement(sql, args, notify=write.notify)}
        for attempt in range(4):
            try:
                return await self._together(batch)
            except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                if attempt == 3:
                    raise
            except (psycopg.errors.IntegrityError, psycopg.errors.DataError):
                # One of them broke a constraint, or a value its array's type does not take
                # (1.5 for an integer column, which a statement of its own rounds): each on
                # its own, so the others are not refused with it.
                return await self._each(batch)
            except (psycopg.OperationalError, PoolTimeout) as exc:
                await self.store._drop_broken()
                raise StoreUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
        raise AssertionError("unreachable")

    async def _each(self, batch: list[Write]) -> dict[int, Row | None]:
        rows: dict[int, Row | None] = {}
        for write in batch:
            rows[id(write)] = None
            try:
                rows[id(write)] = await self.store._statement(*write.counted, notify=write.notify)
            except Exception as exc:
                write.future.set_exception(exc)
        return rows

    async def _together(self, batch: list[Write]) -> dict[int, Row | None]:
        rows: dict[int, Row | None] = {}
        statements = statements_of(batch)
        self.statements += len(statements)
        async with self.store._connection() as conn:
            if any(len(writes) > 1 for writes in statements):
                await self.store.shapes.read_types(conn)
            async with conn.pipeline() as round_trip, conn.transaction():
                sent = [(writes, await conn.execute(*self._sql(writes))) for writes in statements]
                await round_trip.sync()
                tx = PostgresTx(conn)
                for writes, cursor in sent:
                    for write, row in rows_of(writes, await cursor.fetchall()):
                        rows[id(write)] = row
                        if row is not None:
                            write.counts(row, tx.tally)
                await tx.flush()
                if any(write.notify and rows[id(write)] is not None for write in batch):
                    await conn.execute(f"NOTIFY {READY_CHANNEL}")
        return rows

    def _sql(self, writes: list[Write]) -> tuple[str, Args]:
        """One write's own statement, or the one statement over arrays of many."""
        if len(writes) == 1:
            return writes[0].bare
        assert writes[0].shape is not None
        return self.store.shapes.sql(writes[0].shape), arrays_of([w.values for w in writes])


def statements_of(batch: list[Write]) -> list[list[Write]]:
    """The batch's statements: the writes of one shape together (one task each: a task
    written twice in a batch keeps its second write to itself), the others alone."""
    shaped: dict[Shape, list[Write]] = {}
    taken: dict[Shape, set[str]] = {}
    statements: list[list[Write]] = []
    for write in batch:
        if write.shape is None or write.order in taken.setdefault(write.shape, set()):
            statements.append([write])
            continue
        taken[write.shape].add(write.order)
        together = shaped.get(write.shape)
        if together is None:
            together = shaped[write.shape] = []
            statements.append(together)
        together.append(write)
    return statements


def rows_of(writes: list[Write], rows: list[Row]) -> list[tuple[Write, Row | None]]:
    """Each write with its row (None: it wrote nothing). A row of a statement over arrays
    is the one the write's own statement returns with the write's place in the arrays
    (from 1) before its last column (the event's seq)."""
    if len(writes) == 1:
        return [(writes[0], rows[0] if rows else None)]
    by_place = {row[-2]: (*row[:-2], row[-1]) for row in rows}
    return [(write, by_place.get(n)) for n, write in enumerate(writes, 1)]
