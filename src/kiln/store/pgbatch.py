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
    "id", "tenant", "kind", "priority", "ready_at", "params", "metadata", "inputs",
    "fingerprint", "idempotency_key", "dedup_key", "max_attempts", "deadline_s",
    "deadline_at", "timeouts", "created_at", "updated_at", "status_since", "webhook", "model",
    "batch_key", "rerun_of", "pipeline_id", "step", "step_copy",
)  # fmt: skip
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

    async def run(self, step: Write) -> Row | None:
        self.waiting.append(step)
        if self.draining is None or self.draining.done():
            self.draining = asyncio.create_task(self._drain(), name="kiln-pg-batch")
        return await step.future

    async def _drain(self) -> None:
        while self.waiting:
            batch, self.waiting = self.waiting[:BATCH_MAX], self.waiting[BATCH_MAX:]
            batch = [step for step in batch if not step.future.done()]  # a caller gave up
            if not batch:
                continue
            try:
                rows = await self._commit(sorted(batch, key=lambda s: s.order))
            except BaseException as exc:  # every waiter gets the failure
                for step in batch:
                    if not step.future.done():
                        step.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for step in batch:
                if not step.future.done():
                    step.future.set_result(rows[id(step)])

    async def _commit(self, batch: list[Write]) -> dict[int, Row | None]:
        self.batches += 1
        self.writes += len(batch)
        if len(batch) == 1:
            (step,) = batch
            sql, args = step.counted
            return {id(step): await self.store._statement(sql, args, notify=step.notify)}
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
        for step in batch:
            rows[id(step)] = None
            try:
                rows[id(step)] = await self.store._statement(*step.counted, notify=step.notify)
            except Exception as exc:
                step.future.set_exception(exc)
        return rows

    async def _together(self, batch: list[Write]) -> dict[int, Row | None]:
        rows: dict[int, Row | None] = {}
        statements = statements_of(batch)
        self.statements += len(statements)
        async with self.store._connection() as conn:
            if any(len(steps) > 1 for steps in statements):
                await self.store.shapes.read_types(conn)
            async with conn.pipeline() as round_trip, conn.transaction():
                sent = [(steps, await conn.execute(*self._sql(steps))) for steps in statements]
                await round_trip.sync()
                tx = PostgresTx(conn)
                for steps, cursor in sent:
                    for step, row in rows_of(steps, await cursor.fetchall()):
                        rows[id(step)] = row
                        if row is not None:
                            step.counts(row, tx.tally)
                await tx.flush()
                if any(step.notify and rows[id(step)] is not None for step in batch):
                    await conn.execute(f"NOTIFY {READY_CHANNEL}")
        return rows

    def _sql(self, steps: list[Write]) -> tuple[str, list[Any]]:
        """One step's own statement, or the one statement over arrays of many."""
        if len(steps) == 1:
            return steps[0].bare
        assert steps[0].shape is not None
        columns = zip(*(step.values for step in steps), strict=True)
        return self.store.shapes.sql(steps[0].shape), [[as_text(v) for v in c] for c in columns]


def statements_of(batch: list[Write]) -> list[list[Write]]:
    """The batch's statements: the steps of one shape together (one task each: a task
    stepped twice in a batch keeps its second step to itself), the others alone."""
    shaped: dict[str, list[Write]] = {}
    taken: dict[str, set[str]] = {}
    statements: list[list[Write]] = []
    for step in batch:
        if step.shape is None or step.order in taken.setdefault(step.shape, set()):
            statements.append([step])
            continue
        taken[step.shape].add(step.order)
        together = shaped.get(step.shape)
        if together is None:
            together = shaped[step.shape] = []
            statements.append(together)
        together.append(step)
    return statements


def rows_of(steps: list[Write], rows: list[Row]) -> list[tuple[Write, Row | None]]:
    """Each write with its row (None: it wrote nothing). A row of a statement over arrays
    is the one the write's own statement returns with the write's place in the arrays
    (from 1) before its last column (the event's seq)."""
    if len(steps) == 1:
        return [(steps[0], rows[0] if rows else None)]
    by_place = {row[-2]: (*row[:-2], row[-1]) for row in rows}
    return [(step, by_place.get(n)) for n, step in enumerate(steps, 1)]


def as_text(value: Any) -> str | None:
    """A value as the text PostgreSQL parses back to it (the arrays are cast from text)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # an int, or a float's shortest exact form
