"""SQLite driver: WAL, stdlib ``sqlite3``, group commit on one writer thread.

All writes of a process go through one writer thread that drains its queue and runs what
it found in one ``BEGIN IMMEDIATE`` transaction, each operation still its own
compare-and-set (a savepoint each when one fails after it wrote, see
:meth:`_DbThread._run_transaction`): concurrent workers share one commit (and one fsync
with ``synchronous=FULL``) without sharing fate. Reads run on a second thread with its
own connection; WAL lets them proceed while the writer commits. Other processes on the
same file take turns at a file lock around each transaction, waiting in the kernel, and
wake each other's workers after a commit that made work claimable
(:mod:`kiln.store.sqlite_share`); SQLite's own lock and ``busy_timeout`` remain for a
writer that does not take that lock.

The store's operations (:mod:`kiln.store.sqlstore`) are async functions of a transaction;
here they run to their end on the thread that owns the connection (:func:`run_sync`),
since a :class:`SqliteTx`'s awaits never suspend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kiln.errors import StoreUnavailable
from kiln.models import NewTask, SubmitResult
from kiln.store.claims import ClaimPolicy
from kiln.store.queries import Queries, migrations, queries
from kiln.store.records import Clock
from kiln.store.rows import insert_parts, inserted_row
from kiln.store.sqlite_share import Wakeups, WriteLock
from kiln.store.sqlite_submits import Grouped, submit_group
from kiln.store.sqlite_tx import (
    INSERT_TASK,
    Connection,
    SqliteTx,
    check_task_columns,
    flush_tally,
    kiln_connection,
    tally_of,
)
from kiln.store.sqlstore import Store
from kiln.store.submit_process import SubmitProcess
from kiln.store.tx import (
    Op,
    Refused,
    Row,
    Tally,
    Tx,
    run_sync,
)

log = logging.getLogger("kiln.store")

T = TypeVar("T")
SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")
#: The longest pause after a bulk page (it pauses as long as the page took).
BULK_PAUSE_MAX_S = 1.0
#: How long a connection waits for SQLite's own lock (by polling) before it gives up.
BUSY_TIMEOUT_MS = 30_000


def sqlite_path(url: str) -> str:
    """``sqlite:///rel.db`` → ``rel.db``; ``sqlite:////abs.db`` → ``/abs.db``."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r} (expected sqlite:///path.db)")
    path = url.removeprefix("sqlite:///").split("?", 1)[0]
    if not path:
        raise ValueError(f"sqlite URL without a path: {url!r}")
    return path


def connect(path: str, *, synchronous: str = "FULL") -> sqlite3.Connection:
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=30.0, factory=Connection
    )
    _use_wal(conn)
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    # Not temp_store=MEMORY: that keeps the savepoint journal in memory, and at the end of
    # every statement that wrote, SQLite cuts that in-memory journal back by walking it
    # from its start, so each write costs more the more the enclosing savepoint (the group
    # commit's, one per operation) wrote before it: a large operation (a bulk page of
    # pipelines) went quadratic. With FILE the journal stays in memory up to 64 KiB, then
    # spills to a temporary file, which is cut back at the same cost whatever its size.
    conn.execute("PRAGMA temp_store=FILE")
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


