"""SQLite store: WAL, stdlib ``sqlite3``, raw SQL, group commit.

All writes of a process go through one writer thread that drains its queue and runs what
it found in one ``BEGIN IMMEDIATE`` transaction, each operation in its own savepoint and
each still its own compare-and-set: concurrent workers share one commit (and one fsync
with ``synchronous=FULL``) without sharing fate. Reads run on a second thread with its
own connection; WAL lets them proceed while the writer commits. Other processes on the
same file serialize through SQLite's write lock (``busy_timeout``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kiln.errors import (
    Conflict,
    IdempotencyKeyReused,
    LeaseLost,
    NotFound,
    NotLeader,
    StoreUnavailable,
)
from kiln.limits import Rate, bucket_take
from kiln.models import JSON, NewTask, SubmitResult, Task, TaskEvent
from kiln.states import ACTIVE, CLAIMABLE, FINAL, Event, Status
from kiln.store import (
    FAILURE_BUCKETS_KEPT_MIN,
    FAILURES_BY_MINUTE,
    BreakerRecord,
    Change,
    Clock,
    Due,
    LeaderToken,
    Progress,
    Stats,
)
from kiln.store.breaker_sql import (
    BREAKERS_SQL,
    RESERVE_RETRY_SQL,
    SAVE_BREAKER_IF_DUE,
    SAVE_BREAKER_SQL,
)
from kiln.store.claims import (
    READY_TENANTS_SQL,
    Candidate,
    ClaimPolicy,
    ahead_args,
    ahead_sql,
    candidates,
    choose,
    fair_position,
    heads_sql,
    levels_sql,
    room,
    running_sql,
    tenant_depth_sql,
    turn,
)
from kiln.store.outbox import (
    CURSOR,
    DELIVERY_COLUMNS,
    PENDING,
    WebhookAttempt,
    WebhookDelivery,
    WebhookScan,
    delivery_from_row,
)
from kiln.store.pools import (
    POOL_USAGE_SQL,
    PoolUsage,
    PoolWait,
    decide,
    lines_sql,
    live_sql,
    peek,
    slot_rows,
    standing,
    units_needed,
)
from kiln.store.rows import (
    JSON_COLUMNS,
    TASK_COLUMNS,
    classify_due,
    dumps,
    dwell_percentiles,
    loads,
    purge_candidates,
    task_from_row,
)

log = logging.getLogger("kiln.store")

_RUNNING_SQL = "('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING')"
_CLAIMABLE_SQL = "('PENDING', 'RETRYING')"
_NOT_LIVE_SQL = "('FAILED', 'TIMEOUT', 'CANCELLED')"
_DEADLINE_SQL = "('PENDING', 'RETRYING', 'WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING')"
SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")
#: Ids per ``get_many`` statement, below SQLite's smallest bound-parameter limit (999).
GET_MANY_CHUNK = 500

# The queries whose cost must follow what they find, not the table size; the conformance
# suite checks each one's query plan against these very strings.

#: Claim candidates of one kind, in claim order: (kind, now, now, limit).
CLAIM_CANDIDATES_SQL = (
    "SELECT id, priority, ready_at, status, status_since, version FROM tasks"
    f" WHERE kind = ? AND status IN {_CLAIMABLE_SQL} AND ready_at <= ?"
    " AND deadline_at > ? ORDER BY priority DESC, ready_at, id LIMIT ?"
)
#: The live or successful task holding a dedup key: (tenant, dedup_key).
DEDUP_LOOKUP_SQL = (
    f"SELECT * FROM tasks WHERE tenant = ? AND dedup_key = ? AND status NOT IN {_NOT_LIVE_SQL}"
)
#: Due tasks of one kind claimed before this one: (kind, now, now, priority, priority,
#: ready_at, ready_at, id).
QUEUE_AHEAD_SQL = (
    "SELECT COUNT(*) FROM tasks WHERE kind = ?"
    f" AND status IN {_CLAIMABLE_SQL} AND ready_at <= ? AND deadline_at > ?"
    " AND (priority > ? OR (priority = ? AND (ready_at < ?"
    " OR (ready_at = ? AND id < ?))))"
)
#: Supervisor sweep, one query per reason: (now or cutoff, limit).
DUE_SQL = "SELECT * FROM tasks WHERE due_at < ? ORDER BY due_at LIMIT ?"
DUE_CANCEL_SQL = (
    "SELECT * FROM tasks WHERE cancel_requested = 1"
    f" AND status IN {_RUNNING_SQL} AND cancel_requested_at < ?"
    " ORDER BY cancel_requested_at LIMIT ?"
)
#: The time spent in each status over the latest transitions: (window) or (tenant, window).
DWELL_WINDOW = 10_000
DWELL_SQL = "SELECT from_status, dwell_s FROM events ORDER BY seq DESC LIMIT ?"
DWELL_TENANT_SQL = (
    "SELECT from_status, dwell_s FROM events WHERE tenant = ? ORDER BY seq DESC LIMIT ?"
)
#: Running tasks whose lease lapsed before a cutoff: (cutoff).
GHOSTS_SQL = (
    f"SELECT COUNT(*) FROM tasks WHERE due_at < ? AND status IN {_RUNNING_SQL}"
    " AND lease_expires_at < ?"
)
#: Webhook deliveries due, each the first pending one of its task: (pending, now,
#: pending, limit).
WEBHOOK_DUE_SQL = (
    f"SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries d WHERE status = ?"
    " AND next_attempt_at <= ? AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p"
    " WHERE p.task_id = d.task_id AND p.status = ? AND p.seq < d.seq)"
    " ORDER BY next_attempt_at, seq LIMIT ?"
)


def sqlite_path(url: str) -> str:
    """``sqlite:///rel.db`` → ``rel.db``; ``sqlite:////abs.db`` → ``/abs.db``."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r} (expected sqlite:///path.db)")
    path = url.removeprefix("sqlite:///").split("?", 1)[0]
    if not path:
        raise ValueError(f"sqlite URL without a path: {url!r}")
    return path


def connect(path: str, *, synchronous: str = "NORMAL") -> sqlite3.Connection:
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=30.0, factory=Connection
    )
    conn.row_factory = sqlite3.Row
    _use_wal(conn)
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute("PRAGMA temp_store=MEMORY")
    return conn


def _use_wal(conn: sqlite3.Connection) -> None:
    """Switch to WAL once per file. Switching needs a lock that SQLite does not wait for
    when another connection opens the same new file at that moment, so retry briefly."""
    for attempt in range(50):
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                return
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if attempt == 49:
                raise
            time.sleep(0.01 * (attempt + 1))


