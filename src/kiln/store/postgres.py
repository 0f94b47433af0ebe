"""PostgreSQL store: psycopg 3, an async connection pool, raw SQL, one transaction per call.

The semantics are SQLite's (the same conformance suite runs on both); what differs is how
they are kept under real concurrency:

- claims lock their candidates with ``FOR UPDATE SKIP LOCKED``, so workers on many
  machines never wait on each other's rows and never claim the same task;
- submissions insert-or-get with ``ON CONFLICT``: simultaneous identical submissions wait
  on the unique index, not on a table lock, and all but one find the winner's task;
- supervisor writes hold the leader row ``FOR SHARE``: a takeover waits for the old
  leader's transaction in flight, and every later write of the old leader is refused;
- counters are sharded rows, so concurrent transactions rarely wait on the same counter;
- event ``seq`` numbers are handed out at insert and become visible at commit, so a
  tail by sequence number waits out gaps of transactions in flight (``tail``);
- idle workers are woken by ``LISTEN kiln_ready`` / ``NOTIFY`` (coalesced per process).

A connection that broke (a database restart, a network cut) is replaced and the call
retried when nothing can have been committed; otherwise the call raises
``StoreUnavailable`` and the caller retries or gives up as it would on any failed write.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool, PoolTimeout

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
from kiln.states import CLAIMABLE, FINAL, Event, Status
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
    in_every_line,
    lines_sql,
    live_lines,
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

T = TypeVar("T")
Conn = psycopg.AsyncConnection[tuple[Any, ...]]
Pool = AsyncConnectionPool[Conn]

_RUNNING_SQL = "('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING')"
_CLAIMABLE_SQL = "('PENDING', 'RETRYING')"
_NOT_LIVE = frozenset({Status.FAILED, Status.TIMEOUT, Status.CANCELLED})
_NOT_LIVE_SQL = "('FAILED', 'TIMEOUT', 'CANCELLED')"
COUNTER_SHARDS = 16
READY_CHANNEL = "kiln_ready"
NOTIFY_EVERY_S = 0.05
ADVISORY_MIGRATIONS = 0x6B696C6E  # "kiln"
ADVISORY_CAPS = 0x6B636170  # "kcap": one claim at a time per capped tenant

# The queries whose cost must follow what they find, not the table size; the PostgreSQL
# suite checks each one's plan against these very strings.

#: Claim candidates of one kind, in claim order, locked: (kind, now, now, limit).
CLAIM_CANDIDATES_SQL = (
    "SELECT id, priority, ready_at, status, status_since FROM tasks"
    f" WHERE kind = %s AND status IN {_CLAIMABLE_SQL} AND ready_at <= %s"
    " AND deadline_at > %s ORDER BY priority DESC, ready_at, id LIMIT %s"
    " FOR UPDATE SKIP LOCKED"
)
#: The live or successful task holding a dedup key: (tenant, dedup_key).
DEDUP_LOOKUP_SQL = (
    f"SELECT * FROM tasks WHERE tenant = %s AND dedup_key = %s AND status NOT IN {_NOT_LIVE_SQL}"
)
#: Due tasks of one kind claimed before this one.
QUEUE_AHEAD_SQL = (
    "SELECT COUNT(*) FROM tasks WHERE kind = %s"
    f" AND status IN {_CLAIMABLE_SQL} AND ready_at <= %s AND deadline_at > %s"
    " AND (priority > %s OR (priority = %s AND (ready_at < %s"
    " OR (ready_at = %s AND id < %s))))"
)
DUE_SQL = "SELECT * FROM tasks WHERE due_at < %s ORDER BY due_at LIMIT %s"
DUE_CANCEL_SQL = (
    "SELECT * FROM tasks WHERE cancel_requested"
    f" AND status IN {_RUNNING_SQL} AND cancel_requested_at < %s"
    " ORDER BY cancel_requested_at LIMIT %s"
)
DWELL_WINDOW = 10_000
DWELL_SQL = "SELECT from_status, dwell_s FROM events ORDER BY seq DESC LIMIT %s"
DWELL_TENANT_SQL = (
    "SELECT from_status, dwell_s FROM events WHERE tenant = %s ORDER BY seq DESC LIMIT %s"
)
GHOSTS_SQL = (
    f"SELECT COUNT(*) FROM tasks WHERE due_at < %s AND status IN {_RUNNING_SQL}"
    " AND lease_expires_at < %s"
)
_EVENT_COLUMNS = (
    "seq, id, task_id, tenant, event, from_status, to_status, attempt, epoch, error, at,"
    " dwell_s, final"
)
#: Webhook deliveries due, each the first pending one of its task: (pending, now,
#: pending, limit).
WEBHOOK_DUE_SQL = (
    f"SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries d WHERE status = %s"
    " AND next_attempt_at <= %s AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p"
    " WHERE p.task_id = d.task_id AND p.status = %s AND p.seq < d.seq)"
    " ORDER BY next_attempt_at, seq LIMIT %s"
)
#: New deliveries, column arrays in DELIVERY_COLUMNS order; only for tasks that still
#: exist (a purge may have taken one since its event was read).
_ENQUEUE_SQL = (
    f"INSERT INTO webhook_deliveries ({DELIVERY_COLUMNS}) SELECT d.* FROM unnest("
    "%s::text[], %s::bigint[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[],"
    " %s::text[], %s::int[], %s::float8[], %s::text[], %s::int[], %s::float8[], %s::float8[])"
    " AS d(event_id, seq, task_id, tenant, event, url, payload, status, attempts,"
    " next_attempt_at, last_error, response_status, created_at, updated_at)"
    # KEY SHARE: a purge (which locks its tasks FOR UPDATE first) either waits for this
    # insert and deletes the rows with the task, or has taken the task and this skips it.
    " WHERE EXISTS (SELECT 1 FROM tasks t WHERE t.id = d.task_id FOR KEY SHARE)"
    " ON CONFLICT (event_id) DO NOTHING"
)
#: The event tail: rows after a seq, with the snapshot they were read in.
TAIL_SQL = (
    f"SELECT {_EVENT_COLUMNS}, pg_snapshot_xmin(pg_current_snapshot())::text::bigint,"
    " pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
    " FROM events WHERE seq > %s ORDER BY seq LIMIT %s"
)
_INSERT_EVENTS_SQL = (
    "INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,"
    " epoch, error, at, dwell_s) SELECT * FROM unnest(%s::text[], %s::text[], %s::text[],"
    " %s::text[], %s::text[], %s::text[], %s::boolean[], %s::int[], %s::int[], %s::text[],"
    " %s::float8[], %s::float8[]) RETURNING seq, id"
)
_FLUSH_SQL = {
    "task_counts": "INSERT INTO task_counts (tenant, status, shard, n)"
    " SELECT a, b, %s, n FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS d(a, b, n)"
    " ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n",
    "counters": "INSERT INTO counters (name, labels, shard, n)"
    " SELECT a, b, %s, n FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS d(a, b, n)"
    " ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n",
}


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every numbered PostgreSQL migration file, in order."""
    folder = resources.files("kiln.store").joinpath("sql", "postgres")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text(encoding="utf-8")))
    return sorted(found)


async def migrate(conn: Conn) -> int:
    """Apply pending migrations, each in its own transaction, under an advisory lock so
    that processes starting together apply each version once."""
    applied = 0
    await conn.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_MIGRATIONS,))
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY,"
            " name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, name, sql in migrations():
            async with conn.transaction():
                cur = await conn.execute(
                    "SELECT 1 FROM schema_migrations WHERE version = %s", (version,)
                )
                if await cur.fetchone() is not None:
                    continue
                await conn.execute(sql.encode())
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                    (version, name),
                )
                applied += 1
    finally:
        await conn.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_MIGRATIONS,))
    return applied


