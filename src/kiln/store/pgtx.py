"""A transaction of the PostgreSQL store: one connection, the counter deltas it adds at
commit (to one random shard), event rows inserted in one statement."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import psycopg
import psycopg.errors

from kiln.counters import FAILURES_BY_MINUTE
from kiln.models import TaskEvent
from kiln.store.claims import ADVISORY_CAPS
from kiln.store.queries import queries
from kiln.store.rows import dumps
from kiln.store.tx import Args, Counting, EventRow, Row, Tally, violation

Conn = psycopg.AsyncConnection[tuple[Any, ...]]
Q = queries("postgres")
COUNTER_SHARDS = 16
READY_CHANNEL = "kiln_ready"


def array_literal(values: Sequence[Any]) -> str | Sequence[Any]:
    """``values`` (strings, numbers, booleans, None) as the text of a PostgreSQL array
    (``{"a","b",NULL,1.5,true}``), for a parameter the statement casts (``::text[]``,
    ``::int[]``...): one C call, where psycopg escapes a list element by element. A value
    the two texts would read differently (a string with a control character) gets the
    list back, for psycopg to send."""
    text = json.dumps(values, ensure_ascii=False, separators=(",", ":"))
    # Both read \\ and \" alike; any other escape (\n, \u0001) they read differently.
    if "\\" in text.replace("\\\\", "").replace('\\"', ""):
        return values
    return f"{{{text[1:-1]}}}"


def translated(exc: psycopg.errors.IntegrityError) -> Exception:
    """A violated constraint as the store's own error."""
    return violation(str(exc), unique=isinstance(exc, psycopg.errors.UniqueViolation))


class PostgresTx(Counting):
    """A :class:`~kiln.store.tx.Tx` on one connection, with the counter deltas it adds to
    one random shard at commit."""

    __slots__ = ("conn", "notify", "tally")

    def __init__(self, conn: Conn, notify: Callable[[], bool] = lambda: False) -> None:
        self.conn = conn
        self.notify = notify
        self.tally = Tally()

    async def _execute(self, sql: str, args: Args) -> psycopg.AsyncCursor[Row]:
        try:
            return await self.conn.execute(sql, args)
        except psycopg.errors.IntegrityError as exc:
            raise translated(exc) from None

    async def one(self, sql: str, args: Args = ()) -> Row | None:
        return await (await self._execute(sql, args)).fetchone()

    async def all(self, sql: str, args: Args = ()) -> list[Row]:
        return await (await self._execute(sql, args)).fetchall()

    async def run(self, sql: str, args: Args = ()) -> int:
        return (await self._execute(sql, args)).rowcount

    async def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        changed = 0
        for row in rows:  # pipelined by psycopg would need a pipeline; these are few
            changed += max(0, (await self._execute(sql, row)).rowcount)
        return changed

    @contextlib.asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        async with self.conn.transaction():
            yield

    async def insert_events(self, rows: Sequence[EventRow]) -> list[TaskEvent]:
        """One statement; every caller has written before (so its transaction id exists
        before its seq numbers: see ``PostgresStore._log_after``)."""
        if not rows:
            return []
        ids = [f"{r.task.id}:{r.version}" for r in rows]
        columns: list[list[Any]] = [
            ids,
            [r.task.id for r in rows],
            [r.task.tenant for r in rows],
            [str(r.event) for r in rows],
            [None if r.source is None else str(r.source) for r in rows],
            [str(r.target) for r in rows],
            [r.final for r in rows],
            [r.task.attempt for r in rows],
            [r.task.epoch for r in rows],
            [dumps(r.error) for r in rows],
            [r.at for r in rows],
            [r.dwell_s for r in rows],
            [r.loading_s for r in rows],
        ]
        args = [array_literal(column) for column in columns]
        seqs = {event_id: seq for seq, event_id in await self.all(Q.insert_events, args)}
        return [r.event_for(seqs[event_id]) for event_id, r in zip(ids, rows, strict=True)]

    async def lock_tenant(self, tenant: str) -> bool:
        found = await self.one(Q.try_lock_tenant, (ADVISORY_CAPS, tenant))
        if found is not None and found[0]:
            return False
        await self.conn.execute(Q.lock_tenant, (ADVISORY_CAPS, tenant))
        return True

    async def notify_ready(self) -> None:
        if self.notify():
            await self.conn.execute(f"NOTIFY {READY_CHANNEL}")

    async def flush(self) -> None:
        """Add the deltas to one random shard, rows in a fixed order (no deadlocks)."""
        shard = random.randrange(COUNTER_SHARDS)
        for table, sql in (("task_counts", Q.add_status_counts), ("counters", Q.add_counters)):
            rows = self.tally.rows(table)
            if rows:
                a, b, n = zip(*rows, strict=True)
                await self.conn.execute(sql, (shard, list(a), list(b), list(n)))
        below = self.tally.stale_buckets()
        if below is not None:
            await self.conn.execute(Q.prune_counter, (FAILURES_BY_MINUTE, below))
