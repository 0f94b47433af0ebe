"""One SQLite transaction as the store's operations see it: :class:`SqliteTx` on the
connection of the thread running it, the connection's tally of counter deltas (flushed
once per group commit), event rows in few INSERTs, SQLite's errors as the store's."""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kiln.counters import FAILURES_BY_MINUTE
from kiln.errors import StoreUnavailable
from kiln.models import TaskEvent
from kiln.store.queries import Queries, queries
from kiln.store.rows import TASK_COLUMNS, dumps
from kiln.store.tx import Args, Counting, EventRow, Row, Tally, violation

#: ``insert_task`` without reading the row back: the writer knows it (``inserted_row``).
INSERT_TASK = queries("sqlite").insert_task.removesuffix(" RETURNING *")
if queries("sqlite").insert_task == INSERT_TASK:
    raise RuntimeError("insert_task no longer ends in RETURNING *")


def check_task_columns(conn: sqlite3.Connection) -> None:
    found = tuple(row[1] for row in conn.execute("PRAGMA table_xinfo(tasks)"))
    if found != TASK_COLUMNS:
        raise RuntimeError(f"tasks columns {found} differ from TASK_COLUMNS {TASK_COLUMNS}")


class Connection(sqlite3.Connection):
    """A connection with a tally of counter deltas, flushed once per transaction.

    Status counts and event counters change on every transition; adding them up in
    memory and writing each distinct row once per group commit keeps them off the hot path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tally = Tally()
        self.ready = False  # an operation of this transaction made work claimable
        self.grouped = 0  # submissions written with others (kiln.store.sqlite_submits)


def kiln_connection(conn: sqlite3.Connection) -> Connection:
    assert isinstance(conn, Connection), "counters need a kiln.store.sqlite.Connection"
    return conn


def tally_of(conn: sqlite3.Connection) -> Tally:
    return kiln_connection(conn).tally


def flush_tally(conn: sqlite3.Connection, tally: Tally) -> None:
    """Write the summed counter deltas, one UPSERT per distinct row."""
    q = queries("sqlite")
    for table, sql in (("task_counts", q.add_status_count), ("counters", q.add_counter)):
        rows = tally.rows(table)
        if rows:
            conn.executemany(sql, rows)
    below = tally.stale_buckets()
    if below is not None:
        conn.execute(q.prune_counter, (FAILURES_BY_MINUTE, below))


#: The queries that take a list (``{IN_LIST}``): SQLite reads it as a JSON array.
_TAKES_LISTS = frozenset(sql for sql in queries("sqlite")._named.values() if "json_each(?)" in sql)


def _params(sql: str, args: Args) -> Args:
    if sql not in _TAKES_LISTS or not isinstance(args, Sequence):
        return args
    return [json.dumps(a) if type(a) is list else a for a in args]


def _translated(exc: sqlite3.DatabaseError) -> Exception:
    """SQLite's error as the store's: a constraint, or a database that failed (locked past
    ``busy_timeout``, damaged, out of disk)."""
    if not isinstance(exc, sqlite3.IntegrityError):
        return StoreUnavailable(f"the SQLite database failed: {exc}")
    unique = getattr(exc, "sqlite_errorname", "") == "SQLITE_CONSTRAINT_UNIQUE"
    return violation(str(exc), unique=unique)


#: Event rows one INSERT writes at most (a claim's rows: two a task).
EVENTS_AT_ONCE = 32


def _event_chunks(n: int) -> list[int]:
    """``n`` rows as INSERTs of powers of two, largest first (few statement texts)."""
    sizes = []
    while n:
        size = min(EVENTS_AT_ONCE, 1 << (n.bit_length() - 1))
        sizes.append(size)
        n -= size
    return sizes


@functools.cache
def rows_of(one: str, size: int) -> str:
    """``one``, an INSERT of one row of values (and what may follow them, such as its
    ``ON CONFLICT`` clause), with ``size`` rows of values."""
    start = one.index(" VALUES (") + len(" VALUES ")
    end = one.index(")", start) + 1
    return f"{one[:start]}{', '.join([one[start:end]] * size)}{one[end:]}"


def _event_values(r: EventRow) -> tuple[Any, ...]:
    """The ``insert_event`` parameters of one row."""
    task = r.task
    return (
        f"{task.id}:{r.version}",
        task.id,
        task.tenant,
        r.event.value,
        None if r.source is None else r.source.value,
        r.target.value,
        int(r.final),
        task.attempt,
        task.epoch,
        dumps(r.error),
        r.at,
        r.dwell_s,
        r.loading_s,
    )


class SqliteTx(Counting):
    """A :class:`~kiln.store.tx.Tx` on the connection of the thread running it."""

    __slots__ = ("conn", "q", "tally")

    def __init__(self, conn: sqlite3.Connection, q: Queries) -> None:
        self.conn = conn
        self.q = q
        self.tally = tally_of(conn)

    def _execute(self, sql: str, args: Args) -> sqlite3.Cursor:
        try:
            return self.conn.execute(sql, _params(sql, args))
        except sqlite3.DatabaseError as exc:
            raise _translated(exc) from None

    async def one(self, sql: str, args: Args = ()) -> Row | None:
        row: Row | None = self._execute(sql, args).fetchone()
        return row

    async def all(self, sql: str, args: Args = ()) -> list[Row]:
        return self._execute(sql, args).fetchall()

    async def run(self, sql: str, args: Args = ()) -> int:
        return self._execute(sql, args).rowcount

    async def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        try:
            return self.conn.executemany(sql, [_params(sql, r) for r in rows]).rowcount
        except sqlite3.DatabaseError as exc:
            raise _translated(exc) from None

    @contextlib.asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        self.conn.execute("SAVEPOINT nested")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK TO nested")
            self.conn.execute("RELEASE nested")
            raise
        self.conn.execute("RELEASE nested")

    async def insert_events(self, rows: Sequence[EventRow]) -> list[TaskEvent]:
        """The rows in as few INSERTs as :func:`_event_chunks` allows; the seqs of one
        INSERT's rows follow each other (AUTOINCREMENT, under the write lock), the last
        is its ``lastrowid``."""
        found: list[TaskEvent] = []
        start = 0
        for size in _event_chunks(len(rows)):
            chunk = rows[start : start + size]
            start += size
            values = [value for r in chunk for value in _event_values(r)]
            last = self.conn.execute(rows_of(self.q.insert_event, size), values).lastrowid
            assert last is not None
            found += [r.event_for(seq) for seq, r in enumerate(chunk, start=last - size + 1)]
        return found

    async def lock_tenant(self, tenant: str) -> bool:
        """The writer is serial: one claim at a time already."""
        return False

    async def notify_ready(self) -> None:
        """After the commit, the writer wakes the other processes' workers
        (:class:`~kiln.store.sqlite_share.Wakeups`)."""
        kiln_connection(self.conn).ready = True


__all__ = [
    "INSERT_TASK",
    "Connection",
    "SqliteTx",
    "check_task_columns",
    "flush_tally",
    "kiln_connection",
    "rows_of",
    "tally_of",
]
