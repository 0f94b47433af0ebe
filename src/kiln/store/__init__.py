"""The store: tasks, their event log, idempotency keys, leaders, pools and the outbox.

One :class:`Store` holds the domain logic: the task lifecycle and its claims
(``sqlstore.py``, ``claims.py``) and each other concern as an object on it
(``store.schedules``, ``store.outbox``, ``store.pools``, ...), written once over a small
driver protocol (``tx.py``) and named queries (``queries.py``, ``sql/``). The drivers
keep only what differs: ``sqlite.py`` (writer thread, group commit) and ``postgres.py``
(pool, reconnects, LISTEN/NOTIFY, the gap-safe tail, one-statement paths). Policy
(which event applies, retry backoff) lives above, in the engine. Pick a driver by URL
with :func:`open_store`; the PostgreSQL driver is imported only then (``kiln[postgres]``).
"""

from __future__ import annotations

from kiln.counters import FAILURE_BUCKETS_KEPT_MIN, FAILURES_BY_MINUTE
from kiln.store.inputs import Deletion, InputPins
from kiln.store.records import (
    BreakerRecord,
    Change,
    Clock,
    Due,
    LeaderToken,
    Progress,
    Stats,
)
from kiln.store.schedules import ScheduleRecord, Tick, TickResult
from kiln.store.sqlstore import Store
from kiln.store.workers import WorkerRecord


def open_store(
    url: str,
    *,
    clock: Clock | None = None,
    synchronous: str = "FULL",
    pool_size: int = 10,
    submit_process: bool = False,
) -> Store:
    """Open the store a URL names: ``sqlite:///relative.db``, ``sqlite:////abs.db``,
    ``postgresql://user:password@host:5432/database``. ``submit_process``: SQLite writes
    plain submissions in a process of its own (:mod:`kiln.store.submit_process`)."""
    import time

    if url.startswith("sqlite:"):
        from kiln.store.sqlite import SqliteStore, sqlite_path

        return SqliteStore(
            sqlite_path(url),
            clock=clock or time.time,
            synchronous=synchronous,
            submit_process=submit_process,
        )
    if url.startswith(("postgresql:", "postgres:")):
        from kiln.store.postgres import PostgresStore

        return PostgresStore(url, clock=clock or time.time, pool_size=pool_size)
    raise ValueError(f"unsupported database URL {url!r}: use sqlite:///path.db or postgresql://...")


__all__ = [
    "FAILURES_BY_MINUTE",
    "FAILURE_BUCKETS_KEPT_MIN",
    "BreakerRecord",
    "Change",
    "Clock",
    "Deletion",
    "Due",
    "InputPins",
    "LeaderToken",
    "Progress",
    "ScheduleRecord",
    "Stats",
    "Store",
    "Tick",
    "TickResult",
    "WorkerRecord",
    "open_store",
]