# Migrations ------------------------------------------------------------------------------


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every numbered migration file, in order."""
    folder = resources.files("kiln.store").joinpath("sql", "sqlite")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text(encoding="utf-8")))
    return sorted(found)


def migrate(conn: sqlite3.Connection) -> int:
    """Apply pending migrations, each in its own transaction; safe across processes."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
    )
    applied = 0
    for version, name, sql in migrations():
        conn.execute("BEGIN IMMEDIATE")
        try:
            done = conn.execute(
                "SELECT 1 FROM schema_migrations WHERE version = ?", (version,)
            ).fetchone()
            if done is None:
                for statement in _statements(sql):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations VALUES (?, ?, datetime('now'))",
                    (version, name),
                )
                applied += 1
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return applied


def _statements(script: str) -> Iterable[str]:
    buffer = ""
    for line in script.splitlines(keepends=True):
        if line.lstrip().startswith("--"):
            continue
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer.strip()
            buffer = ""
    if buffer.strip():
        yield buffer.strip()


# The database threads ---------------------------------------------------------------------


@dataclass(slots=True)
class _Refused:
    """An operation's answer that must be raised, after its own writes are committed."""

    error: Exception


@dataclass(slots=True)
class _Job:
    fn: Callable[[sqlite3.Connection], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


def _resolve(items: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, error in items:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        elif isinstance(result, _Refused):
            future.set_exception(result.error)
        else:
            future.set_result(result)


class _DbThread(threading.Thread):
    """Runs queued operations on its own connection; the writer batches them."""

    def __init__(
        self, name: str, open_conn: Callable[[], sqlite3.Connection], *, writer: bool
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._open_conn = open_conn
        self._writer = writer
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.max_batch = 512
        self.batches = 0
        self.operations = 0

    def put(self, job: _Job | None) -> None:
        self._jobs.put(job)

    def run(self) -> None:
        conn = self._open_conn()
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                batch = [job]
                stop = False
                while len(batch) < self.max_batch:
                    try:
                        more = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                        break
                    batch.append(more)
                self._run(conn, batch)
                if stop:
                    return
        finally:
            conn.close()

    def _run(self, conn: sqlite3.Connection, batch: list[_Job]) -> None:
        self.batches += 1
        self.operations += len(batch)
        outcomes: list[tuple[_Job, Any, BaseException | None]]
        if self._writer:
            try:
                outcomes = self._run_transaction(conn, batch)
            except Exception as exc:  # the transaction itself broke: fail the whole batch
                log.exception("sqlite_batch_failed", extra={"operations": len(batch)})
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                outcomes = [(job, None, exc) for job in batch]
        else:
            outcomes = []
            for job in batch:
                try:
                    outcomes.append((job, job.fn(conn), None))
                except Exception as exc:
                    outcomes.append((job, None, exc))
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for job, result, error in outcomes:
            by_loop.setdefault(job.loop, []).append((job.future, result, error))
        for loop, items in by_loop.items():
            # RuntimeError: the caller's loop is closed, and nobody waits for the answer.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, items)

    @staticmethod
    def _run_transaction(
        conn: sqlite3.Connection, batch: list[_Job]
    ) -> list[tuple[_Job, Any, BaseException | None]]:
        outcomes: list[tuple[_Job, Any, BaseException | None]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            return [(job, None, exc) for job in batch]
        tally = _tally(conn)
        committed: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for job in batch:
            conn.execute("SAVEPOINT op")
            tally.clear()
            try:
                result = job.fn(conn)
            except Exception as exc:
                conn.execute("ROLLBACK TO op")  # the operation's counts go with it
                conn.execute("RELEASE op")
                outcomes.append((job, None, exc))
                continue
            conn.execute("RELEASE op")
            committed.update(tally)
            outcomes.append((job, result, None))
        tally.clear()
        try:
            flush_tally(conn, committed)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            return [(job, None, exc) for job in batch]
        return outcomes


# Row mapping ------------------------------------------------------------------------------


def check_task_columns(conn: sqlite3.Connection) -> None:
    found = tuple(row[1] for row in conn.execute("PRAGMA table_xinfo(tasks)"))
    if found != TASK_COLUMNS:
        raise RuntimeError(f"tasks columns {found} differ from TASK_COLUMNS {TASK_COLUMNS}")


def event_from_row(row: sqlite3.Row) -> TaskEvent:
    return TaskEvent(
        seq=row["seq"],
        id=row["id"],
        task_id=row["task_id"],
        tenant=row["tenant"],
        event=Event(row["event"]),
        from_status=None if row["from_status"] is None else Status(row["from_status"]),
        status=Status(row["to_status"]),
        attempt=row["attempt"],
        epoch=row["epoch"],
        error=loads(row["error"]),
        at=row["at"],
        dwell_s=row["dwell_s"],
        final=bool(row["final"]),
    )


def _append_event(
    conn: sqlite3.Connection,
    *,
    task: Task,
    version: int,
    event: Event,
    source: Status | None,
    target: Status,
    error: JSON | None,
    at: float,
    dwell_s: float | None,
    final: bool = False,
) -> TaskEvent:
    task_id, tenant, attempt, epoch = task.id, task.tenant, task.attempt, task.epoch
    row = conn.execute(
        "INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
        " attempt, epoch, error, at, dwell_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " RETURNING seq",
        (
            f"{task_id}:{version}",
            task_id,
            tenant,
            str(event),
            None if source is None else str(source),
            str(target),
            int(final),
            attempt,
            epoch,
            dumps(error),
            at,
            dwell_s,
        ),
    ).fetchone()
    return TaskEvent(
        seq=row[0],
        id=f"{task_id}:{version}",
        task_id=task_id,
        tenant=tenant,
        event=event,
        from_status=source,
        status=target,
        attempt=attempt,
        epoch=epoch,
        error=error,
        at=at,
        dwell_s=dwell_s,
        final=final,
    )


class Connection(sqlite3.Connection):
    """A connection with a tally of counter deltas, flushed once per transaction.

    Status counts and event counters change on every transition; adding them up in
    memory and writing each distinct row once per group commit keeps them off the hot path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tally: collections.Counter[tuple[str, str, str]] = collections.Counter()


def _count_status(conn: sqlite3.Connection, tenant: str, status: Status, delta: int) -> None:
    _tally(conn)[("task_counts", tenant, str(status))] += delta


def _bump(conn: sqlite3.Connection, name: str, labels: str = "", delta: int = 1) -> None:
    _tally(conn)[("counters", name, labels)] += delta


def _tally(conn: sqlite3.Connection) -> collections.Counter[tuple[str, str, str]]:
    assert isinstance(conn, Connection), "counters need a kiln.store.sqlite.Connection"
    return conn.tally


_FLUSH_SQL = {
    "task_counts": "INSERT INTO task_counts (tenant, status, n) VALUES (?, ?, ?)"
    " ON CONFLICT (tenant, status) DO UPDATE SET n = n + excluded.n",
    "counters": "INSERT INTO counters (name, labels, n) VALUES (?, ?, ?)"
    " ON CONFLICT (name, labels) DO UPDATE SET n = n + excluded.n",
}


def flush_tally(conn: sqlite3.Connection, tally: collections.Counter[tuple[str, str, str]]) -> None:
    """Write the summed counter deltas, one UPSERT per distinct row."""
    for table, sql in _FLUSH_SQL.items():
        rows = [(a, b, n) for (t, a, b), n in tally.items() if t == table and n]
        if rows:
            conn.executemany(sql, rows)
    buckets = [b for (t, a, b) in tally if t == "counters" and a == FAILURES_BY_MINUTE]
    if buckets:  # keep a day of per-minute failure buckets
        newest = int(max(buckets).split(":", 1)[0])
        conn.execute(
            "DELETE FROM counters WHERE name = ? AND labels < ?",
            (FAILURES_BY_MINUTE, f"{newest - FAILURE_BUCKETS_KEPT_MIN:010d}:"),
        )


def _policy_candidates(
    conn: sqlite3.Connection,
    kinds: list[str],
    limit: int,
    policy: ClaimPolicy,
    now: float,
    turn_no: int,
) -> list[Candidate]:
    """What a claim under ``policy`` takes (kiln/store/claims.py), in claim order."""
    lines: list[str | None] = [None]
    rooms: dict[str, int | None] = {}
    tenants: list[str] = []
    if policy.by_tenant:
        tenants = turn([r[0] for r in conn.execute(READY_TENANTS_SQL)], turn_no)
        capped = [t for t in tenants if policy.cap(t) is not None]
        running: dict[str, int] = {}
        if capped:
            running = dict(conn.execute(running_sql("?", len(capped)), capped).fetchall())
        rooms = room(policy, tenants, running)
        lines = [t for t in tenants if rooms[t] != 0]
    found: list[Candidate] = []
    for kind in kinds:
        for tenant in lines:
            key: tuple[str, ...] = (kind,) if tenant is None else (kind, tenant)
            spare = rooms.get(tenant) if tenant is not None else None
            take = limit if spare is None else min(limit, spare)
            by_tenant = tenant is not None
            if policy.aging_s is None:
                sql = heads_sql("?", tenant=by_tenant, level=False)
                found += candidates(conn.execute(sql, (*key, now, now, take)))
                continue
            levels = conn.execute(levels_sql("?", tenant=by_tenant), (*key, *key)).fetchall()
            sql = heads_sql("?", tenant=by_tenant, level=True)
            for (level,) in levels:
                found += candidates(conn.execute(sql, (*key, level, now, now, take)))
    return choose(found, limit, policy, rooms, tenants)


# The store ------------------------------------------------------------------------------


class SqliteStore:
    """The embedded default store. See the module docstring for its threading model."""

    def __init__(self, path: str, *, clock: Clock, synchronous: str = "NORMAL") -> None:
        synchronous = synchronous.upper()
        if synchronous not in SYNCHRONOUS_LEVELS:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_LEVELS}")
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.clock = clock
        self.synchronous = synchronous
        setup = connect(path, synchronous=synchronous)
        try:
            migrate(setup)
            check_task_columns(setup)
        finally:
            setup.close()
        self._writer = _DbThread(
            "kiln-sqlite-writer", lambda: connect(path, synchronous=synchronous), writer=True
        )
        self._reader = _DbThread(
            "kiln-sqlite-reader", lambda: connect(path, synchronous=synchronous), writer=False
        )
        self._writer.start()
        self._reader.start()
        self._closed = False
        self._claim_turn = 0

    # plumbing

    async def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return await self._submit_to(self._writer, fn)

    async def _read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return await self._submit_to(self._reader, fn)

    @staticmethod
    async def _submit_to(thread: _DbThread, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        if not thread.is_alive():
            raise StoreUnavailable(f"the store's {thread.name} thread is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        thread.put(_Job(fn, loop, future))
        return await future

    @property
    def write_batches(self) -> tuple[int, int]:
        """(transactions, operations) the writer has committed so far."""
        return self._writer.batches, self._writer.operations

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.put(None)
        self._reader.put(None)
        await asyncio.to_thread(self._writer.join)
        await asyncio.to_thread(self._reader.join)

    # submission

    async def submit(self, new: NewTask) -> SubmitResult:
        result: SubmitResult = await self._write(lambda conn: self._submit(conn, new))
        return result

    def _submit(self, conn: sqlite3.Connection, new: NewTask) -> SubmitResult | _Refused:
        now = self.clock()
        if new.idempotency_key is not None:
            row = conn.execute(
                "SELECT fingerprint, task_id FROM idempotency_keys WHERE tenant = ? AND key = ?",
                (new.tenant, new.idempotency_key),
            ).fetchone()
            if row is not None:
                if row["fingerprint"] != new.fingerprint:
                    return _Refused(
                        IdempotencyKeyReused(
                            "this Idempotency-Key was used with a different request body"
                        )
                    )
                task = self._get(conn, row["task_id"])
                if task is not None:
                    _bump(conn, "dedup_hits", "idempotency")
                    return SubmitResult(task, created=False, replayed=True)
        if new.dedup_key is not None:
            row = conn.execute(DEDUP_LOOKUP_SQL, (new.tenant, new.dedup_key)).fetchone()
            if row is not None:
                existing = task_from_row(row)
                self._remember_key(conn, new, existing.id, now)
                _bump(conn, "dedup_hits", "content")
                return SubmitResult(existing, created=False, deduplicated=True)
        task = self._insert(conn, new, now)
        self._remember_key(conn, new, task.id, now)
        return SubmitResult(task, created=True)

    @staticmethod
    def _remember_key(conn: sqlite3.Connection, new: NewTask, task_id: str, now: float) -> None:
        if new.idempotency_key is None:
            return
        conn.execute(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, task_id, created_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, key) DO UPDATE SET"
            " fingerprint = excluded.fingerprint, task_id = excluded.task_id,"
            " created_at = excluded.created_at",
            (new.tenant, new.idempotency_key, new.fingerprint, task_id, now),
        )

    @staticmethod
    def _insert(conn: sqlite3.Connection, new: NewTask, now: float) -> Task:
        timeouts = {
            "waiting_s": new.timeouts.waiting_s,
            "generating_s": new.timeouts.generating_s,
            "uploading_s": new.timeouts.uploading_s,
        }
        row = conn.execute(
            "INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata,"
            " inputs, fingerprint, idempotency_key, dedup_key, max_attempts, deadline_s,"
            " deadline_at, timeouts, created_at, updated_at, status_since, webhook)"
            " VALUES (?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " RETURNING *",
            (
                new.id,
                new.tenant,
                new.kind,
                new.priority,
                now,
                dumps(new.params),
                dumps(new.metadata),
                dumps(new.inputs),
                new.fingerprint,
                new.idempotency_key,
                new.dedup_key,
                new.max_attempts,
                new.deadline_s,
                now + new.deadline_s,
                dumps(timeouts),
                now,
                now,
                now,
                dumps(new.webhook),
            ),
        ).fetchone()
        task = task_from_row(row)
        _append_event(
            conn,
            task=task,
            version=1,
            event=Event.SUBMIT,
            source=None,
            target=Status.PENDING,
            error=None,
            at=now,
            dwell_s=None,
        )
        _count_status(conn, new.tenant, Status.PENDING, 1)
        return task

    # reads

    async def get(self, task_id: str) -> Task | None:
        task: Task | None = await self._read(lambda conn: self._get(conn, task_id))
        return task

    @staticmethod
    def _get(conn: sqlite3.Connection, task_id: str) -> Task | None:
        row = conn.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return None if row is None else task_from_row(row)

    async def get_many(self, task_ids: Sequence[str]) -> dict[str, Task]:
        ids = sorted(set(task_ids))

        def read(conn: sqlite3.Connection) -> dict[str, Task]:
            found: dict[str, Task] = {}
            for start in range(0, len(ids), GET_MANY_CHUNK):
                chunk = ids[start : start + GET_MANY_CHUNK]
                marks = ", ".join("?" * len(chunk))
                for row in conn.execute(f"SELECT * FROM tasks WHERE id IN ({marks})", chunk):
                    task = task_from_row(row)
                    found[task.id] = task
            return found

        tasks: dict[str, Task] = await self._read(read) if ids else {}
        return tasks

    async def list_tasks(
        self,
        *,
        tenant: str | None,
        status: Status | None = None,
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Task], str | None]:
        where: list[str] = []
        args: list[Any] = []
        for column, value in (("tenant", tenant), ("status", status), ("kind", kind)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(str(value))
        if cursor is not None:
            where.append("id < ?")
            args.append(cursor)
        sql = "SELECT * FROM tasks"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT ?"
        args.append(limit + 1)

        def read(conn: sqlite3.Connection) -> list[Task]:
            return [task_from_row(row) for row in conn.execute(sql, args).fetchall()]

        tasks: list[Task] = await self._read(read)
        next_cursor = tasks[limit - 1].id if len(tasks) > limit else None
        return tasks[:limit], next_cursor

    async def events(
        self,
        *,
        task_id: str | None = None,
        tenant: str | None = None,
        after: int = 0,
        limit: int = 500,
    ) -> list[TaskEvent]:
        if task_id is not None:
            sql, args = "SELECT * FROM events WHERE task_id = ? AND seq > ?", [task_id, after]
        elif tenant is not None:
            sql, args = "SELECT * FROM events WHERE tenant = ? AND seq > ?", [tenant, after]
        else:
            sql, args = "SELECT * FROM events WHERE seq > ?", [after]
        sql += " ORDER BY seq LIMIT ?"
        args.append(limit)

        def read(conn: sqlite3.Connection) -> list[TaskEvent]:
            return [event_from_row(row) for row in conn.execute(sql, args).fetchall()]

        found: list[TaskEvent] = await self._read(read)
        return found

    async def last_seq(self) -> int:
        def read(conn: sqlite3.Connection) -> int:
            return int(conn.execute("SELECT coalesce(MAX(seq), 0) FROM events").fetchone()[0])

        seq: int = await self._read(read)
        return seq

    async def tail(self, *, after: int, limit: int = 1000) -> list[TaskEvent]:
        """One writer commits in seq order, so the log has no gaps to wait out."""
        return await self.events(after=after, limit=limit)

    def watch_ready(self, callback: Callable[[], None]) -> None:
        """Workers in other processes on the same file find new work by polling."""

    async def progressed(self, *, since: float, limit: int = 500) -> list[Task]:
        def read(conn: sqlite3.Connection) -> list[Task]:
            rows = conn.execute(
                "SELECT * FROM tasks WHERE progress_at > ? ORDER BY progress_at LIMIT ?",
                (since, limit),
            ).fetchall()
            return [task_from_row(row) for row in rows]

        found: list[Task] = await self._read(read)
        return found

    async def queue_position(self, task: Task, policy: ClaimPolicy | None = None) -> int | None:
        now = self.clock()
        if task.status not in CLAIMABLE or task.ready_at > now or task.deadline_at <= now:
            return None
        aging_s = None if policy is None else policy.aging_s

        def read(conn: sqlite3.Connection) -> int:
            def count(sql: str, args: Sequence[Any]) -> int:
                return int(conn.execute(sql, tuple(args)).fetchone()[0])

            def ahead(tenant: str | None) -> int:
                if aging_s is None:
                    sql = QUEUE_AHEAD_SQL if tenant is None else ahead_sql("?", tenant=True,
                                                                          level=False)  # fmt: skip
                    return count(sql, ahead_args(task.kind, tenant, None, task, now, None))
                key = (task.kind,) if tenant is None else (task.kind, tenant)
                levels = conn.execute(levels_sql("?", tenant=tenant is not None), (*key, *key))
                sql = ahead_sql("?", tenant=tenant is not None, level=True)
                return sum(count(sql, ahead_args(task.kind, tenant, level, task, now, aging_s))
                           for (level,) in levels.fetchall())  # fmt: skip

            if policy is None or not policy.fair:
                return ahead(None) + 1
            own = ahead(task.tenant) + 1
            others = [r[0] for r in conn.execute(READY_TENANTS_SQL) if r[0] != task.tenant]
            depth = tenant_depth_sql("?")
            return fair_position(
                own, [count(depth, (task.kind, t, now, now, own - 1)) for t in others]
            )

        position: int = await self._read(read)
        return position

    # worker writes

    async def claim(
        self,
        *,
        worker_id: str,
        kinds: list[str],
        limit: int,
        lease_ttl_s: float,
        policy: ClaimPolicy | None = None,
    ) -> list[Task]:
        if not kinds or limit <= 0:
            return []
        self._claim_turn += 1
        turn_no = self._claim_turn
        claimed: list[Task] = await self._write(
            lambda conn: self._claim(conn, worker_id, kinds, limit, lease_ttl_s, policy, turn_no)
        )
        return claimed

    def _claim(
        self,
        conn: sqlite3.Connection,
        worker_id: str,
        kinds: list[str],
        limit: int,
        lease_ttl_s: float,
        policy: ClaimPolicy | None = None,
        turn_no: int = 0,
    ) -> list[Task]:
        now = self.clock()
        chosen: list[tuple[str, str, float]]
        if policy is None or policy.plain:
            rows: list[sqlite3.Row] = []
            for kind in kinds:
                rows += conn.execute(CLAIM_CANDIDATES_SQL, (kind, now, now, limit)).fetchall()
            rows.sort(key=lambda r: (-r["priority"], r["ready_at"], r["id"]))
            chosen = [(r["id"], r["status"], r["status_since"]) for r in rows[:limit]]
        else:
            picked = _policy_candidates(conn, kinds, limit, policy, now, turn_no)
            chosen = [(c.id, c.status, c.status_since) for c in picked]
        claimed: list[Task] = []
        for cand_id, cand_status, cand_since in chosen:
            row = conn.execute(
                "UPDATE tasks SET status = 'WAITING_FOR_RESOURCE', attempt = attempt + 1,"
                " epoch = epoch + 1, version = version + 1, lease_owner = ?,"
                " lease_expires_at = ?, state_deadline_at = ? + json_extract(timeouts,"
                " '$.waiting_s'), started_at = coalesce(started_at, ?), updated_at = ?,"
                " status_since = ?, next_retry_at = NULL, stage = NULL, progress_step = NULL,"
                " progress_total = NULL, progress_at = NULL,"
                " result_prefix = 'tasks/' || id || '/' || (attempt + 1) || '-' || (epoch + 1)"
                f" WHERE id = ? AND status IN {_CLAIMABLE_SQL} RETURNING *",
                (worker_id, now + lease_ttl_s, now, now, now, now, cand_id),
            ).fetchone()
            if row is None:
                continue
            task = task_from_row(row)
            source = Status(cand_status)
            _append_event(
                conn,
                task=task,
                version=task.version,
                event=Event.CLAIM,
                source=source,
                target=Status.WAITING_FOR_RESOURCE,
                error=None,
                at=now,
                dwell_s=now - cand_since,
            )
            if log.isEnabledFor(logging.INFO):
                log.info("transition", extra={
                    "task_id": task.id, "attempt": task.attempt, "epoch": task.epoch,
                    "from": str(source), "to": str(task.status), "event": "claim",
                    "duration_s": now - cand_since, "worker": worker_id,
                })  # fmt: skip
            _count_status(conn, task.tenant, source, -1)
            _count_status(conn, task.tenant, Status.WAITING_FOR_RESOURCE, 1)
            _bump(conn, "transitions", f"{source}>{Status.WAITING_FOR_RESOURCE}")
            claimed.append(task)
        return claimed

    async def heartbeat(
        self, task_id: str, epoch: int, lease_ttl_s: float, progress: Progress | None
    ) -> Task:
        task: Task = await self._write(
            lambda conn: self._heartbeat(conn, task_id, epoch, lease_ttl_s, progress)
        )
        return task

    def _heartbeat(
        self,
        conn: sqlite3.Connection,
        task_id: str,
        epoch: int,
        lease_ttl_s: float,
        progress: Progress | None,
    ) -> Task | _Refused:
        now = self.clock()
        sets = "lease_expires_at = ?, updated_at = ?"
        args: list[Any] = [now + lease_ttl_s, now]
        if progress is not None:
            sets += ", stage = ?, progress_step = ?, progress_total = ?, progress_at = ?"
            args += [progress.stage, progress.step, progress.total, now]
        row = conn.execute(
            f"UPDATE tasks SET {sets} WHERE id = ? AND epoch = ?"
            f" AND status IN {_RUNNING_SQL} RETURNING *",
            [*args, task_id, epoch],
        ).fetchone()
        if row is None:
            _bump(conn, "stale_writes")
            return _Refused(LeaseLost(f"task {task_id} is no longer held at epoch {epoch}"))
        _bump(conn, "lease_renewals")
        return task_from_row(row)

    async def request_cancel(self, task_id: str) -> Task:
        task: Task = await self._write(lambda conn: self._request_cancel(conn, task_id))
        return task

    def _request_cancel(self, conn: sqlite3.Connection, task_id: str) -> Task | _Refused:
        now = self.clock()
        row = conn.execute(
            "UPDATE tasks SET cancel_requested = 1, cancel_requested_at = coalesce("
            "cancel_requested_at, ?), updated_at = ?"
            f" WHERE id = ? AND status IN {_RUNNING_SQL} RETURNING *",
            (now, now, task_id),
        ).fetchone()
        if row is None:
            return _Refused(Conflict(f"task {task_id} is not running"))
        return task_from_row(row)

    # the fenced compare-and-set

    async def apply(self, change: Change) -> tuple[Task, list[TaskEvent]]:
        applied: tuple[Task, list[TaskEvent]] = await self._write(
            lambda conn: self._apply_atomically(conn, change)
        )
        return applied

    def _apply_atomically(
        self, conn: sqlite3.Connection, change: Change
    ) -> tuple[Task, list[TaskEvent]] | _Refused:
        try:
            return self._apply(conn, change)
        except sqlite3.IntegrityError as exc:
            # Raised, not returned: the operation's savepoint rolls back as a whole, so a
            # status change never lands without its event row (I6).
            raise Conflict(f"task {change.task_id} changed concurrently: {exc}") from None

    def _apply(
        self, conn: sqlite3.Connection, change: Change
    ) -> tuple[Task, list[TaskEvent]] | _Refused:
        now = self.clock()
        if change.leader is not None and not self._holds(conn, change.leader, now):
            return _Refused(NotLeader(f"{change.leader.owner} no longer leads"))
        current = conn.execute(
            "SELECT status, epoch, version, status_since, tenant FROM tasks WHERE id = ?",
            (change.task_id,),
        ).fetchone()
        refused = self._refusal(conn, change, current)
        if refused is not None:
            return refused
        target = change.steps[-1][1]
        sets = ["status = ?", "version = version + ?", "updated_at = ?", "status_since = ?"]
        args: list[Any] = [str(target), len(change.steps), now, now]
        if change.bump_epoch:
            sets.append("epoch = epoch + 1")
        if target in FINAL and "finished_at" not in change.fields:
            sets.append("finished_at = ?")
            args.append(now)
        for column, value in change.fields.items():
            sets.append(f"{column} = ?")
            args.append(dumps(value) if column in JSON_COLUMNS else value)
        where = "id = ? AND status = ?"
        args += [change.task_id, str(change.expect_status)]
        if change.expect_epoch is not None:
            where += " AND epoch = ?"
            args.append(change.expect_epoch)
        try:
            row = conn.execute(
                f"UPDATE tasks SET {', '.join(sets)} WHERE {where} RETURNING *", args
            ).fetchone()
        except sqlite3.IntegrityError:
            # A revived task whose content another live task holds by now gives up its
            # dedup key: that other task stays the one that dedup answers with (I5).
            row = conn.execute(
                f"UPDATE tasks SET {', '.join(sets)}, dedup_key = NULL WHERE {where} RETURNING *",
                args,
            ).fetchone()
        task = task_from_row(row)
        events = []
        source: Status = change.expect_status
        dwell: float = now - current["status_since"]
        for offset, (event, step_target) in enumerate(change.steps, start=1):
            events.append(
                _append_event(
                    conn,
                    task=task,
                    version=current["version"] + offset,
                    event=event,
                    source=source,
                    target=step_target,
                    error=change.error,
                    at=now,
                    dwell_s=dwell,
                    final=offset == len(change.steps) and step_target in FINAL,
                )
            )
            _bump(conn, "transitions", f"{source}>{step_target}")
            source, dwell = step_target, 0.0
        _count_status(conn, task.tenant, change.expect_status, -1)
        _count_status(conn, task.tenant, target, 1)
        for name, labels in change.counters:
            _bump(conn, name, labels)
        return task, events

    @staticmethod
    def _refusal(
        conn: sqlite3.Connection, change: Change, current: sqlite3.Row | None
    ) -> _Refused | None:
        if current is None:
            return _Refused(NotFound(f"task {change.task_id} does not exist"))
        if current["status"] == change.expect_status and (
            change.expect_epoch is None or current["epoch"] == change.expect_epoch
        ):
            return None
        if change.fenced:
            _bump(conn, "stale_writes")
            return _Refused(
                LeaseLost(f"task {change.task_id} moved on (now {current['status']}, "
                          f"epoch {current['epoch']})")
            )  # fmt: skip
        return _Refused(
            Conflict(f"task {change.task_id} is {current['status']}, "
                     f"not {change.expect_status}")
        )  # fmt: skip

    # supervisor

    async def due(self, *, limit: int, cancel_grace_s: float) -> Due:
        now = self.clock()

        def read(conn: sqlite3.Connection) -> Due:
            def rows(sql: str, cutoff: float) -> list[Task]:
                found = conn.execute(sql, (cutoff, limit)).fetchall()
                return [task_from_row(row) for row in found]

            due = Due([], [], [], rows(DUE_CANCEL_SQL, now - cancel_grace_s))
            for task in rows(DUE_SQL, now):
                classify_due(task, now, due)
            return due

        due: Due = await self._read(read)
        return due

    async def count_ghosts(self, *, older_than_s: float) -> int:
        before = self.clock() - older_than_s

        def read(conn: sqlite3.Connection) -> int:
            row = conn.execute(GHOSTS_SQL, (before, before)).fetchone()
            return int(row[0])

        count: int = await self._read(read)
        return count

    async def lead(self, name: str, owner: str, ttl_s: float) -> LeaderToken | None:
        token: LeaderToken | None = await self._write(
            lambda conn: self._lead(conn, name, owner, ttl_s)
        )
        return token

    def _lead(
        self, conn: sqlite3.Connection, name: str, owner: str, ttl_s: float
    ) -> LeaderToken | None:
        now = self.clock()
        row = conn.execute(
            "INSERT INTO leaders (name, owner, epoch, expires_at) VALUES (?, ?, 1, ?)"
            " ON CONFLICT (name) DO UPDATE SET"
            " epoch = CASE WHEN leaders.owner = excluded.owner AND leaders.expires_at >= ?"
            " THEN leaders.epoch ELSE leaders.epoch + 1 END,"
            " owner = excluded.owner, expires_at = excluded.expires_at"
            " WHERE leaders.owner = excluded.owner OR leaders.expires_at < ?"
            " RETURNING epoch, expires_at",
            (name, owner, now + ttl_s, now, now),
        ).fetchone()
        if row is None:
            return None
        return LeaderToken(name, owner, row["epoch"], row["expires_at"])

    @staticmethod
    def _holds(conn: sqlite3.Connection, token: LeaderToken, now: float) -> bool:
        row = conn.execute(
            "SELECT 1 FROM leaders WHERE name = ? AND owner = ? AND epoch = ? AND expires_at >= ?",
            (token.name, token.owner, token.epoch, now),
        ).fetchone()
        return row is not None

    # retention

    async def purge(
        self,
        *,
        finished_before: float,
        tenant: str | None = None,
        exclude: Sequence[str] = (),
        limit: int = 500,
    ) -> list[Task]:
        sql, args = purge_candidates("?", finished_before, tenant, exclude, limit)

        def write(conn: sqlite3.Connection) -> list[Task]:
            tasks = [task_from_row(row) for row in conn.execute(sql, args).fetchall()]
            for task in tasks:
                conn.execute("DELETE FROM events WHERE task_id = ?", (task.id,))
                conn.execute("DELETE FROM idempotency_keys WHERE task_id = ?", (task.id,))
                conn.execute("DELETE FROM webhook_deliveries WHERE task_id = ?", (task.id,))
                conn.execute("DELETE FROM tasks WHERE id = ?", (task.id,))
                _count_status(conn, task.tenant, task.status, -1)
            if tasks:
                _bump(conn, "purged", "", len(tasks))
            return tasks

        purged: list[Task] = await self._write(write)
        return purged

    # stats and counters

    async def stats(self, *, tenant: str | None, ghost_after_s: float) -> Stats:
        now = self.clock()
        return await self._read(lambda conn: self._stats(conn, tenant, now - ghost_after_s))  # type: ignore[no-any-return]

    def _stats(self, conn: sqlite3.Connection, tenant: str | None, ghost_before: float) -> Stats:
        tenant_where, args = ("WHERE tenant = ?", [tenant]) if tenant is not None else ("", [])
        counts = {str(s): 0 for s in Status}
        for row in conn.execute(
            f"SELECT status, SUM(n) AS n FROM task_counts {tenant_where} GROUP BY status", args
        ):
            counts[row["status"]] = int(row["n"])
        failures: dict[str, int] = {}
        for row in conn.execute("SELECT labels, n FROM counters WHERE name = 'failures'"):
            row_tenant, _, code = str(row["labels"]).partition(":")
            if tenant is None or row_tenant == tenant:
                failures[code] = failures.get(code, 0) + int(row["n"])
        dwell = dwell_percentiles(
            conn.execute(DWELL_TENANT_SQL, (tenant, DWELL_WINDOW))
            if tenant is not None
            else conn.execute(DWELL_SQL, (DWELL_WINDOW,))
        )
        ghost_sql = GHOSTS_SQL
        ghost_args: list[Any] = [ghost_before, ghost_before]
        if tenant is not None:
            ghost_sql += " AND tenant = ?"
            ghost_args.append(tenant)
        ghosts = int(conn.execute(ghost_sql, ghost_args).fetchone()[0])
        oldest = conn.execute(
            f"SELECT ready_at FROM tasks WHERE status IN {_CLAIMABLE_SQL} ORDER BY ready_at LIMIT 1"
        ).fetchone()
        return Stats(
            counts,
            failures,
            dwell,
            ghosts,
            None if oldest is None else oldest[0],
            self._failures_last_hour(conn, tenant),
        )

    def _failures_last_hour(self, conn: sqlite3.Connection, tenant: str | None) -> dict[str, int]:
        since = int(self.clock() // 60) - 59
        found: dict[str, int] = {}
        for row in conn.execute(
            "SELECT labels, n FROM counters WHERE name = ? AND labels >= ?",
            (FAILURES_BY_MINUTE, f"{since:010d}:"),
        ):
            _minute, row_tenant, code = str(row["labels"]).split(":", 2)
            if tenant is None or row_tenant == tenant:
                found[code] = found.get(code, 0) + int(row["n"])
        return found

    async def counters(self) -> dict[tuple[str, str], int]:
        def read(conn: sqlite3.Connection) -> dict[tuple[str, str], int]:
            rows = conn.execute("SELECT name, labels, n FROM counters").fetchall()
            return {(row["name"], row["labels"]): int(row["n"]) for row in rows}

        found: dict[tuple[str, str], int] = await self._read(read)
        return found

    async def bump(self, name: str, labels: str = "") -> None:
        await self._write(lambda conn: _bump(conn, name, labels))

    # webhooks (the outbox; see kiln/store/outbox.py and kiln/webhooks.py)

    async def webhook_scan(self, *, limit: int) -> WebhookScan:
        """One writer commits in seq order, so the events after the cursor have no gaps."""

        def read(conn: sqlite3.Connection) -> WebhookScan:
            row = conn.execute("SELECT seq FROM webhook_cursor WHERE name = ?", (CURSOR,))
            found = row.fetchone()
            cursor = 0 if found is None else int(found[0])
            rows = conn.execute(
                "SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (cursor, limit)
            ).fetchall()
            events = [event_from_row(r) for r in rows]
            ids = json.dumps(sorted({e.task_id for e in events}))
            tasks = {
                r[0]: task_from_row(r)
                for r in conn.execute(
                    "SELECT * FROM tasks WHERE id IN (SELECT value FROM json_each(?))"
                    " AND webhook IS NOT NULL",
                    (ids,),
                )
            }
            last = events[-1].seq if events else cursor
            hooked = [(e, tasks[e.task_id]) for e in events if e.task_id in tasks]
            return WebhookScan(cursor, last, len(events), hooked)

        scan: WebhookScan = await self._read(read)
        return scan

    async def webhook_enqueue(self, deliveries: Sequence[WebhookDelivery], *, cursor: int) -> int:
        def write(conn: sqlite3.Connection) -> int:
            added = 0
            for item in deliveries:
                added += conn.execute(
                    f"INSERT INTO webhook_deliveries ({DELIVERY_COLUMNS})"
                    " SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?"
                    " WHERE EXISTS (SELECT 1 FROM tasks WHERE id = ?)"
                    " ON CONFLICT (event_id) DO NOTHING",
                    (*item.insert_args(), item.task_id),
                ).rowcount
            conn.execute(
                "INSERT INTO webhook_cursor (name, seq) VALUES (?, ?) ON CONFLICT (name)"
                " DO UPDATE SET seq = max(webhook_cursor.seq, excluded.seq)",
                (CURSOR, cursor),
            )
            return added

        added: int = await self._write(write)
        return added

    async def webhook_due(self, *, limit: int) -> list[WebhookDelivery]:
        now = self.clock()

        def read(conn: sqlite3.Connection) -> list[WebhookDelivery]:
            rows = conn.execute(WEBHOOK_DUE_SQL, (PENDING, now, PENDING, limit)).fetchall()
            return [delivery_from_row(r) for r in rows]

        due: list[WebhookDelivery] = await self._read(read)
        return due

    async def webhook_record(self, attempt: WebhookAttempt) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE webhook_deliveries SET status = ?, attempts = attempts + 1,"
                " next_attempt_at = coalesce(?, next_attempt_at), last_error = ?,"
                " response_status = ?, updated_at = ? WHERE event_id = ? AND status = ?",
                (attempt.status, attempt.next_attempt_at, attempt.error,
                 attempt.response_status, self.clock(), attempt.event_id, PENDING),
            )  # fmt: skip
            _bump(conn, "webhook_deliveries", attempt.outcome)

        await self._write(write)

    async def webhook_deliveries(
        self, *, task_id: str | None = None, limit: int = 100
    ) -> list[WebhookDelivery]:
        sql = f"SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries"
        args: list[Any] = []
        if task_id is not None:
            sql += " WHERE task_id = ?"
            args.append(task_id)
        sql += " ORDER BY seq LIMIT ?"
        args.append(limit)

        def read(conn: sqlite3.Connection) -> list[WebhookDelivery]:
            return [delivery_from_row(r) for r in conn.execute(sql, args).fetchall()]

        found: list[WebhookDelivery] = await self._read(read)
        return found

    async def webhook_pending(self) -> int:
        def read(conn: sqlite3.Connection) -> int:
            sql = "SELECT COUNT(*) FROM webhook_deliveries WHERE status = ?"
            return int(conn.execute(sql, (PENDING,)).fetchone()[0])

        pending: int = await self._read(read)
        return pending

    # resource pools and rate limits (see kiln/store/pools.py, kiln/limits.py)

    async def acquire_slots(
        self,
        task_id: str,
        epoch: int,
        needs: Mapping[str, int],
        capacities: Mapping[str, int],
        *,
        in_line: bool = False,
    ) -> PoolWait | None:
        units = units_needed(needs, capacities)
        if not units:
            return None
        names = sorted(units)

        def look(conn: sqlite3.Connection) -> PoolWait | None:
            rows = conn.execute(lines_sql("?", len(names)), (*names, self.clock()))
            return peek(rows, task_id, units, capacities)

        still: PoolWait | None = await self._read(look) if in_line else None
        if still is not None:  # in line, and no slot for it yet: nothing to write
            return still
        wait: PoolWait | None = await self._write(
            lambda conn: self._acquire_slots(conn, task_id, epoch, units, capacities)
        )
        return wait

    def _acquire_slots(
        self,
        conn: sqlite3.Connection,
        task_id: str,
        epoch: int,
        units: dict[str, int],
        capacities: Mapping[str, int],
    ) -> PoolWait | _Refused | None:
        now = self.clock()
        row = conn.execute(
            "SELECT status, epoch, lease_expires_at FROM tasks WHERE id = ?", (task_id,)
        ).fetchone()
        if (
            row is None
            or row["status"] != Status.WAITING_FOR_RESOURCE
            or row["epoch"] != epoch
            or (row["lease_expires_at"] or 0.0) <= now
        ):
            return _Refused(LeaseLost(f"task {task_id} is not waiting at epoch {epoch}"))
        lines = {}
        for pool in sorted(units):
            conn.execute(
                "INSERT INTO pools (name, capacity) VALUES (?, ?) ON CONFLICT (name)"
                " DO UPDATE SET capacity = excluded.capacity WHERE capacity <> excluded.capacity",
                (pool, capacities[pool]),
            )
            conn.execute(f"DELETE FROM pool_slots WHERE pool = ? AND NOT {live_sql('?')}",
                         (pool, now))  # fmt: skip
            conn.execute(
                "INSERT INTO pool_slots (pool, task_id, epoch, units, held, since)"
                " VALUES (?, ?, ?, ?, 0, ?) ON CONFLICT (pool, task_id) DO NOTHING",
                (pool, task_id, epoch, units[pool], now),
            )
            lines[pool] = slot_rows(conn.execute(
                "SELECT task_id, units, held, since FROM pool_slots WHERE pool = ?", (pool,)
            ))  # fmt: skip
        wait = decide(lines, task_id, capacities)
        if wait is None:
            conn.execute(
                "UPDATE pool_slots SET held = 1 WHERE task_id = ? AND held = 0", (task_id,)
            )
        return wait

    async def pool_wait(self, task_id: str) -> PoolWait | None:
        def read(conn: sqlite3.Connection) -> PoolWait | None:
            now = self.clock()
            waits = conn.execute(
                "SELECT pool_slots.pool, pools.capacity FROM pool_slots JOIN pools"
                f" ON pools.name = pool_slots.pool WHERE task_id = ? AND held = 0"
                f" AND {live_sql('?')} ORDER BY pool_slots.pool",
                (task_id, now),
            ).fetchall()
            for pool, capacity in waits:
                rows = slot_rows(conn.execute(
                    "SELECT task_id, units, held, since FROM pool_slots"
                    f" WHERE pool = ? AND {live_sql('?')}", (pool, now),
                ))  # fmt: skip
                wait = standing(pool, rows, task_id, capacity)
                if wait is not None:
                    return wait
            return None

        found: PoolWait | None = await self._read(read)
        return found

    async def pools(self) -> list[PoolUsage]:
        def read(conn: sqlite3.Connection) -> list[PoolUsage]:
            rows = conn.execute(POOL_USAGE_SQL.format(live=live_sql("?")), (self.clock(),))
            return [PoolUsage(r[0], int(r[1]), int(r[2]), int(r[3])) for r in rows]

        found: list[PoolUsage] = await self._read(read)
        return found

    async def take_token(self, name: str, rate: Rate) -> float:
        def write(conn: sqlite3.Connection) -> float:
            now = self.clock()
            row = conn.execute(
                "SELECT tokens, updated_at FROM rate_buckets WHERE name = ?", (name,)
            ).fetchone()
            left, wait_s = bucket_take(
                None if row is None else row[0], None if row is None else row[1], now, rate
            )
            if wait_s == 0.0:
                conn.execute(
                    "INSERT INTO rate_buckets (name, tokens, updated_at) VALUES (?, ?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET tokens = excluded.tokens,"
                    " updated_at = excluded.updated_at",
                    (name, left, now),
                )
            return wait_s

        wait_s: float = await self._write(write)
        return wait_s

    # breakers: circuit breaker states and the retry clock (kiln/breakers.py)

    async def breakers(self) -> list[BreakerRecord]:
        def read(conn: sqlite3.Connection) -> list[BreakerRecord]:
            rows = conn.execute(BREAKERS_SQL).fetchall()
            return [BreakerRecord(*row) for row in rows]

        found: list[BreakerRecord] = await self._read(read)
        return found

    async def save_breaker(self, record: BreakerRecord, *, only_if_due: bool = False) -> bool:
        sql = SAVE_BREAKER_SQL.format(p="?", guard=SAVE_BREAKER_IF_DUE if only_if_due else "")

        def write(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                sql,
                (record.name, record.state, record.opened_until, record.updated_at, record.by),
            ).fetchone()
            if row is not None:
                _bump(conn, "breaker_transitions", f"{record.name}>{record.state}")
            return row is not None

        saved: bool = await self._write(write)
        return saved

    async def reserve_retry(self, earliest: float, interval_s: float) -> float:
        def write(conn: sqlite3.Connection) -> float:
            row = conn.execute(
                RESERVE_RETRY_SQL.format(p="?", greatest="MAX"),
                (earliest, interval_s, interval_s, interval_s, interval_s),
            ).fetchone()
            return float(row[0])

        slot: float = await self._write(write)
        return slot


__all__ = ["ACTIVE", "SqliteStore", "connect", "migrate", "sqlite_path"]
