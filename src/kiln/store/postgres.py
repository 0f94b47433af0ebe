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
- idle workers are woken by ``LISTEN kiln_ready`` / ``NOTIFY`` (coalesced per process);
- a submission without a key and a worker's plain step are one statement each, and the
  ones that arrive while a batch commits go together into the next: one transaction and
  one round trip (psycopg's pipeline mode) for them all, each still its own compare-and-set
  (:class:`kiln.store.pgbatch.WriteBatch`).

A connection that broke (a database restart, a network cut) is replaced and the call
retried when nothing can have been committed; otherwise the call raises
``StoreUnavailable`` and the caller retries or gives up as it would on any failed write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from kiln.errors import StoreUnavailable
from kiln.models import NewTask, SubmitResult, Task, TaskEvent
from kiln.states import ENDED_UNSUCCESSFULLY, Event, Status
from kiln.store.claims import ClaimPolicy, Lease
from kiln.store.effects import effects_of
from kiln.store.pgbatch import SUBMIT_NAMES, SUBMIT_SHAPE, Shape, Shapes, Write, WriteBatch
from kiln.store.pgclaim import claim_args, claimed_of
from kiln.store.pgstep import step_write
from kiln.store.pgtx import COUNTER_SHARDS, READY_CHANNEL, Conn, PostgresTx, Q, translated
from kiln.store.queries import migrations
from kiln.store.records import Change, Clock
from kiln.store.rows import TASK_COLUMNS, event_from_row, insert_args, task_from_row
from kiln.store.sqlstore import Store, event_rows
from kiln.store.tx import Args, Op, Refused, Row, Tally, Tx, alone

log = logging.getLogger("kiln.store")

T = TypeVar("T")
Pool = AsyncConnectionPool[Conn]

#: At most one NOTIFY per process per interval (see ``_notify_due``).
NOTIFY_EVERY_S = 0.005
ADVISORY_MIGRATIONS = 0x6B696C6E  # "kiln"
#: The one-statement writes, alone (counting themselves) or in a batch (counted by it).
SUBMIT_COUNTED = f"{Q.submit_rows} {Q.submit_count} {Q.submit_end}"
SUBMIT_BARE = f"{Q.submit_rows} {Q.submit_end}"


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
        for version, name, sql in migrations("postgres"):
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


def _past_gaps(rows: list[tuple[Any, ...]], after: int, gaps: dict[int, int]) -> list[TaskEvent]:
    """The ``tail`` query's rows a tail may pass (see ``PostgresStore._log_after``); ``gaps`` holds,
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


class _CommitUnknown(Exception):
    """The connection broke during COMMIT: the transaction may or may not have landed."""


class PostgresStore(Store):
    """The store for many processes on many machines. See the module docstring."""

    commits_in_seq_order = False

    def __init__(
        self, url: str, *, clock: Clock, pool_size: int = 10, acquire_timeout_s: float = 3.0
    ) -> None:
        super().__init__(Q, clock)
        self.url = url
        self.pool_size = pool_size
        #: How long a call waits for a connection before it says the store is unavailable.
        self.acquire_timeout_s = acquire_timeout_s
        self._pool: Pool | None = None
        self._home: asyncio.AbstractEventLoop | None = None
        self._migrated = False
        self._open_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._last_notify = 0.0
        self._listener: asyncio.Task[None] | None = None
        self.ready_listeners: list[Callable[[], None]] = []
        self._closed = False
        self._batches: dict[asyncio.AbstractEventLoop, WriteBatch] = {}
        self.shapes = Shapes()

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
            await self.shapes.read_types(conn)
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

    async def _write(self, op: Op[T]) -> T:
        """Run ``op`` in one transaction with its counter deltas, retried when the
        connection broke before COMMIT or the database asked for a retry."""
        for attempt in range(4):
            try:
                result = await self._transaction(op)
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
            if isinstance(result, Refused):
                raise result.error
            return result
        raise AssertionError("unreachable")

    async def _transaction(self, op: Op[T]) -> T | Refused:
        async with self._connection() as conn:
            await conn.execute("BEGIN")
            tx = PostgresTx(conn, self._notify_now)
            try:
                result = await op(tx)
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

    async def _write_many(self, ops: Sequence[Op[T]]) -> list[T | Exception]:
        """One transaction, each operation in a savepoint of its own: one that fails or
        refuses leaves the others to commit."""

        async def batch(tx: Tx) -> list[T | Exception]:
            return [await alone(tx, op) for op in ops]

        return await self._write(batch) if ops else []

    async def _read(self, op: Callable[[Tx], Awaitable[T]]) -> T:
        for attempt in range(4):
            try:
                async with self._connection() as conn:
                    return await op(PostgresTx(conn))
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

    def _notify_now(self) -> bool:
        return self._notify_due(self.clock())

    @property
    def write_batches(self) -> tuple[int, int]:
        """(transactions, writes) of the one-statement batches of this process so far."""
        done = list(self._batches.values())
        return sum(b.batches for b in done), sum(b.writes for b in done)

    @property
    def write_statements(self) -> int:
        """The statements those batches of more than one write sent."""
        return sum(b.statements for b in self._batches.values())

    # the one-statement paths

    async def submit(
        self, new: NewTask, *, place: bool = False, policy: ClaimPolicy | None = None
    ) -> SubmitResult:
        if new.idempotency_key is None and not new.inputs and new.trace is None:
            task = await self._insert_in_one_statement(new)
            if task is not None:
                # Batched with other submissions' statements: its position is read after.
                position = await self.queue_position(task, policy) if place else None
                return SubmitResult(task, created=True, queue_position=position, placed=place)
        # A key to claim, inputs or a trace context to record, or the same content already
        # live or done: in a transaction (the position too, when asked).
        return await super().submit(new, place=place, policy=policy)

    async def _insert_in_one_statement(self, new: NewTask) -> Task | None:
        """A submission without an idempotency key as one statement: the task (unless a
        live or successful task holds its content), its event and its count. None when
        the content is taken (the transactional path then answers with that task)."""
        now = self.clock()
        bare = [*insert_args(new, now), str(Event.SUBMIT), now]
        counted = [*bare, random.randrange(COUNTER_SHARDS)]
        values = {f"k_{name}": value for name, value in zip(SUBMIT_NAMES, bare, strict=True)}

        def counts(row: Row, tally: Tally) -> None:
            tally.count_status(row[1], Status.PENDING, 1)

        row = await self._batched(
            new.id,
            (SUBMIT_COUNTED, counted),
            (SUBMIT_BARE, bare),
            counts,
            notify=self._notify_due(now),
            shape=SUBMIT_SHAPE,
            values=values,
        )
        return None if row is None else task_from_row(row)

    async def _batched(
        self,
        order: str,
        counted: tuple[str, Args],
        bare: tuple[str, Args],
        counts: Callable[[Row, Tally], None],
        *,
        notify: bool = False,
        shape: Shape | None = None,
        values: dict[str, Any] | None = None,
    ) -> Row | None:
        """One write through this loop's batch (``pgbatch.WriteBatch``); one of a ``shape`` may
        share a statement with others of it, ``values`` its row of the arrays."""
        loop = asyncio.get_running_loop()
        batch = self._batches.get(loop)
        if batch is None:
            batch = self._batches[loop] = WriteBatch(self)
        future = loop.create_future()
        return await batch.run(
            Write(order, counted, bare, counts, notify, future, shape, values or {})
        )

    async def _statement(self, sql: str, args: Args, *, notify: bool = False) -> Row | None:
        """One statement in autocommit (NOTIFY after it when it wrote a row and ``notify``).
        A broken connection may have committed it: the caller's retry re-reads the row
        and either finds the change done (a refusal) or does it."""
        rows = await self._autocommit(sql, args, notify=notify)
        return rows[0] if rows else None

    async def _autocommit(self, sql: str, args: Args, *, notify: bool = False) -> list[Row]:
        """:meth:`_statement`, every row it returns."""
        for attempt in range(4):
            try:
                async with self._connection() as conn:
                    rows = await (await conn.execute(sql, args)).fetchall()
                    if rows and notify:
                        await conn.execute(f"NOTIFY {READY_CHANNEL}")
                return rows
            except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                if attempt == 3:
                    raise
            except psycopg.errors.IntegrityError as exc:
                raise translated(exc) from None
            except (psycopg.OperationalError, PoolTimeout) as exc:
                await self._drop_broken()
                raise StoreUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
        raise AssertionError("unreachable")

    async def _claim_in_order(self, lease: Lease, kinds: list[str], limit: int) -> list[Task]:
        """One statement (:mod:`kiln.store.pgclaim`)."""
        args = claim_args(lease.worker_id, kinds, limit, lease.ttl_s, lease.acquire, self.clock())
        return claimed_of(await self._autocommit(Q.claim_plain, args), lease.worker_id)

    async def _apply_change(self, change: Change) -> tuple[Task, list[TaskEvent]]:
        if _is_plain(change):
            applied = await self._apply_in_one_statement(change)
            if applied is not None:
                return applied
        # Everything else, and a refusal (worded by the full path), in a transaction.
        return await super()._apply_change(change)

    async def _apply_in_one_statement(self, change: Change) -> tuple[Task, list[TaskEvent]] | None:
        """A worker's plain step (acquire, generated, uploaded, fail without retry) as one
        statement (:mod:`kiln.store.pgstep`): lock and check the row, update it, insert its
        event (and the ledger's row of the attempt it ends) and add the counts. None when
        the row did not match (the caller then words the refusal)."""
        now = self.clock()
        shape, values, counts = step_write(change, now)
        shard = {"shard": random.randrange(COUNTER_SHARDS)}
        row = await self._batched(
            change.task_id,
            (self.shapes.one(shape.alone()), {**values, **shard}),
            (self.shapes.one(shape), values),
            counts,
            shape=shape,
            values=values,
        )
        if row is None:
            return None
        task = task_from_row(row)
        return task, _step_events(change, task, row, now)

    # the event log

    async def _log_after(self, after: int, limit: int, gaps: dict[int, int]) -> list[TaskEvent]:
        """The events after ``after`` that no commit still in flight can precede.

        A seq is taken at insert and shows at commit, so a reader can see seq 7 before 6.
        The tail stops at such a gap. Every writer has its transaction id before it takes
        a seq, so the transactions that may still fill a gap were all running when the gap
        was first seen (ids below that snapshot's xmax). Once the oldest running
        transaction is past that xmax and the gap is still there, it never fills (a
        rollback) and the tail moves on.
        """

        async def read(tx: Tx) -> list[Row]:
            return await tx.all(Q.tail, (after, limit))

        return _past_gaps(await self._read(read), after, gaps)

    async def last_seq(self) -> int:
        """Where a tail may start: the newest seq below which no gap is pending."""

        async def read(tx: Tx) -> tuple[int, list[Row]]:
            row = await tx.one("SELECT coalesce(max(seq), 0) FROM events")
            newest = int(row[0]) if row else 0
            return newest, await tx.all(Q.tail, (max(0, newest - 1000), 1001))

        newest, rows = await self._read(read)
        expect = None
        for row in rows:
            if expect is not None and row[0] > expect:
                self._tail_gaps.setdefault(expect, row[-1])
                return int(expect) - 1
            expect = row[0] + 1
        return newest


def _is_plain(change: Change) -> bool:
    """A worker's fenced step (one event, or two: ``generated`` then ``uploaded``) that
    needs nothing but the row, its events and the counts, and effects the one statement
    writes itself (the ledger's row): no leader, no epoch bump, no dedup re-entry, no
    counters, no wake-up, no pipeline to advance, no model load to record on its event."""
    fence = change.fence
    return (
        len(change.steps) <= 2
        and change.target is not change.expect_status
        and fence.fenced
        and change.expect_epoch is not None
        and fence.leader is None
        and not fence.bump
        and change.expect_status not in ENDED_UNSUCCESSFULLY
        and all(effect.in_statement for effect in effects_of(change))
    )


async def _check_task_columns(conn: Conn) -> None:
    cur = await conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'tasks'::regclass AND attnum > 0"
        " AND NOT attisdropped ORDER BY attnum"
    )
    found = tuple(row[0] for row in await cur.fetchall())
    if found != TASK_COLUMNS:
        raise RuntimeError(f"tasks columns {found} differ from TASK_COLUMNS {TASK_COLUMNS}")


__all__ = ["PostgresStore", "migrate"]


def _step_events(change: Change, task: Task, row: Row, now: float) -> list[TaskEvent]:
    """The event rows a plain step wrote (``row``: the task's columns, its dwell start, ...,
    its event's seq, or its two events' seqs), numbered as the row path numbers them."""
    seqs = row[-1] if isinstance(row[-1], list) else [row[-1]]
    first = task.version - len(change.steps)
    rows = event_rows(change, task, first, now - row[len(TASK_COLUMNS)], now)
    return [logged.event_for(seq) for logged, seq in zip(rows, seqs, strict=True)]
