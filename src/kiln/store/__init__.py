"""The Store protocol: the atomic primitives every backend implements.

Policy (which event applies, retry backoff, dedup rules) lives above, in the engine; a
backend only knows how to apply a compare-and-set change with its event rows atomically,
how to insert-or-get a submission, and how to find what is due.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.models import JSON, NewTask, SubmitResult, Task, TaskEvent
from kiln.states import Event, Status

Clock = Callable[[], float]

#: Counter of failed attempts per minute, labels ``<minute since epoch, 10 digits>:<tenant>:
#: <code>``, so a time range is a key range. Buckets older than a day are dropped.
FAILURES_BY_MINUTE = "failures_by_minute"
FAILURE_BUCKETS_KEPT_MIN = 24 * 60


@dataclass(frozen=True, slots=True)
class LeaderToken:
    """Proof of leadership: writes made with it are refused once another leader took over."""

    name: str
    owner: str
    epoch: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class Change:
    """One compare-and-set on a task plus the event rows of its status changes.

    The UPDATE matches only ``(task_id, expect_status, expect_epoch)``; ``steps`` chain
    from ``expect_status`` (``fail`` then ``schedule_retry`` is two steps, one
    transaction). ``fields`` are the columns to set besides status and bookkeeping.
    """

    task_id: str
    expect_status: Status
    expect_epoch: int | None
    steps: tuple[tuple[Event, Status], ...]
    fields: dict[str, Any] = field(default_factory=dict)
    error: JSON | None = None
    bump_epoch: bool = False
    fenced: bool = False
    leader: LeaderToken | None = None
    counters: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Progress:
    stage: str | None
    step: int | None
    total: int | None


@dataclass(frozen=True, slots=True)
class Due:
    """What a supervisor sweep must act on, bounded by the sweep's limit.

    Each task is filed under one reason, the first that applies: deadline passed, lease
    expired, state timeout; overdue cancels are found apart.
    """

    lease_expired: list[Task]
    state_expired: list[Task]
    deadline_passed: list[Task]
    cancel_overdue: list[Task]


@dataclass(frozen=True, slots=True)
class Stats:
    counts: dict[str, int]
    failures: dict[str, int]
    dwell_seconds: dict[str, dict[str, float]]
    ghosts: int
    oldest_ready_at: float | None
    #: Failed attempts by code over the last 60 minutes (per-minute buckets).
    failures_last_hour: dict[str, int] = field(default_factory=dict)


class Store(Protocol):
    """A durable home for tasks, their event log, idempotency records and leaders."""

    clock: Clock

    async def submit(self, new: NewTask) -> SubmitResult: ...

    async def get(self, task_id: str) -> Task | None: ...

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
        self, *, worker_id: str, kinds: list[str], limit: int, lease_ttl_s: float
    ) -> list[Task]: ...

    async def apply(self, change: Change) -> tuple[Task, list[TaskEvent]]: ...

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

    async def queue_position(self, task: Task) -> int | None: ...

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

    async def counters(self) -> dict[tuple[str, str], int]: ...

    async def bump(self, name: str, labels: str = "") -> None: ...

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
