"""The Store protocol: the atomic primitives every backend implements.

Policy (which event applies, retry backoff, dedup rules) lives above, in the engine; a
backend only knows how to apply a compare-and-set change with its event rows atomically,
how to insert-or-get a submission, and how to find what is due.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kiln.counters import FAILURE_BUCKETS_KEPT_MIN, FAILURES_BY_MINUTE
from kiln.limits import Rate
from kiln.models import NewTask, SubmitResult, Task, TaskEvent
from kiln.states import Status
from kiln.store.claims import ClaimPolicy
from kiln.store.outbox import WebhookAttempt, WebhookDelivery, WebhookScan
from kiln.store.pools import PoolUsage, PoolWait
from kiln.store.records import (
    BreakerRecord,
    Change,
    Clock,
    Due,
    LeaderToken,
    Progress,
    Stats,
)


class Store(Protocol):
    """A durable home for tasks, their event log, idempotency records and leaders."""

    clock: Clock

    async def submit(self, new: NewTask) -> SubmitResult: ...

    async def get(self, task_id: str) -> Task | None: ...

    async def get_many(self, task_ids: Sequence[str]) -> dict[str, Task]:
        """The tasks of ``task_ids`` that exist, by id, read in one query (the reconciler
        looks up the tasks of a page of objects at once)."""
        ...

    async def list_tasks(
        self,
        *,
        tenant: str | None,
        status: Status | None = None,
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Task], str | None]: ...

    async def claim(
        self,
        *,
        worker_id: str,
        kinds: list[str],
        limit: int,
        lease_ttl_s: float,
        policy: ClaimPolicy | None = None,
    ) -> list[Task]:
        """Claim up to ``limit`` ready tasks of ``kinds``: in priority, then ready-time
        order, or as ``policy`` says (aging, fair turns, running caps: store/claims.py)."""
        ...

    async def apply(self, change: Change) -> tuple[Task, list[TaskEvent]]: ...

    async def apply_many(
        self, changes: Sequence[Change]
    ) -> list[tuple[Task, list[TaskEvent]] | Exception]:
        """Apply several tasks' changes in one call (one group commit, one transaction on
        PostgreSQL), each its own compare-and-set: a refused change comes back as its
        error (LeaseLost, Conflict, ...) and the others commit (I11)."""
        ...

    async def heartbeat(
        self, task_id: str, epoch: int, lease_ttl_s: float, progress: Progress | None
    ) -> Task: ...

    async def request_cancel(self, task_id: str) -> Task: ...

    async def due(self, *, limit: int, cancel_grace_s: float) -> Due: ...

    async def events(
        self,
        *,
        task_id: str | None = None,
        tenant: str | None = None,
        after: int = 0,
        limit: int = 500,
    ) -> list[TaskEvent]: ...

    async def last_seq(self) -> int:
        """Where a tail of the log may start (see ``tail``)."""
        ...

    async def tail(self, *, after: int, limit: int = 1000) -> list[TaskEvent]:
        """Events after ``after`` in seq order, such that no event with a smaller seq can
        still appear: what a follower of the whole log reads (one per process)."""
        ...

    def watch_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when another process made work claimable. Backends without
        a notification channel do nothing: their workers find such work by polling."""
        ...

    async def progressed(self, *, since: float, limit: int = 500) -> list[Task]: ...

    async def queue_position(self, task: Task, policy: ClaimPolicy | None = None) -> int | None:
        """1 for the next task a claim of its kind takes (under ``policy``: with fair
        turns, an estimate from the task's place in its tenant's line), while it is ready."""
        ...

    async def stats(self, *, tenant: str | None, ghost_after_s: float) -> Stats: ...

    async def count_ghosts(self, *, older_than_s: float) -> int: ...

    async def lead(self, name: str, owner: str, ttl_s: float) -> LeaderToken | None: ...

    async def purge(
        self,
        *,
        finished_before: float,
        tenant: str | None = None,
        exclude: Sequence[str] = (),
        limit: int = 500,
    ) -> list[Task]:
        """Delete up to ``limit`` final tasks that finished before ``finished_before`` (of
        ``tenant``, or of every tenant but ``exclude``), oldest first, with their events and
        idempotency keys, in one transaction; return them (their objects are the caller's)."""
        ...

    async def acquire_slots(
        self,
        task_id: str,
        epoch: int,
        needs: Mapping[str, int],
        capacities: Mapping[str, int],
        *,
        in_line: bool = False,
    ) -> PoolWait | None:
        """Take ``needs`` units of each pool named in ``capacities`` for the attempt at
        ``epoch`` (WAITING_FOR_RESOURCE), all or none. None: granted (or nothing to take);
        else the task's place in the line, kept for the next call. The slots come back by
        themselves when the task leaves GENERATING or its lease lapses (kiln/store/pools.py).
        ``in_line``: the task asked before, so a plain read may answer that it still
        waits. Raises LeaseLost when the task is not held at ``epoch``."""
        ...

    async def pool_wait(self, task_id: str) -> PoolWait | None:
        """Where a waiting task stands in the line of a pool, or None."""
        ...

    async def pools(self) -> list[PoolUsage]:
        """Every pool ever acquired, with its capacity, units held and tasks waiting."""
        ...

    async def take_token(self, name: str, rate: Rate) -> float:
        """Take one token from the bucket ``name``: 0.0 when taken, else the seconds until
        one is there (nothing taken). Shared by every process on the store."""
        ...

    async def counters(self) -> dict[tuple[str, str], int]: ...

    async def bump(self, name: str, labels: str = "") -> None: ...

    # webhooks: the outbox that the dispatcher (kiln.webhooks) fills from the event log

    async def webhook_scan(self, *, limit: int) -> WebhookScan:
        """Up to ``limit`` events after the outbox cursor, read like ``tail`` (no event
        with a smaller seq can still appear), with the tasks among them that have a webhook."""
        ...

    async def webhook_enqueue(self, deliveries: Sequence[WebhookDelivery], *, cursor: int) -> int:
        """Add the deliveries of tasks that still exist (an event id already there is
        skipped) and move the cursor up to ``cursor``, in one transaction; how many were added."""
        ...

    async def webhook_due(self, *, limit: int) -> list[WebhookDelivery]:
        """Pending deliveries due now, soonest first; only the first pending delivery of
        each task (in seq order), so a task's deliveries go out one after the other."""
        ...

    async def webhook_record(self, attempt: WebhookAttempt) -> None:
        """Write what a delivery attempt came to (a row no longer pending is left as it
        is) and count it in ``counters`` as ``("webhook_deliveries", outcome)``."""
        ...

    async def webhook_deliveries(
        self, *, task_id: str | None = None, limit: int = 100
    ) -> list[WebhookDelivery]:
        """Deliveries in seq order, of one task or of all, whatever their status."""
        ...

    async def webhook_pending(self) -> int: ...

    # breakers: circuit breaker states and the retry clock, shared by every process

    async def breakers(self) -> list[BreakerRecord]:
        """Every breaker's shared state, by name (one small read)."""
        ...

    async def save_breaker(self, record: BreakerRecord, *, only_if_due: bool = False) -> bool:
        """Write ``record`` (insert or replace) and count the transition in ``counters`` as
        ``("breaker_transitions", "<name>><state>")``. With ``only_if_due`` it is written
        only when no row exists or the stored one is open or half-open with
        ``opened_until`` at or before ``record.updated_at``: the compare-and-set that lets
        one process take the half-open probe. Whether it was written."""
        ...

    async def reserve_retry(self, earliest: float, interval_s: float) -> float:
        """The retry slot for a retry due at ``earliest``: max(earliest, the clock's next
        free slot); the clock moves to that slot + ``interval_s``, atomically, so retries
        from every process are spread ``interval_s`` apart."""
        ...

    async def close(self) -> None: ...


def open_store(
    url: str, *, clock: Clock | None = None, synchronous: str = "NORMAL", pool_size: int = 10
) -> Store:
    """Open the store a URL names: ``sqlite:///relative.db``, ``sqlite:////abs.db``,
    ``postgresql://user:password@host:5432/database``."""
    import time

    if url.startswith("sqlite:"):
        from kiln.store.sqlite import SqliteStore, sqlite_path

        return SqliteStore(sqlite_path(url), clock=clock or time.time, synchronous=synchronous)
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
    "Due",
    "LeaderToken",
    "Progress",
    "Stats",
    "Store",
    "open_store",
]