@dataclass(slots=True)
class _Refused:
    """An answer to raise after the transaction committed (its counters included)."""

    error: Exception


class _Tx:
    """One transaction: its connection and the counter deltas it will add at commit."""

    __slots__ = ("conn", "tally")

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.tally: collections.Counter[tuple[str, str, str]] = collections.Counter()

    async def one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        cur = await self.conn.execute(sql, args)
        return await cur.fetchone()

    async def all(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = await self.conn.execute(sql, args)
        return await cur.fetchall()

    def count_status(self, tenant: str, status: Status, delta: int) -> None:
        self.tally[("task_counts", tenant, str(status))] += delta

    def bump(self, name: str, labels: str = "", delta: int = 1) -> None:
        self.tally[("counters", name, labels)] += delta

    async def flush(self) -> None:
        """Add the deltas to one random shard, rows in a fixed order (no deadlocks)."""
        shard = random.randrange(COUNTER_SHARDS)
        for table, sql in _FLUSH_SQL.items():
            rows = sorted((a, b, n) for (t, a, b), n in self.tally.items() if t == table and n)
            if rows:
                a, b, n = zip(*rows, strict=True)
                await self.conn.execute(sql, (shard, list(a), list(b), list(n)))


@dataclass(slots=True)
class _EventRow:
    task: Task
    version: int
    event: Event
    source: Status | None
    target: Status
    error: JSON | None
    at: float
    dwell_s: float | None
    final: bool = False


async def _append_events(tx: _Tx, rows: list[_EventRow]) -> list[TaskEvent]:
    """Insert event rows in one statement; every caller has written before (so its
    transaction id exists before its seq numbers: see ``tail``)."""
    if not rows:
        return []
    ids = [f"{r.task.id}:{r.version}" for r in rows]
    args = (
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
    )
    seqs = dict((event_id, seq) for seq, event_id in await tx.all(_INSERT_EVENTS_SQL, args))
    return [
        TaskEvent(
            seq=seqs[event_id],
            id=event_id,
            task_id=r.task.id,
            tenant=r.task.tenant,
            event=r.event,
            from_status=r.source,
            status=r.target,
            attempt=r.task.attempt,
            epoch=r.task.epoch,
            error=r.error,
            at=r.at,
            dwell_s=r.dwell_s,
            final=r.final,
        )
        for event_id, r in zip(ids, rows, strict=True)
    ]


def _past_gaps(rows: list[tuple[Any, ...]], after: int, gaps: dict[int, int]) -> list[TaskEvent]:
    """The ``TAIL_SQL`` rows a tail may pass (see ``PostgresStore.tail``); ``gaps`` holds,
    per follower of the log, the xmax each gap was first seen under."""
    found: list[TaskEvent] = []
    expect = after + 1
    for row in rows:
        seq, xmin, xmax = row[0], row[-2], row[-1]
        if seq > expect:
            first_seen = gaps.setdefault(expect, xmax)
            if first_seen > xmin:
                break  # a writer of the gap may still commit: wait for it
            del gaps[expect]
        found.append(event_from_row(row))
        expect = seq + 1
    for gap in [g for g in gaps if g < expect]:
        del gaps[gap]
    return found


def event_from_row(row: Sequence[Any]) -> TaskEvent:
    return TaskEvent(
        seq=row[0],
        id=row[1],
        task_id=row[2],
        tenant=row[3],
        event=Event(row[4]),
        from_status=None if row[5] is None else Status(row[5]),
        status=Status(row[6]),
        attempt=row[7],
        epoch=row[8],
        error=loads(row[9]),
        at=row[10],
        dwell_s=row[11],
        final=bool(row[12]),
    )


def _log_claim(task: Task, source: Status, dwell: float, worker_id: str) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("transition", extra={
            "task_id": task.id, "attempt": task.attempt, "epoch": task.epoch,
            "from": str(source), "to": str(task.status), "event": "claim",
            "duration_s": dwell, "worker": worker_id,
        })  # fmt: skip


class _CommitUnknown(Exception):
    """The connection broke during COMMIT: the transaction may or may not have landed."""


class PostgresStore:
    """The store for many processes on many machines. See the module docstring."""

    def __init__(
        self, url: str, *, clock: Clock, pool_size: int = 10, acquire_timeout_s: float = 3.0
    ) -> None:
        self.url = url
        self.clock = clock
        self.pool_size = pool_size
        #: How long a call waits for a connection before it says the store is unavailable.
        self.acquire_timeout_s = acquire_timeout_s
        self._pool: Pool | None = None
        self._home: asyncio.AbstractEventLoop | None = None
        self._migrated = False
        self._open_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._gaps: dict[int, int] = {}
        self._webhook_gaps: dict[int, int] = {}  # the outbox follows the log on its own
        self._last_notify = 0.0
        self._listener: asyncio.Task[None] | None = None
        self.ready_listeners: list[Callable[[], None]] = []
        self._closed = False
        self._claim_turn = 0

    @classmethod
    async def open(cls, url: str, *, clock: Clock, pool_size: int = 10) -> PostgresStore:
        store = cls(url, clock=clock, pool_size=pool_size)
        await store._ensure_open()
        return store

    async def _ensure_open(self) -> None:
        """Migrate the database once, and open the pool on the first caller's loop."""
        if self._closed:
            raise StoreUnavailable("the store is closed")
        if not self._migrated:
            async with self._open_lock():
                await self._migrate_once()
        if self._home is None:
            self._home = asyncio.get_running_loop()
            self._pool = AsyncConnectionPool(
                self.url,
                min_size=1,
                max_size=max(1, self.pool_size),
                open=False,
                timeout=self.acquire_timeout_s,
                kwargs={"autocommit": True},
                name="kiln",
            )
            await self._pool.open(wait=False)

    def _open_lock(self) -> asyncio.Lock:
        """One lock per event loop: the first calls of a busy process migrate once."""
        loop = asyncio.get_running_loop()
        lock = self._open_locks.get(loop)
        if lock is None:
            lock = self._open_locks[loop] = asyncio.Lock()
        return lock

    async def _migrate_once(self) -> None:
        if self._migrated:
            return
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"cannot reach PostgreSQL: {exc}") from exc
        async with conn:
            await migrate(conn)
            await _check_task_columns(conn)
        self._migrated = True

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Conn]:
        """A pooled connection on the store's own loop. A pool's connections belong to
        the loop that made them, so a call from another loop gets a connection of its
        own for that call."""
        await self._ensure_open()
        if asyncio.get_running_loop() is self._home and self._pool is not None:
            async with self._pool.connection() as conn:
                yield conn
            return
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            yield conn

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        if self._pool is None or self._home is None:
            return
        if asyncio.get_running_loop() is self._home:
            await self._pool.close()
        elif self._home.is_running():
            closing = asyncio.run_coroutine_threadsafe(self._pool.close(), self._home)
            await asyncio.wrap_future(closing)
        # else the pool's loop has ended, and its connections with it

    # plumbing

    async def _write(self, fn: Callable[[_Tx], Awaitable[T | _Refused]]) -> T:
        """Run ``fn`` in one transaction with its counter deltas, retried when the
        connection broke before COMMIT or the database asked for a retry."""
        for attempt in range(4):
            try:
                result = await self._transaction(fn)
            except _CommitUnknown as exc:
                raise StoreUnavailable(f"PostgreSQL went away during COMMIT: {exc}") from None
            except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                if attempt == 3:
                    raise
                continue
            except (psycopg.OperationalError, PoolTimeout) as exc:
                if attempt == 3 or isinstance(exc, PoolTimeout):
                    raise StoreUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
                await self._drop_broken()
                continue
            if isinstance(result, _Refused):
                raise result.error
            return result
        raise AssertionError("unreachable")

    async def _transaction(self, fn: Callable[[_Tx], Awaitable[T | _Refused]]) -> T | _Refused:
        async with self._connection() as conn:
            await conn.execute("BEGIN")
            tx = _Tx(conn)
            try:
                result = await fn(tx)
                await tx.flush()
            except BaseException:
                if not conn.broken:
                    with contextlib.suppress(psycopg.Error):
                        await conn.execute("ROLLBACK")
                raise
            try:
                await conn.execute("COMMIT")
            except psycopg.OperationalError as exc:
                raise _CommitUnknown(str(exc)) from exc
            return result

    async def _read(self, fn: Callable[[_Tx], Awaitable[T]]) -> T:
        for attempt in range(4):
            try:
                async with self._connection() as conn:
                    return await fn(_Tx(conn))
            except (psycopg.OperationalError, PoolTimeout) as exc:
                if attempt == 3 or isinstance(exc, PoolTimeout):
                    raise StoreUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
                await self._drop_broken()
        raise AssertionError("unreachable")

    async def _drop_broken(self) -> None:
        """After a broken connection (a restart drops them all), test the idle ones so
        the retry gets a live one."""
        if self._pool is not None and asyncio.get_running_loop() is self._home:
            with contextlib.suppress(Exception):
                await self._pool.check()

    # wake-ups

    def watch_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever any process made work claimable (LISTEN)."""
        self.ready_listeners.append(callback)
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="kiln-pg-listen")

    async def _listen(self) -> None:
        delay = 0.1
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {READY_CHANNEL}")
                    delay = 0.1
                    self._fire_ready()  # anything made ready while we were away
                    async for _ in conn.notifies():
                        self._fire_ready()
            except asyncio.CancelledError:
                raise
            except psycopg.Error as exc:
                log.warning("listen_failed", extra={"error": str(exc)})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _fire_ready(self) -> None:
        for callback in list(self.ready_listeners):
            callback()

    def _notify_due(self, now: float) -> bool:
        """NOTIFY takes a cluster-wide lock at commit: one per process per interval."""
        if abs(now - self._last_notify) < NOTIFY_EVERY_S:
            return False
        self._last_notify = now
        return True

    async def _notify_ready(self, tx: _Tx) -> None:
        if self._notify_due(self.clock()):
            await tx.conn.execute(f"NOTIFY {READY_CHANNEL}")

    # submission

    async def submit(self, new: NewTask) -> SubmitResult:
        if new.idempotency_key is None:
            task = await self._insert_in_one_statement(new)
            if task is not None:
                return SubmitResult(task, created=True)
        # A key to claim, or the same content already live or done: in a transaction.
        return await self._write(lambda tx: self._submit(tx, new))

    async def _insert_in_one_statement(self, new: NewTask) -> Task | None:
        """A submission without an idempotency key as one statement: the task (unless a
        live or successful task holds its content), its event and its count. None when
        the content is taken (the transactional path then answers with that task)."""
        now = self.clock()
        args = [*_insert_args(new, now), str(Event.SUBMIT), now,
                random.randrange(COUNTER_SHARDS)]  # fmt: skip
        for attempt in range(4):
            try:
                async with self._connection() as conn:
                    row = await (await conn.execute(_SUBMIT_SQL, args)).fetchone()
                    if row is not None and self._notify_due(now):
                        await conn.execute(f"NOTIFY {READY_CHANNEL}")
                break
            except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                if attempt == 3:
                    raise
            except (psycopg.OperationalError, PoolTimeout) as exc:
                await self._drop_broken()
                raise StoreUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
        return None if row is None else task_from_row(row)

    async def _submit(self, tx: _Tx, new: NewTask) -> SubmitResult | _Refused:
        now = self.clock()
        if new.idempotency_key is not None:
            claimed = await tx.one(
                "INSERT INTO idempotency_keys (tenant, key, fingerprint, task_id, created_at)"
                " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (tenant, key) DO NOTHING RETURNING 1",
                (new.tenant, new.idempotency_key, new.fingerprint, new.id, now),
            )
            if claimed is None:  # the key exists (committed: the insert waited for it)
                replay = await self._replay(tx, new, now)
                if replay is not None:
                    return replay
        for _ in range(8):
            if new.dedup_key is not None:
                row = await tx.one(DEDUP_LOOKUP_SQL, (new.tenant, new.dedup_key))
                if row is not None:
                    existing = task_from_row(row)
                    await self._point_key(tx, new, existing.id, now)
                    tx.bump("dedup_hits", "content")
                    return SubmitResult(existing, created=False, deduplicated=True)
            task = await self._insert(tx, new, now)
            if task is not None:
                return SubmitResult(task, created=True)
            # Another transaction inserted the same content meanwhile: answer with it.
        raise Conflict("the same content was submitted and ended repeatedly; try again")

    async def _replay(self, tx: _Tx, new: NewTask, now: float) -> SubmitResult | _Refused | None:
        row = await tx.one(
            "SELECT fingerprint, task_id FROM idempotency_keys WHERE tenant = %s AND key = %s"
            " FOR UPDATE",
            (new.tenant, new.idempotency_key),
        )
        assert row is not None
        if row[0] != new.fingerprint:
            return _Refused(
                IdempotencyKeyReused("this Idempotency-Key was used with a different request body")
            )
        found = await tx.one("SELECT * FROM tasks WHERE id = %s", (row[1],))
        if found is not None:
            tx.bump("dedup_hits", "idempotency")
            return SubmitResult(task_from_row(found), created=False, replayed=True)
        await self._point_key(tx, new, new.id, now)  # its task is gone: the key is free
        return None

    @staticmethod
    async def _point_key(tx: _Tx, new: NewTask, task_id: str, now: float) -> None:
        if new.idempotency_key is None:
            return
        await tx.conn.execute(
            "UPDATE idempotency_keys SET fingerprint = %s, task_id = %s, created_at = %s"
            " WHERE tenant = %s AND key = %s",
            (new.fingerprint, task_id, now, new.tenant, new.idempotency_key),
        )

    async def _insert(self, tx: _Tx, new: NewTask, now: float) -> Task | None:
        row = await tx.one(f"{_INSERT_TASK_SQL} RETURNING *", _insert_args(new, now))
        if row is None:
            return None
        task = task_from_row(row)
        await _append_events(
            tx, [_EventRow(task, 1, Event.SUBMIT, None, Status.PENDING, None, now, None)]
        )
        tx.count_status(new.tenant, Status.PENDING, 1)
        await self._notify_ready(tx)
        return task

    # reads

    async def get(self, task_id: str) -> Task | None:
        async def read(tx: _Tx) -> Task | None:
            row = await tx.one("SELECT * FROM tasks WHERE id = %s", (task_id,))
            return None if row is None else task_from_row(row)

        return await self._read(read)

    async def get_many(self, task_ids: Sequence[str]) -> dict[str, Task]:
        ids = sorted(set(task_ids))

        async def read(tx: _Tx) -> dict[str, Task]:
            rows = await tx.all("SELECT * FROM tasks WHERE id = ANY(%s)", (ids,))
            return {task.id: task for task in map(task_from_row, rows)}

        return await self._read(read) if ids else {}

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
                where.append(f"{column} = %s")
                args.append(str(value))
        if cursor is not None:
            where.append("id < %s")
            args.append(cursor)
        sql = "SELECT * FROM tasks"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT %s"
        args.append(limit + 1)

        async def read(tx: _Tx) -> list[Task]:
            return [task_from_row(row) for row in await tx.all(sql, args)]

        tasks = await self._read(read)
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
        base = f"SELECT {_EVENT_COLUMNS} FROM events WHERE"
        if task_id is not None:
            sql, args = f"{base} task_id = %s AND seq > %s", [task_id, after]
        elif tenant is not None:
            sql, args = f"{base} tenant = %s AND seq > %s", [tenant, after]
        else:
            sql, args = f"{base} seq > %s", [after]
        sql += " ORDER BY seq LIMIT %s"
        args.append(limit)

        async def read(tx: _Tx) -> list[TaskEvent]:
            return [event_from_row(row) for row in await tx.all(sql, args)]

        return await self._read(read)

    async def tail(self, *, after: int, limit: int = 1000) -> list[TaskEvent]:
        """The events after ``after`` that no commit still in flight can precede.

        A seq is taken at insert and shows at commit, so a reader can see seq 7 before 6.
        The tail stops at such a gap. Every writer has its transaction id before it takes
        a seq, so the transactions that may still fill a gap were all running when the gap
        was first seen (ids below that snapshot's xmax). Once the oldest running
        transaction is past that xmax and the gap is still there, it never fills (a
        rollback) and the tail moves on.
        """

        async def read(tx: _Tx) -> list[tuple[Any, ...]]:
            return await tx.all(TAIL_SQL, (after, limit))

        return _past_gaps(await self._read(read), after, self._gaps)

    async def last_seq(self) -> int:
        """Where a tail may start: the newest seq below which no gap is pending."""

        async def read(tx: _Tx) -> tuple[int, list[tuple[Any, ...]]]:
            row = await tx.one("SELECT coalesce(max(seq), 0) FROM events")
            newest = int(row[0]) if row else 0
            return newest, await tx.all(TAIL_SQL, (max(0, newest - 1000), 1001))

        newest, rows = await self._read(read)
        expect = None
        for row in rows:
            if expect is not None and row[0] > expect:
                self._gaps.setdefault(expect, row[-1])
                return int(expect) - 1
            expect = row[0] + 1
        return newest

    async def progressed(self, *, since: float, limit: int = 500) -> list[Task]:
        async def read(tx: _Tx) -> list[Task]:
            rows = await tx.all(
                "SELECT * FROM tasks WHERE progress_at > %s ORDER BY progress_at LIMIT %s",
                (since, limit),
            )
            return [task_from_row(row) for row in rows]

        return await self._read(read)

    async def queue_position(self, task: Task, policy: ClaimPolicy | None = None) -> int | None:
        now = self.clock()
        if task.status not in CLAIMABLE or task.ready_at > now or task.deadline_at <= now:
            return None
        aging_s = None if policy is None else policy.aging_s

        async def read(tx: _Tx) -> int:
            async def count(sql: str, args: Sequence[Any]) -> int:
                row = await tx.one(sql, args)
                assert row is not None
                return int(row[0])

            async def ahead(tenant: str | None) -> int:
                if aging_s is None:
                    sql = QUEUE_AHEAD_SQL if tenant is None else ahead_sql("%s", tenant=True,
                                                                          level=False)  # fmt: skip
                    return await count(sql, ahead_args(task.kind, tenant, None, task, now, None))
                key = (task.kind,) if tenant is None else (task.kind, tenant)
                levels = await tx.all(levels_sql("%s", tenant=tenant is not None), (*key, *key))
                sql = ahead_sql("%s", tenant=tenant is not None, level=True)
                found = 0
                for (level,) in levels:
                    found += await count(sql, ahead_args(task.kind, tenant, level, task, now,
                                                         aging_s))  # fmt: skip
                return found

            if policy is None or not policy.fair:
                return await ahead(None) + 1
            own = await ahead(task.tenant) + 1
            others = [r[0] for r in await tx.all(READY_TENANTS_SQL) if r[0] != task.tenant]
            depth = tenant_depth_sql("%s")
            return fair_position(
                own, [await count(depth, (task.kind, t, now, now, own - 1)) for t in others]
            )

        return await self._read(read)

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
        return await self._write(
            lambda tx: self._claim(tx, worker_id, kinds, limit, lease_ttl_s, policy, turn_no)
        )

    async def _claim(
        self,
        tx: _Tx,
        worker_id: str,
        kinds: list[str],
        limit: int,
        lease_ttl_s: float,
        policy: ClaimPolicy | None = None,
        turn_no: int = 0,
    ) -> list[Task]:
        now = self.clock()
        chosen: list[tuple[Any, ...]]  # (id, priority, ready_at, status, status_since)
        if policy is None or policy.plain:
            chosen = []
            for kind in kinds:
                chosen += await tx.all(CLAIM_CANDIDATES_SQL, (kind, now, now, limit))
            chosen.sort(key=lambda r: (-r[1], r[2], r[0]))
            chosen = chosen[:limit]
        else:
            chosen = await self._policy_candidates(tx, kinds, limit, policy, now, turn_no)
        if not chosen:
            return []
        rows = await tx.all(
            "UPDATE tasks t SET status = 'WAITING_FOR_RESOURCE', attempt = t.attempt + 1,"
            " epoch = t.epoch + 1, version = t.version + 1, lease_owner = %s,"
            " lease_expires_at = %s, state_deadline_at = %s + (t.timeouts::jsonb->>'waiting_s')"
            "::float8, started_at = coalesce(t.started_at, %s), updated_at = %s,"
            " status_since = %s, next_retry_at = NULL, stage = NULL, progress_step = NULL,"
            " progress_total = NULL, progress_at = NULL,"
            " result_prefix = 'tasks/' || t.id || '/' || (t.attempt + 1) || '-' || (t.epoch + 1)"
            " FROM unnest(%s::text[], %s::text[], %s::float8[]) AS c(id, prev, since)"
            " WHERE t.id = c.id RETURNING t.*, c.prev, c.since",
            (worker_id, now + lease_ttl_s, now, now, now, now,
             [r[0] for r in chosen], [r[3] for r in chosen], [r[4] for r in chosen]),
        )  # fmt: skip
        by_id = {row[0]: row for row in rows}
        claimed: list[Task] = []
        events: list[_EventRow] = []
        for cand in chosen:  # in claim order
            row = by_id[cand[0]]
            task = task_from_row(row)
            source, dwell = Status(row[-2]), now - row[-1]
            events.append(_EventRow(task, task.version, Event.CLAIM, source,
                                    Status.WAITING_FOR_RESOURCE, None, now, dwell))  # fmt: skip
            _log_claim(task, source, dwell, worker_id)
            tx.count_status(task.tenant, source, -1)
            tx.count_status(task.tenant, Status.WAITING_FOR_RESOURCE, 1)
            tx.bump("transitions", f"{source}>{Status.WAITING_FOR_RESOURCE}")
            claimed.append(task)
        await _append_events(tx, events)
        return claimed

    async def _policy_candidates(
        self,
        tx: _Tx,
        kinds: list[str],
        limit: int,
        policy: ClaimPolicy,
        now: float,
        turn_no: int,
    ) -> list[tuple[Any, ...]]:
        """What a claim under ``policy`` takes (kiln/store/claims.py), in claim order,
        locked: rows are read unlocked, chosen, then locked (SKIP LOCKED: another claim's
        pick is left to it). A capped tenant is claimed for by one claim at a time (an
        advisory lock), so its cap holds across workers."""
        lines: list[str | None] = [None]
        rooms: dict[str, int | None] = {}
        tenants: list[str] = []
        if policy.by_tenant:
            tenants = turn([r[0] for r in await tx.all(READY_TENANTS_SQL)], turn_no)
            capped = [t for t in tenants if policy.cap(t) is not None]
            rooms = room(policy, tenants, await _running(tx, capped))
            lines = [t for t in tenants if rooms[t] != 0]
        found: list[Candidate] = []
        for kind in kinds:
            for tenant in lines:
                key: tuple[str, ...] = (kind,) if tenant is None else (kind, tenant)
                spare = rooms.get(tenant) if tenant is not None else None
                take = limit if spare is None else min(limit, spare)
                by_tenant = tenant is not None
                if policy.aging_s is None:
                    sql = heads_sql("%s", tenant=by_tenant, level=False)
                    found += candidates(await tx.all(sql, (*key, now, now, take)))
                    continue
                levels = await tx.all(levels_sql("%s", tenant=by_tenant), (*key, *key))
                sql = heads_sql("%s", tenant=by_tenant, level=True)
                for (level,) in levels:
                    found += candidates(await tx.all(sql, (*key, level, now, now, take)))
        picked = choose(found, limit, policy, rooms, tenants)
        locking = sorted({c.tenant for c in picked if policy.cap(c.tenant) is not None})
        if locking:
            for tenant in locking:  # in name order: two claims never wait on each other
                await tx.conn.execute(
                    "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (ADVISORY_CAPS, tenant)
                )
            rooms.update(room(policy, locking, await _running(tx, locking)))
            picked = choose(picked, limit, policy, rooms, tenants)
        if not picked:
            return []
        locked = {
            row[0]: row
            for row in await tx.all(
                "SELECT id, priority, ready_at, status, status_since FROM tasks"
                f" WHERE id = ANY(%s) AND status IN {_CLAIMABLE_SQL} AND ready_at <= %s"
                " AND deadline_at > %s FOR UPDATE SKIP LOCKED",
                ([c.id for c in picked], now, now),
            )
        }
        return [locked[c.id] for c in picked if c.id in locked]

    async def heartbeat(
        self, task_id: str, epoch: int, lease_ttl_s: float, progress: Progress | None
    ) -> Task:
        return await self._write(
            lambda tx: self._heartbeat(tx, task_id, epoch, lease_ttl_s, progress)
        )

    async def _heartbeat(
        self, tx: _Tx, task_id: str, epoch: int, lease_ttl_s: float, progress: Progress | None
    ) -> Task | _Refused:
        now = self.clock()
        sets = "lease_expires_at = %s, updated_at = %s"
        args: list[Any] = [now + lease_ttl_s, now]
        if progress is not None:
            sets += ", stage = %s, progress_step = %s, progress_total = %s, progress_at = %s"
            args += [progress.stage, progress.step, progress.total, now]
        row = await tx.one(
            f"UPDATE tasks SET {sets} WHERE id = %s AND epoch = %s"
            f" AND status IN {_RUNNING_SQL} RETURNING *",
            [*args, task_id, epoch],
        )
        if row is None:
            tx.bump("stale_writes")
            return _Refused(LeaseLost(f"task {task_id} is no longer held at epoch {epoch}"))
        tx.bump("lease_renewals")
        return task_from_row(row)

    async def request_cancel(self, task_id: str) -> Task:
        return await self._write(lambda tx: self._request_cancel(tx, task_id))

    async def _request_cancel(self, tx: _Tx, task_id: str) -> Task | _Refused:
        now = self.clock()
        row = await tx.one(
            "UPDATE tasks SET cancel_requested = true, cancel_requested_at = coalesce("
            "cancel_requested_at, %s), updated_at = %s"
            f" WHERE id = %s AND status IN {_RUNNING_SQL} RETURNING *",
            (now, now, task_id),
        )
        if row is None:
            return _Refused(Conflict(f"task {task_id} is not running"))
        return task_from_row(row)

    # the fenced compare-and-set

    async def apply(self, change: Change) -> tuple[Task, list[TaskEvent]]:
        try:
            if _is_plain(change):
                applied = await self._apply_in_one_statement(change)
                if applied is not None:
                    return applied
            # Everything else, and a refusal (worded by the full path), in a transaction.
            return await self._write(lambda tx: self._apply(tx, change))
        except psycopg.errors.IntegrityError as exc:
            # The whole transaction rolled back: never a status without its event (I6).
            raise Conflict(f"task {change.task_id} changed concurrently: {exc}") from None

    async def _apply_in_one_statement(self, change: Change) -> tuple[Task, list[TaskEvent]] | None:
        """A worker's plain step (acquire, generated, uploaded, fail without retry) as one
        statement: lock and check the row, update it, insert its event and add the counts.
        None when the row did not match (the caller then words the refusal)."""
        now = self.clock()
        (event, target), source = change.steps[0], change.expect_status
        sql, set_args = _update_sql(change, target, now)
        sets = sql.removeprefix("UPDATE tasks SET ").removesuffix(" WHERE id = %s RETURNING *")
        shard = random.randrange(COUNTER_SHARDS)
        final = target in FINAL
        args = [
            change.task_id, str(source), change.expect_epoch, *set_args[:-1],
            str(event), str(source), str(target), final, dumps(change.error), now, now,
            shard, str(source), str(target), f"{source}>{target}", shard,
        ]  # fmt: skip
        for attempt in range(4):
            try:
                async with self._connection() as conn:
                    cur = await conn.execute(_ONE_STEP_SQL.format(sets=sets), args)
                    row = await cur.fetchone()
                break
            except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                if attempt == 3:
                    raise
            except (psycopg.OperationalError, PoolTimeout) as exc:
                # Autocommit: a broken connection may have committed it; a retry re-reads
                # the row and either finds the change done (a refusal) or does it.
                await self._drop_broken()
                raise StoreUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
        if row is None:
            return None
        task = task_from_row(row)
        events = [
            TaskEvent(
                seq=row[-1], id=f"{task.id}:{task.version}", task_id=task.id,
                tenant=task.tenant, event=event, from_status=source, status=target,
                attempt=task.attempt, epoch=task.epoch, error=change.error, at=now,
                dwell_s=now - row[-2], final=final,
            )
        ]  # fmt: skip
        return task, events

    async def _apply(self, tx: _Tx, change: Change) -> tuple[Task, list[TaskEvent]] | _Refused:
        now = self.clock()
        if change.leader is not None and not await self._holds(tx, change.leader, now):
            return _Refused(NotLeader(f"{change.leader.owner} no longer leads"))
        current = await tx.one(
            "SELECT status, epoch, version, status_since, tenant FROM tasks WHERE id = %s"
            " FOR UPDATE",
            (change.task_id,),
        )
        refused = _refusal(tx, change, current)
        if refused is not None:
            return refused
        assert current is not None
        target = change.steps[-1][1]
        sql, args = _update_sql(change, target, now)
        if change.expect_status in _NOT_LIVE and target not in _NOT_LIVE:
            row = await self._revive(tx, sql, args)
        else:
            row = await tx.one(sql, args)
        assert row is not None
        task = task_from_row(row)
        rows: list[_EventRow] = []
        source: Status = change.expect_status
        dwell: float = now - current[3]
        for offset, (event, step_target) in enumerate(change.steps, start=1):
            final = offset == len(change.steps) and step_target in FINAL
            rows.append(_EventRow(task, current[2] + offset, event, source, step_target,
                                  change.error, now, dwell, final))  # fmt: skip
            tx.bump("transitions", f"{source}>{step_target}")
            source, dwell = step_target, 0.0
        events = await _append_events(tx, rows)
        tx.count_status(task.tenant, change.expect_status, -1)
        tx.count_status(task.tenant, target, 1)
        for name, labels in change.counters:
            tx.bump(name, labels)
        if target in CLAIMABLE:
            await self._notify_ready(tx)
        return task, events

    @staticmethod
    async def _revive(tx: _Tx, sql: str, args: list[Any]) -> tuple[Any, ...] | None:
        """A task leaving FAILED/TIMEOUT/CANCELLED re-enters the dedup index: when another
        live task holds its content by now, it gives up its dedup key (I5)."""
        try:
            async with tx.conn.transaction():
                return await tx.one(sql, args)
        except psycopg.errors.UniqueViolation:
            return await tx.one(sql.replace(" WHERE id", ", dedup_key = NULL WHERE id"), args)

    # supervisor

    async def due(self, *, limit: int, cancel_grace_s: float) -> Due:
        now = self.clock()

        async def read(tx: _Tx) -> Due:
            cancels = await tx.all(DUE_CANCEL_SQL, (now - cancel_grace_s, limit))
            due = Due([], [], [], [task_from_row(row) for row in cancels])
            for row in await tx.all(DUE_SQL, (now, limit)):
                classify_due(task_from_row(row), now, due)
            return due

        return await self._read(read)

    async def count_ghosts(self, *, older_than_s: float) -> int:
        before = self.clock() - older_than_s

        async def read(tx: _Tx) -> int:
            row = await tx.one(GHOSTS_SQL, (before, before))
            return int(row[0]) if row else 0

        return await self._read(read)

    async def lead(self, name: str, owner: str, ttl_s: float) -> LeaderToken | None:
        return await self._write(lambda tx: self._lead(tx, name, owner, ttl_s))

    async def _lead(self, tx: _Tx, name: str, owner: str, ttl_s: float) -> LeaderToken | None:
        now = self.clock()
        row = await tx.one(
            "INSERT INTO leaders (name, owner, epoch, expires_at) VALUES (%s, %s, 1, %s)"
            " ON CONFLICT (name) DO UPDATE SET"
            " epoch = CASE WHEN leaders.owner = excluded.owner AND leaders.expires_at >= %s"
            " THEN leaders.epoch ELSE leaders.epoch + 1 END,"
            " owner = excluded.owner, expires_at = excluded.expires_at"
            " WHERE leaders.owner = excluded.owner OR leaders.expires_at < %s"
            " RETURNING epoch, expires_at",
            (name, owner, now + ttl_s, now, now),
        )
        if row is None:
            return None
        return LeaderToken(name, owner, row[0], row[1])

    @staticmethod
    async def _holds(tx: _Tx, token: LeaderToken, now: float) -> bool:
        """Whether the token still leads; the row stays share-locked until commit, so a
        takeover cannot slip in between this check and the write it guards."""
        row = await tx.one(
            "SELECT 1 FROM leaders WHERE name = %s AND owner = %s AND epoch = %s"
            " AND expires_at >= %s FOR SHARE",
            (token.name, token.owner, token.epoch, now),
        )
        return row is not None

    # stats and counters

    async def stats(self, *, tenant: str | None, ghost_after_s: float) -> Stats:
        now = self.clock()
        return await self._read(lambda tx: self._stats(tx, tenant, now, now - ghost_after_s))

    async def _stats(self, tx: _Tx, tenant: str | None, now: float, ghost_before: float) -> Stats:
        tenant_where, args = ("WHERE tenant = %s", [tenant]) if tenant is not None else ("", [])
        counts = {str(s): 0 for s in Status}
        for status, n in await tx.all(
            f"SELECT status, SUM(n) FROM task_counts {tenant_where} GROUP BY status", args
        ):
            counts[status] = int(n)
        failures: dict[str, int] = {}
        for labels, n in await tx.all(
            "SELECT labels, SUM(n) FROM counters WHERE name = 'failures' GROUP BY labels"
        ):
            row_tenant, _, code = str(labels).partition(":")
            if tenant is None or row_tenant == tenant:
                failures[code] = failures.get(code, 0) + int(n)
        dwell = dwell_percentiles(
            await tx.all(DWELL_TENANT_SQL, (tenant, DWELL_WINDOW))
            if tenant is not None
            else await tx.all(DWELL_SQL, (DWELL_WINDOW,))
        )
        ghost_sql = GHOSTS_SQL
        ghost_args: list[Any] = [ghost_before, ghost_before]
        if tenant is not None:
            ghost_sql += " AND tenant = %s"
            ghost_args.append(tenant)
        ghost_row = await tx.one(ghost_sql, ghost_args)
        oldest = await tx.one(
            f"SELECT ready_at FROM tasks WHERE status IN {_CLAIMABLE_SQL} ORDER BY ready_at LIMIT 1"
        )
        return Stats(
            counts,
            failures,
            dwell,
            int(ghost_row[0]) if ghost_row else 0,
            None if oldest is None else oldest[0],
            await self._failures_last_hour(tx, tenant, now),
        )

    @staticmethod
    async def _failures_last_hour(tx: _Tx, tenant: str | None, now: float) -> dict[str, int]:
        since = int(now // 60) - 59
        found: dict[str, int] = {}
        for labels, n in await tx.all(
            "SELECT labels, SUM(n) FROM counters WHERE name = %s AND labels >= %s GROUP BY labels",
            (FAILURES_BY_MINUTE, f"{since:010d}:"),
        ):
            _minute, row_tenant, code = str(labels).split(":", 2)
            if tenant is None or row_tenant == tenant:
                found[code] = found.get(code, 0) + int(n)
        return found

    async def counters(self) -> dict[tuple[str, str], int]:
        async def read(tx: _Tx) -> dict[tuple[str, str], int]:
            rows = await tx.all("SELECT name, labels, SUM(n) FROM counters GROUP BY name, labels")
            return {(name, labels): int(n) for name, labels, n in rows}

        return await self._read(read)

    async def bump(self, name: str, labels: str = "") -> None:
        async def write(tx: _Tx) -> None:
            tx.bump(name, labels)

        await self._write(write)

    # webhooks (the outbox; see kiln/store/outbox.py and kiln/webhooks.py)

    async def webhook_scan(self, *, limit: int) -> WebhookScan:
        """The events after the cursor as ``tail`` reads them: a seq that may still commit
        stops the scan, so the cursor never moves past an event that is not visible yet."""

        async def read(tx: _Tx) -> tuple[int, list[tuple[Any, ...]]]:
            row = await tx.one("SELECT seq FROM webhook_cursor WHERE name = %s", (CURSOR,))
            cursor = 0 if row is None else int(row[0])
            return cursor, await tx.all(TAIL_SQL, (cursor, limit))

        cursor, rows = await self._read(read)
        events = _past_gaps(rows, cursor, self._webhook_gaps)
        ids = sorted({e.task_id for e in events})

        async def tasks(tx: _Tx) -> dict[str, Task]:
            found = await tx.all(
                "SELECT * FROM tasks WHERE id = ANY(%s) AND webhook IS NOT NULL", (ids,)
            )
            return {r[0]: task_from_row(r) for r in found}

        hooked = await self._read(tasks) if ids else {}
        last = events[-1].seq if events else cursor
        found = [(e, hooked[e.task_id]) for e in events if e.task_id in hooked]
        return WebhookScan(cursor, last, len(events), found)

    async def webhook_enqueue(self, deliveries: Sequence[WebhookDelivery], *, cursor: int) -> int:
        columns = [list(c) for c in zip(*(d.insert_args() for d in deliveries), strict=True)]

        async def write(tx: _Tx) -> int:
            added = 0
            if deliveries:
                cur = await tx.conn.execute(_ENQUEUE_SQL, columns)
                added = cur.rowcount
            await tx.conn.execute(
                "INSERT INTO webhook_cursor (name, seq) VALUES (%s, %s) ON CONFLICT (name)"
                " DO UPDATE SET seq = greatest(webhook_cursor.seq, excluded.seq)",
                (CURSOR, cursor),
            )
            return added

        return await self._write(write)

    async def webhook_due(self, *, limit: int) -> list[WebhookDelivery]:
        now = self.clock()

        async def read(tx: _Tx) -> list[WebhookDelivery]:
            rows = await tx.all(WEBHOOK_DUE_SQL, (PENDING, now, PENDING, limit))
            return [delivery_from_row(r) for r in rows]

        return await self._read(read)

    async def webhook_record(self, attempt: WebhookAttempt) -> None:
        async def write(tx: _Tx) -> None:
            await tx.conn.execute(
                "UPDATE webhook_deliveries SET status = %s, attempts = attempts + 1,"
                " next_attempt_at = coalesce(%s, next_attempt_at), last_error = %s,"
                " response_status = %s, updated_at = %s WHERE event_id = %s AND status = %s",
                (attempt.status, attempt.next_attempt_at, attempt.error,
                 attempt.response_status, self.clock(), attempt.event_id, PENDING),
            )  # fmt: skip
            tx.bump("webhook_deliveries", attempt.outcome)

        await self._write(write)

    async def webhook_deliveries(
        self, *, task_id: str | None = None, limit: int = 100
    ) -> list[WebhookDelivery]:
        sql = f"SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries"
        args: list[Any] = []
        if task_id is not None:
            sql += " WHERE task_id = %s"
            args.append(task_id)
        sql += " ORDER BY seq LIMIT %s"
        args.append(limit)

        async def read(tx: _Tx) -> list[WebhookDelivery]:
            return [delivery_from_row(r) for r in await tx.all(sql, args)]

        return await self._read(read)

    async def webhook_pending(self) -> int:
        async def read(tx: _Tx) -> int:
            row = await tx.one(
                "SELECT COUNT(*) FROM webhook_deliveries WHERE status = %s", (PENDING,)
            )
            return 0 if row is None else int(row[0])

        return await self._read(read)

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
        if in_line:

            async def look(tx: _Tx) -> PoolWait | None:
                rows = await tx.all(lines_sql("%s", len(names)), (*names, self.clock()))
                return peek(rows, task_id, units, capacities)

            still = await self._read(look)
            if still is not None:  # in line, and no slot for it yet: nothing to write
                return still

        return await self._write(lambda tx: self._take_slots(tx, task_id, epoch, units, capacities))

    async def _take_slots(
        self,
        tx: _Tx,
        task_id: str,
        epoch: int,
        units: dict[str, int],
        capacities: Mapping[str, int],
    ) -> PoolWait | _Refused | None:
        names = sorted(units)
        now = self.clock()
        # One acquirer per pool at a time (rows locked in name order, so two never wait
        # on each other): the line read below must not change under it.
        lock = "SELECT name, capacity FROM pools WHERE name = ANY(%s) ORDER BY name FOR UPDATE"
        known = dict(await tx.all(lock, (names,)))
        if any(known.get(pool) != capacities[pool] for pool in names):  # new or resized
            await tx.conn.execute(
                "INSERT INTO pools (name, capacity) SELECT * FROM unnest(%s::text[],"
                " %s::int[]) ON CONFLICT (name) DO UPDATE SET capacity = EXCLUDED.capacity",
                (names, [capacities[pool] for pool in names]),
            )
            await tx.all(lock, (names,))
        # Into every line, if the attempt still holds its lease (a new attempt of the
        # task starts again at the end of the line).
        await tx.conn.execute(
            "INSERT INTO pool_slots (pool, task_id, epoch, units, held, since)"
            " SELECT p.pool, t.id, t.epoch, p.units, false, %s FROM tasks t,"
            " unnest(%s::text[], %s::int[]) AS p(pool, units) WHERE t.id = %s"
            " AND t.epoch = %s AND t.status = 'WAITING_FOR_RESOURCE'"
            " AND t.lease_expires_at > %s ON CONFLICT (pool, task_id) DO UPDATE SET"
            " epoch = EXCLUDED.epoch, units = EXCLUDED.units, held = false,"
            " since = EXCLUDED.since WHERE pool_slots.epoch <> EXCLUDED.epoch",
            (now, names, [units[pool] for pool in names], task_id, epoch, now),
        )
        rows = await tx.all(
            f"SELECT pool, task_id, units, held, since, {live_sql('%s')} FROM pool_slots"
            " WHERE pool = ANY(%s)",
            (now, names),
        )
        dead = [(r[0], r[1]) for r in rows if not r[5]]
        if dead:  # their attempts moved on or their holders died: the slots are free
            await tx.conn.execute(
                "DELETE FROM pool_slots WHERE (pool, task_id) IN"
                " (SELECT * FROM unnest(%s::text[], %s::text[]))",
                ([d[0] for d in dead], [d[1] for d in dead]),
            )
        lines = live_lines(rows, names)
        if not in_every_line(lines, task_id):
            return _Refused(LeaseLost(f"task {task_id} is not waiting at epoch {epoch}"))
        wait = decide(lines, task_id, capacities)
        if wait is None:
            await tx.conn.execute(
                "UPDATE pool_slots SET held = true WHERE task_id = %s AND NOT held", (task_id,)
            )
        return wait

    async def pool_wait(self, task_id: str) -> PoolWait | None:
        async def read(tx: _Tx) -> PoolWait | None:
            now = self.clock()
            waits = await tx.all(
                "SELECT pool_slots.pool, pools.capacity FROM pool_slots JOIN pools"
                " ON pools.name = pool_slots.pool WHERE task_id = %s AND NOT held"
                f" AND {live_sql('%s')} ORDER BY pool_slots.pool",
                (task_id, now),
            )
            for pool, capacity in waits:
                rows = slot_rows(await tx.all(
                    "SELECT task_id, units, held, since FROM pool_slots"
                    f" WHERE pool = %s AND {live_sql('%s')}", (pool, now),
                ))  # fmt: skip
                wait = standing(pool, rows, task_id, capacity)
                if wait is not None:
                    return wait
            return None

        return await self._read(read)

    async def pools(self) -> list[PoolUsage]:
        async def read(tx: _Tx) -> list[PoolUsage]:
            rows = await tx.all(POOL_USAGE_SQL.format(live=live_sql("%s")), (self.clock(),))
            return [PoolUsage(r[0], int(r[1]), int(r[2]), int(r[3])) for r in rows]

        return await self._read(read)

    async def take_token(self, name: str, rate: Rate) -> float:
        async def write(tx: _Tx) -> float:
            now = self.clock()
            await tx.conn.execute(
                "INSERT INTO rate_buckets (name, tokens, updated_at) VALUES (%s, %s, %s)"
                " ON CONFLICT (name) DO NOTHING",
                (name, rate.burst, now),
            )
            row = await tx.one(
                "SELECT tokens, updated_at FROM rate_buckets WHERE name = %s FOR UPDATE", (name,)
            )
            assert row is not None
            left, wait_s = bucket_take(row[0], row[1], now, rate)
            if wait_s == 0.0:
                await tx.conn.execute(
                    "UPDATE rate_buckets SET tokens = %s, updated_at = %s WHERE name = %s",
                    (left, now, name),
                )
            return wait_s

        return await self._write(write)

    async def purge(
        self,
        *,
        finished_before: float,
        tenant: str | None = None,
        exclude: Sequence[str] = (),
        limit: int = 500,
    ) -> list[Task]:
        sql, args = purge_candidates("%s", finished_before, tenant, exclude, limit)
        sql += " FOR UPDATE SKIP LOCKED"  # a manual retry in flight keeps its task

        async def write(tx: _Tx) -> list[Task]:
            tasks = [task_from_row(row) for row in await tx.all(sql, args)]
            if not tasks:
                return []
            ids = [task.id for task in tasks]
            await tx.conn.execute("DELETE FROM events WHERE task_id = ANY(%s)", (ids,))
            await tx.conn.execute("DELETE FROM idempotency_keys WHERE task_id = ANY(%s)", (ids,))
            await tx.conn.execute("DELETE FROM webhook_deliveries WHERE task_id = ANY(%s)", (ids,))
            await tx.conn.execute("DELETE FROM tasks WHERE id = ANY(%s)", (ids,))
            for task in tasks:
                tx.count_status(task.tenant, task.status, -1)
            tx.bump("purged", "", len(tasks))
            return tasks

        return await self._write(write)

    async def prune_failure_buckets(self) -> None:
        """Drop per-minute failure buckets older than a day (the supervisor calls this)."""
        oldest = int(self.clock() // 60) - FAILURE_BUCKETS_KEPT_MIN

        async def write(tx: _Tx) -> None:
            await tx.conn.execute(
                "DELETE FROM counters WHERE name = %s AND labels < %s",
                (FAILURES_BY_MINUTE, f"{oldest:010d}:"),
            )

        await self._write(write)

    # breakers: circuit breaker states and the retry clock (kiln/breakers.py)

    async def breakers(self) -> list[BreakerRecord]:
        async def read(tx: _Tx) -> list[BreakerRecord]:
            return [BreakerRecord(*row) for row in await tx.all(BREAKERS_SQL)]

        return await self._read(read)

    async def save_breaker(self, record: BreakerRecord, *, only_if_due: bool = False) -> bool:
        sql = SAVE_BREAKER_SQL.format(p="%s", guard=SAVE_BREAKER_IF_DUE if only_if_due else "")

        async def write(tx: _Tx) -> bool:
            row = await tx.one(
                sql,
                (record.name, record.state, record.opened_until, record.updated_at, record.by),
            )
            if row is not None:
                tx.bump("breaker_transitions", f"{record.name}>{record.state}")
            return row is not None

        return await self._write(write)

    async def reserve_retry(self, earliest: float, interval_s: float) -> float:
        async def write(tx: _Tx) -> float:
            row = await tx.one(
                RESERVE_RETRY_SQL.format(p="%s", greatest="GREATEST"),
                (earliest, interval_s, interval_s, interval_s, interval_s),
            )
            assert row is not None
            return float(row[0])

        return await self._write(write)


_INSERT_TASK_SQL = (
    "INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata,"
    " inputs, fingerprint, idempotency_key, dedup_key, max_attempts, deadline_s,"
    " deadline_at, timeouts, created_at, updated_at, status_since, webhook)"
    " VALUES (%s, %s, %s, 'PENDING', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,"
    " %s, %s, %s, %s) ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL"
    f" AND status NOT IN {_NOT_LIVE_SQL} DO NOTHING"
)
#: A submission in one statement; the event row reads the inserted row (so the insert,
#: and the transaction id, come before the event's seq, as ``tail`` requires).
_SUBMIT_SQL = (
    f"WITH t AS ({_INSERT_TASK_SQL} RETURNING *),"
    " e AS (INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
    " attempt, epoch, error, at, dwell_s) SELECT t.id || ':1', t.id, t.tenant, %s, NULL,"
    " 'PENDING', false, t.attempt, t.epoch, NULL, %s, NULL FROM t RETURNING seq),"
    " c AS (INSERT INTO task_counts (tenant, status, shard, n) SELECT t.tenant, 'PENDING', %s, 1"
    " FROM t ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n)"
    " SELECT t.*, (SELECT seq FROM e) FROM t"
)


def _insert_args(new: NewTask, now: float) -> list[Any]:
    timeouts = {
        "waiting_s": new.timeouts.waiting_s,
        "generating_s": new.timeouts.generating_s,
        "uploading_s": new.timeouts.uploading_s,
    }
    return [
        new.id, new.tenant, new.kind, new.priority, now, dumps(new.params),
        dumps(new.metadata), dumps(new.inputs), new.fingerprint, new.idempotency_key,
        new.dedup_key, new.max_attempts, new.deadline_s, now + new.deadline_s,
        dumps(timeouts), now, now, now, dumps(new.webhook),
    ]  # fmt: skip


def _is_plain(change: Change) -> bool:
    """A fenced single step of a worker that needs nothing but the row, its event and the
    counts: no leader, no epoch bump, no extra counters, no wake-up, no dedup re-entry."""
    target = change.steps[-1][1]
    return (
        len(change.steps) == 1
        and change.fenced
        and change.expect_epoch is not None
        and change.leader is None
        and not change.bump_epoch
        and not change.counters
        and target not in CLAIMABLE
        and change.expect_status not in _NOT_LIVE
    )


#: One fenced step in one statement. The event row reads the updated row, so the update
#: (and the transaction id) comes before the event's seq, as ``tail`` requires. Counter
#: rows are added in a fixed order within each table.
_ONE_STEP_SQL = (
    "WITH o AS (SELECT id, status_since FROM tasks WHERE id = %s AND status = %s"
    " AND epoch = %s FOR UPDATE),"
    " u AS (UPDATE tasks SET {sets} FROM o WHERE tasks.id = o.id"
    " RETURNING tasks.*, o.status_since AS since),"
    " e AS (INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
    " attempt, epoch, error, at, dwell_s) SELECT u.id || ':' || u.version, u.id, u.tenant,"
    " %s, %s, %s, %s, u.attempt, u.epoch, %s, %s, %s - u.since FROM u RETURNING seq),"
    " tc AS (INSERT INTO task_counts (tenant, status, shard, n) SELECT u.tenant, d.s, %s, d.n"
    " FROM u, (VALUES (%s::text, -1), (%s::text, 1)) AS d(s, n) ORDER BY d.s"
    " ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n),"
    " c AS (INSERT INTO counters (name, labels, shard, n) SELECT 'transitions', %s, %s, 1"
    " FROM u ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n)"
    " SELECT u.*, (SELECT seq FROM e) FROM u"
)


def _update_sql(change: Change, target: Status, now: float) -> tuple[str, list[Any]]:
    """The UPDATE of a change (its row is already locked and checked)."""
    sets = ["status = %s", "version = version + %s", "updated_at = %s", "status_since = %s"]
    args: list[Any] = [str(target), len(change.steps), now, now]
    if change.bump_epoch:
        sets.append("epoch = epoch + 1")
    if target in FINAL and "finished_at" not in change.fields:
        sets.append("finished_at = %s")
        args.append(now)
    for column, value in change.fields.items():
        if column not in TASK_COLUMNS:
            raise ValueError(f"unknown task column {column!r}")
        sets.append(f"{column} = %s")
        args.append(dumps(value) if column in JSON_COLUMNS else value)
    args.append(change.task_id)
    return f"UPDATE tasks SET {', '.join(sets)} WHERE id = %s RETURNING *", args


async def _running(tx: _Tx, tenants: Sequence[str]) -> dict[str, int]:
    if not tenants:
        return {}
    return {r[0]: int(r[1]) for r in await tx.all(running_sql("%s", len(tenants)), tenants)}


def _refusal(tx: _Tx, change: Change, current: tuple[Any, ...] | None) -> _Refused | None:
    if current is None:
        return _Refused(NotFound(f"task {change.task_id} does not exist"))
    status, epoch = current[0], current[1]
    if status == change.expect_status and (
        change.expect_epoch is None or epoch == change.expect_epoch
    ):
        return None
    if change.fenced:
        tx.bump("stale_writes")
        return _Refused(LeaseLost(f"task {change.task_id} moved on (now {status}, epoch {epoch})"))
    return _Refused(Conflict(f"task {change.task_id} is {status}, not {change.expect_status}"))


async def _check_task_columns(conn: Conn) -> None:
    cur = await conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'tasks'::regclass AND attnum > 0"
        " AND NOT attisdropped ORDER BY attnum"
    )
    found = tuple(row[0] for row in await cur.fetchall())
    if found != TASK_COLUMNS:
        raise RuntimeError(f"tasks columns {found} differ from TASK_COLUMNS {TASK_COLUMNS}")


__all__ = ["PostgresStore", "migrate", "migrations"]
