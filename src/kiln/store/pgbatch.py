"""The batch of one-statement writes of a PostgreSQL store's process.

Submissions without a key and workers' plain steps that arrive while a batch commits go
together into the next one: one transaction and one round trip (psycopg's pipeline mode). Writes of
one shape (submissions; steps that set the same columns) go as one statement over typed
arrays (``submit_many``, ``step_many``); each row is still its own compare-and-set with
its own event row, and a write whose row did not match gets no row back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
import psycopg.errors
from psycopg_pool import PoolTimeout

from kiln.errors import StoreUnavailable
from kiln.store.pgtx import READY_CHANNEL, Conn, PostgresTx, Q
from kiln.store.tx import Row, Tally

#: Writes one batch transaction takes at most.
BATCH_MAX = 256
#: The shape of submissions in a batch (a step's shape is the columns it sets).
SUBMIT_SHAPE = "submit"
#: The columns a submission sets (``insert_args``), for the typed arrays of ``submit_many``.
SUBMITTED = (
    "id",
    "tenant",
    "kind",
    "priority",
    "ready_at",
    "params",
    "metadata",
    "inputs",
    "fingerprint",
    "idempotency_key",
    "dedup_key",
    "max_attempts",
    "deadline_s",
    "deadline_at",
    "timeouts",
    "created_at",
    "updated_at",
    "status_since",
    "webhook",
    "model",
    "batch_key",
    "rerun_of",
    "pipeline_id",
    "step",
    "step_copy",
)
#: Appended to a step's shape when it ends an attempt (its ledger row goes with it).
USAGE_SHAPE = " +usage"
#: The types of the arrays a step that ends an attempt adds: pool, worker, outcome,
#: loading_s, share (``step_many_usage``).
USAGE_TYPES = ("text", "text", "text", "double precision", "double precision")
#: The tasks table's column types (for the typed arrays).
COLUMN_TYPES = (
    "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute"
    " WHERE attrelid = 'tasks'::regclass AND attnum > 0 AND NOT attisdropped"
)


class Host(Protocol):
    """What a batch needs of its store."""

    shapes: Shapes

    def _connection(self) -> contextlib.AbstractAsyncContextManager[Conn]: ...

    async def _statement(
        self, sql: str, args: Sequence[Any], *, notify: bool = False
    ) -> Row | None: ...

    async def _drop_broken(self) -> None: ...


class Shapes:
    """The statements over arrays, rendered once per shape from the columns' types."""

    def __init__(self) -> None:
        self._types: dict[str, str] = {}
        self._sql: dict[str, str] = {}

    async def read_types(self, conn: Conn) -> None:
        """Read the tasks table's column types once (before any ``step_many``)."""
        if not self._types:
            rows = await (await conn.execute(COLUMN_TYPES)).fetchall()
            self._types = {str(name): str(kind) for name, kind in rows}

    def sql(self, shape: str) -> str:
        """The statement over arrays of the writes of ``shape``: ``submit_many`` for
        submissions, ``step_many`` for steps that set the columns ``shape`` names."""
        if shape != SUBMIT_SHAPE:
            return self._steps(shape)
        sql = self._sql.get(shape)
        if sql is None:
            types = [self._types[column] for column in SUBMITTED] + ["text", "double precision"]
            arrays = ", ".join(f"%s::text[]::{kind}[]" for kind in types)
            sql = self._sql[shape] = Q.submit_many.replace("{arrays}", arrays)
        return sql

    def _steps(self, shape: str) -> str:
        """``step_many`` for steps that set ``sets`` (``col = %s, ...``, as ``step_rows``
        has them; the shape, without :data:`USAGE_SHAPE` when they end their attempts):
        each value becomes an array of the column's type."""
        sql = self._sql.get(shape)
        if sql is None:
            sets = shape.removesuffix(USAGE_SHAPE)
            usage = sets != shape
            types = ["text", "text", self._types["epoch"]]
            rendered: list[str] = []
            for clause in sets.split(", "):
                column = clause.split(" = ", 1)[0]
                if "%s" in clause:
                    types.append(self._types[column])
                    clause = clause.replace("%s", f"d.k_v{len(types) - 3}")
                rendered.append(clause)
            values = ", ".join(f"k_v{i}" for i in range(1, len(types) - 2))
            types += ["text", "text", "text", "boolean", "text", "double precision"]
            if usage:
                types += USAGE_TYPES
            arrays = ", ".join(f"%s::text[]::{kind}[]" for kind in types)
            columns = ", k_pool, k_worker, k_outcome, k_loading, k_share" if usage else ""
            sql = self._sql[shape] = (
                Q.step_many.replace("{arrays}", arrays)
                .replace("{values}", values)
                .replace("{sets}", ", ".join(rendered))
                .replace("{usage_columns}", columns)
                .replace("{usage}", f" {Q.step_many_usage}" if usage else "")
            )
        return sql


@dataclass(slots=True)
class Write:
    """One write of a batch: a statement whose row comes back when it wrote, the counts
    that row adds, and whether it makes work claimable (NOTIFY)."""

    order: str
    counted: tuple[str, list[Any]]  # the statement alone, counting itself (autocommit)
    bare: tuple[str, list[Any]]  # the statement in a batch, counted by the batch
    counts: Callable[[Row, Tally], None]
    notify: bool
    future: asyncio.Future[Row | None]
    #: Steps of one shape (the same SET columns) share one statement over arrays
    #: (``step_many``); ``values`` is this step's row of those arrays.
    shape: str | None = None
    values: list[Any] = field(default_factory=list)


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

    def _sql(self, writes: list[Write]) -> tuple[str, list[Any]]:
        """One write's own statement, or the one statement over arrays of many."""
        if len(writes) == 1:
            return writes[0].bare
        assert writes[0].shape is not None
        columns = zip(*(write.values for write in writes), strict=True)
        return self.store.shapes.sql(writes[0].shape), [[as_text(v) for v in c] for c in columns]


def statements_of(batch: list[Write]) -> list[list[Write]]:
    """The batch's statements: the writes of one shape together (one task each: a task
    written twice in a batch keeps its second write to itself), the others alone."""
    shaped: dict[str, list[Write]] = {}
    taken: dict[str, set[str]] = {}
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


def as_text(value: Any) -> str | None:
    """A value as the text PostgreSQL parses back to it (the arrays are cast from text)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # an int, or a float's shortest exact form