def migrate(conn: sqlite3.Connection) -> int:
    """Apply pending migrations, each in its own transaction; safe across processes."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
    )
    applied = 0
    for version, name, sql in migrations("sqlite"):
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
class _Job:
    fn: Callable[[sqlite3.Connection], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    #: A plain submission the writer may write with others of its batch (its ``fn``
    #: writes it alone).
    grouped: Grouped | None = None


def _resolve(items: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, error in items:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        elif isinstance(result, Refused):
            future.set_exception(result.error)
        else:
            future.set_result(result)


class _DbThread(threading.Thread):
    """Runs queued operations on its own connection; the writer batches them."""

    def __init__(
        self,
        name: str,
        open_conn: Callable[[], sqlite3.Connection],
        *,
        writer: bool,
        lock: WriteLock | None = None,
        wakeups: Wakeups | None = None,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._open_conn = open_conn
        self._writer = writer
        self.lock = lock
        self.wakeups = wakeups
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.max_batch = 512
        self.batches = 0
        self.operations = 0
        self.reruns = 0  # batches run again with a savepoint per operation
        self.conn: sqlite3.Connection | None = None

    def put(self, job: _Job | None) -> None:
        self._jobs.put(job)

    def put_many(self, jobs: list[_Job]) -> None:
        for job in jobs:
            self._jobs.put(job)

    def run(self) -> None:
        conn = self.conn = self._open_conn()
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                batch = [job]
                if self._run(conn, batch, stop=self._fill(batch)):
                    return
        finally:
            conn.close()

    def _fill(self, batch: list[_Job]) -> bool:
        """Add what is queued to ``batch``, up to :attr:`max_batch`; whether the stop
        sentinel came."""
        while len(batch) < self.max_batch:
            try:
                more = self._jobs.get_nowait()
            except queue.Empty:
                return False
            if more is None:
                return True
            batch.append(more)
        return False

    def _run(self, conn: sqlite3.Connection, batch: list[_Job], *, stop: bool) -> bool:
        """Run the batch and answer its callers; whether the thread is to stop."""
        outcomes: list[tuple[_Job, Any, BaseException | None]]
        if self._writer:
            outcomes, stop = self._locked_transaction(conn, batch, stop=stop)
        else:
            outcomes = []
            for job in batch:
                try:
                    outcomes.append((job, job.fn(conn), None))
                except Exception as exc:
                    outcomes.append((job, None, exc))
        # Counted before anyone is answered: a caller that reads the counts after its
        # answer sees its own batch in them.
        self.batches += 1
        self.operations += len(batch)
        self._answer(outcomes)
        return stop

    def _answer(self, outcomes: list[tuple[_Job, Any, BaseException | None]]) -> None:
        """Hand each caller its outcome on its own event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for job, result, error in outcomes:
            by_loop.setdefault(job.loop, []).append((job.future, result, error))
        for loop, items in by_loop.items():
            # RuntimeError: the caller's loop is closed, and nobody waits for the answer.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, items)

    def _locked_transaction(
        self, conn: sqlite3.Connection, batch: list[_Job], *, stop: bool
    ) -> tuple[list[tuple[_Job, Any, BaseException | None]], bool]:
        """The batch's transaction under the processes' file lock (when there is one),
        then the wake-up of the other processes when it made work claimable. What was
        queued while another process held the lock joins the batch (one commit, one
        turn at the lock, for all of it)."""
        if self.lock is not None and self.lock.acquire() and not stop:
            stop = self._fill(batch)
        try:
            outcomes = self._run_transaction(conn, batch)
        except Exception as exc:  # the transaction itself broke: fail the whole batch
            log.exception("sqlite_batch_failed", extra={"operations": len(batch)})
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            outcomes = [(job, None, exc) for job in batch]
        finally:
            if self.lock is not None:
                self.lock.release()
        ready = kiln_connection(conn)
        if ready.ready:
            ready.ready = False
            if self.wakeups is not None:
                self.wakeups.notify()
        return outcomes, stop

    def _begin(self, conn: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE``: at once under the file lock; only when a writer outside
        it holds SQLite's lock, waited for by ``busy_timeout``, and counted."""
        if self.lock is None:
            conn.execute("BEGIN IMMEDIATE")
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorname", "") != "SQLITE_BUSY":
                raise
            self.lock.busy_waits += 1
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            try:
                conn.execute("BEGIN IMMEDIATE")
            finally:
                conn.execute("PRAGMA busy_timeout=0")

    def _run_transaction(
        self, conn: sqlite3.Connection, batch: list[_Job]
    ) -> list[tuple[_Job, Any, BaseException | None]]:
        """The batch in one transaction, each operation its own compare-and-set.

        First without a savepoint per operation (two statements each, inside the lock):
        an operation that fails before it changed a row needs none. Only when one fails
        after it changed rows is the transaction rolled back and the whole batch run again,
        each operation in its own savepoint, so that one rolls back alone (operations are
        functions of the transaction, run again after any rollback, as on PostgreSQL).
        """
        try:
            self._begin(conn)
        except sqlite3.Error as exc:
            return [(job, None, exc) for job in batch]
        done = _run_operations(conn, batch, savepoints=False)
        if done is None:
            self.reruns += 1
            conn.execute("ROLLBACK")
            kiln_connection(conn).ready = False
            try:
                self._begin(conn)
            except sqlite3.Error as exc:
                return [(job, None, exc) for job in batch]
            done = _run_operations(conn, batch, savepoints=True)
        assert done is not None
        outcomes, committed = done
        try:
            flush_tally(conn, committed)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            return [(job, None, exc) for job in batch]
        return outcomes


def _run_operations(
    conn: sqlite3.Connection, batch: list[_Job], *, savepoints: bool
) -> tuple[list[tuple[_Job, Any, BaseException | None]], Tally] | None:
    """Run the batch's operations in the open transaction: their outcomes and the counter
    deltas of those that succeeded; None when, without savepoints, one failed after it
    changed rows (``total_changes`` moved), which only a rollback can undo. Without
    savepoints, plain submissions next to each other are written as one group
    (:func:`_run_group`), or one by one when the group leaves them to that."""
    outcomes: list[tuple[_Job, Any, BaseException | None]] = []
    tally = tally_of(conn)
    committed = Tally()
    start = 0
    alone = 0  # the jobs before this index run one by one
    while start < len(batch):
        end = _group_end(batch, start) if start >= alone and not savepoints else start
        if end - start >= 2:
            group = batch[start:end]
            written = _run_group(conn, group, tally)
            if written is _BROKEN:
                return None
            if written is not None:
                committed.update(tally)
                outcomes += [
                    (job, result, None) for job, result in zip(group, written, strict=True)
                ]
                start = end
                continue
            alone = end
        job = batch[start]
        start += 1
        outcome = _run_one(conn, job, tally, savepoints=savepoints)
        if outcome is _BROKEN:
            return None
        if outcome[2] is None:
            committed.update(tally)
        outcomes.append(outcome)
    tally.clear()
    return outcomes, committed


def _group_end(batch: list[_Job], start: int) -> int:
    """The end of the run of plain submissions from ``start``."""
    end = start
    while end < len(batch) and batch[end].grouped is not None:
        end += 1
    return end


def _run_one(conn: sqlite3.Connection, job: _Job, tally: Tally, *, savepoints: bool) -> Any:
    """One operation: its outcome (its counts in ``tally``), or :data:`_BROKEN` when it
    failed, without a savepoint, after it changed rows."""
    if savepoints:
        conn.execute("SAVEPOINT op")
    changes = conn.total_changes
    tally.clear()
    try:
        result = job.fn(conn)
    except Exception as exc:
        if savepoints:
            conn.execute("ROLLBACK TO op")  # the operation's counts go with it
            conn.execute("RELEASE op")
        elif conn.total_changes != changes:
            tally.clear()
            return _BROKEN
        tally.clear()
        return (job, None, exc)
    if savepoints:
        conn.execute("RELEASE op")
    return (job, result, None)


#: What :func:`_run_group` answers when the group failed after it changed rows.
_BROKEN: Any = object()


def _run_group(conn: sqlite3.Connection, group: list[_Job], tally: Tally) -> Any:
    """Plain submissions written together (:mod:`kiln.store.sqlite_submits`): their
    results in order; None when they are to run one by one (nothing written);
    :data:`_BROKEN` when the group failed after it changed rows."""
    changes = conn.total_changes
    tally.clear()
    items = [job.grouped for job in group]
    try:
        results = submit_group(SqliteTx(conn, items[0].store.q), items)  # type: ignore[union-attr,arg-type]
    except Exception:
        results = None
        if conn.total_changes != changes:
            log.warning("sqlite_submit_group_failed", exc_info=True)
            tally.clear()
            return _BROKEN
    if results is None:
        tally.clear()
    else:
        kiln_connection(conn).grouped += len(results)
    return results


def job_of(q: Queries, op: Callable[[Tx], Awaitable[Any]]) -> Callable[[sqlite3.Connection], Any]:
    """What a database thread runs for ``op``: it on a transaction of the thread's connection."""
    return lambda conn: run_sync(op(SqliteTx(conn, q)))  # type: ignore[arg-type]


# The store ------------------------------------------------------------------------------


class SqliteStore(Store):
    """The embedded default store. See the module docstring for its threading model."""

    def __init__(
        self, path: str, *, clock: Clock, synchronous: str = "FULL", submit_process: bool = False
    ) -> None:
        super().__init__(queries("sqlite"), clock)
        synchronous = synchronous.upper()
        if synchronous not in SYNCHRONOUS_LEVELS:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_LEVELS}")
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.synchronous = synchronous
        try:
            setup = connect(path, synchronous=synchronous)
            try:
                migrate(setup)
                check_task_columns(setup)
            finally:
                setup.close()
        except sqlite3.DatabaseError as exc:
            raise StoreUnavailable(
                f"cannot open the SQLite database {path}: {exc} (restore it from a backup,"
                " or point KILN_DATABASE_URL at another file)"
            ) from None
        shared = path != ":memory:" and not path.startswith("file:")
        self._lock = WriteLock(path) if shared else None
        self._wakeups = Wakeups(path) if shared else None
        self._writer = _DbThread(
            "kiln-sqlite-writer",
            lambda: self._writerkiln_connection(path, synchronous),
            writer=True,
            lock=self._lock,
            wakeups=self._wakeups,
        )
        self._reader = _DbThread(
            "kiln-sqlite-reader", lambda: connect(path, synchronous=synchronous), writer=False
        )
        self._writer.start()
        self._reader.start()
        self._closed = False
        #: Plain submissions go to a process of their own (:mod:`kiln.store.submit_process`).
        self.submitter = (
            SubmitProcess(path, synchronous, self._settle_submit)
            if submit_process and shared
            else None
        )

    def _writerkiln_connection(self, path: str, synchronous: str) -> sqlite3.Connection:
        conn = connect(path, synchronous=synchronous)
        if self._lock is not None:  # SQLite's lock is free whenever the file lock is ours
            conn.execute("PRAGMA busy_timeout=0")
        return conn

    async def submit(
        self, new: NewTask, *, place: bool = False, policy: ClaimPolicy | None = None
    ) -> SubmitResult:
        """As :meth:`Store.submit`; a plain submission may be written with the others of
        its group commit (:mod:`kiln.store.sqlite_submits`)."""
        if not Grouped.takes(new, policy):
            return await super().submit(new, place=place, policy=policy)
        if self.submitter is not None and self.submitter.ready():
            return await self.submitter.submit(new, place, policy, self.clock())
        return await self._submit_here(new, place, policy)

    async def _submit_here(
        self, new: NewTask, place: bool, policy: ClaimPolicy | None
    ) -> SubmitResult:
        """A plain submission on this process's writer, with the others of its batch."""
        prepared = insert_parts(new)
        op = self._submit_op(new, prepared, place, policy)
        grouped = Grouped(self, new, prepared, place, policy)
        result: SubmitResult = await self._submit_to(self._writer, self._job(op), grouped)
        return result

    async def _settle_submit(
        self, new: NewTask, place: bool, policy: ClaimPolicy | None
    ) -> SubmitResult:
        """A submission whose submit process died before it answered: its task when that
        process wrote it (the process is gone, so it is written or never will be), else
        written here."""
        task = await self.get(new.id)
        if task is None:
            return await self._submit_here(new, place, policy)
        position = await self.queue_position(task, policy) if place else None
        return SubmitResult(task, created=True, queue_position=position, placed=place)

    async def _insert_row(self, tx: Tx, args: list[Any]) -> Row | None:
        """The new task's row built from ``args`` as SQLite stores them, not read back
        (``RETURNING *`` costs the writer, inside the file lock, more than building it)."""
        row = inserted_row(args)
        if row is None:  # a value SQLite converts in its own way
            return await super()._insert_row(tx, args)
        return row if await tx.run(INSERT_TASK, args) else None

    def watch_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when a writer of another process made work claimable."""
        if self._wakeups is not None:
            self._wakeups.watch(callback)

    def lock_stats(self) -> dict[str, float]:
        """How this process's writer used the file lock: times taken, times it blocked
        because another process held it, seconds blocked, and times it had to wait on
        SQLite's ``busy_timeout`` (a writer outside the lock)."""
        return {} if self._lock is None else self._lock.stats()

    def _job(self, op: Callable[[Tx], Awaitable[Any]]) -> Callable[[sqlite3.Connection], Any]:
        return job_of(self.q, op)

    async def _write(self, op: Op[T]) -> T:
        result: T = await self._submit_to(self._writer, self._job(op))
        return result

    async def _read(self, op: Callable[[Tx], Awaitable[T]]) -> T:
        result: T = await self._submit_to(self._reader, self._job(op))
        return result

    async def _write_many(self, ops: Sequence[Op[T]]) -> list[T | Exception]:
        """Queued together, so the writer commits them in one group."""
        if not ops:
            return []
        futures = self._enqueue(self._writer, [self._job(op) for op in ops])
        done = await asyncio.gather(*futures, return_exceptions=True)
        for outcome in done:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
        return done  # type: ignore[return-value]

    def _enqueue(
        self, thread: _DbThread, fns: list[Callable[[sqlite3.Connection], Any]]
    ) -> list[asyncio.Future[Any]]:
        if not thread.is_alive():
            raise StoreUnavailable(f"the store's {thread.name} thread is not running")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in fns]
        thread.put_many([_Job(fn, loop, future) for fn, future in zip(fns, futures, strict=True)])
        return futures

    @staticmethod
    async def _submit_to(
        thread: _DbThread,
        fn: Callable[[sqlite3.Connection], Any],
        grouped: Grouped | None = None,
    ) -> Any:
        if not thread.is_alive():
            raise StoreUnavailable(f"the store's {thread.name} thread is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        thread.put(_Job(fn, loop, future, grouped))
        return await future

    async def _after_bulk_page(self, took_s: float) -> None:
        """After a page of a bulk action (:mod:`kiln.store.bulk`), a pause as long as it
        took (up to :data:`BULK_PAUSE_MAX_S`) before the next page can start: a run of
        pages holds the file's write lock at most half the time. This process's own writes
        queue behind a page in order; other processes on the file (workers renewing their
        leases) wait for the file lock (:class:`~kiln.store.sqlite_share.WriteLock`), which
        is not handed over in arrival order, and back-to-back pages would leave them only
        the moments between two."""
        await asyncio.sleep(min(took_s, BULK_PAUSE_MAX_S))

    @property
    def grouped_submits(self) -> int:
        """Submissions the writers (this process's, its submit processes') have written
        together with others of their batch."""
        conn = self._writer.conn
        here = 0 if conn is None else kiln_connection(conn).grouped
        return here + (0 if self.submitter is None else self.submitter.counts[2])

    @property
    def write_batches(self) -> tuple[int, int]:
        """(transactions, operations) the writers have committed so far."""
        there = (0, 0, 0) if self.submitter is None else self.submitter.counts
        return self._writer.batches + there[0], self._writer.operations + there[1]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.submitter is not None:
            await self.submitter.close()
        self._writer.put(None)
        self._reader.put(None)
        await asyncio.to_thread(self._writer.join)
        await asyncio.to_thread(self._reader.join)
        if self._wakeups is not None:
            self._wakeups.close()
        if self._lock is not None:
            self._lock.close()


__all__ = ["SqliteStore", "connect", "migrate", "sqlite_path"]
