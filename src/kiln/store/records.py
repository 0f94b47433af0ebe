"""The records the Store takes and gives (besides the task models of kiln.models)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kiln.models import JSON, Task
from kiln.states import Event, Status
from kiln.store.tx import EventRow, Ops, Tx

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class LeaderToken:
    """Proof of leadership: writes made with it are refused once another leader took over."""

    name: str
    owner: str
    epoch: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class BreakerRecord:
    """A circuit breaker's state as every process shares it (kiln.breakers).

    ``state`` is closed, open or half_open. Open: calls are refused until
    ``opened_until``; half_open: the process ``by`` holds the one probe until then.
    """

    name: str
    state: str
    opened_until: float | None
    updated_at: float
    by: str


@dataclass(frozen=True, slots=True)
class AttemptUsage:
    """What a change that ends a running attempt adds to the GPU-second ledger
    (kiln/store/usage.py) besides what the store reads itself (tenant, kind, model, the
    seconds waiting and generating from the attempt's event rows).

    ``outcome`` is how the attempt ended (:data:`kiln.store.usage.OUTCOMES`);
    ``loading_s`` the seconds its worker timed loading models (0 when the supervisor ends
    it); ``pool`` the shared pools its kind takes, comma-separated (None: the store reads
    the attempt's ``pool_slots`` rows); ``worker`` the lease owner; ``share`` its share
    of a batch (1.0 for an attempt run alone).
    """

    outcome: str
    loading_s: float = 0.0
    pool: str | None = None
    worker: str | None = None
    share: float = 1.0


@dataclass(frozen=True, slots=True)
class Fence:
    """How a change is guarded besides the status it expects.

    ``fenced``: a worker's write at the epoch it holds (a row that moved on is a lost
    lease: ``LeaseLost``, counted as a stale write); ``bump``: the change raises the epoch
    (fencing the holder out); ``leader``: a supervisor's write, refused once another
    leader took over. Each of them applies the change only at the epoch read.
    """

    fenced: bool = False
    bump: bool = False
    leader: LeaderToken | None = None

    @property
    def on_epoch(self) -> bool:
        """Whether the change applies only at the epoch read."""
        return self.fenced or self.bump or self.leader is not None


#: No guard but the status: a user's action.
UNFENCED = Fence()
#: A worker's write at the epoch it holds.
WORKER = Fence(fenced=True)
#: A change that fences the holder out (expire, recover, force-cancel, lose, release).
BUMP = Fence(bump=True)


@dataclass(slots=True)
class Applied:
    """What a change wrote, as its effects see it: the change, the task as updated, and
    the row as it was locked before (``attempt``, ``epoch``, the ``dwell_s`` in the status
    it left), at ``now``."""

    change: Change
    task: Task
    attempt: int
    epoch: int
    dwell_s: float
    now: float


class Effect:
    """What a change does besides its row and its event rows, in its transaction: a
    contribution a feature adds to the change (:mod:`kiln.store.effects`), written once
    over :class:`~kiln.store.tx.Tx` for both drivers. Every hook does nothing unless the
    effect says otherwise; the store calls them in this order:

    - :meth:`lock`, before the task's row is locked (one lock order everywhere);
    - :meth:`before_events`, after the row's update, before its event rows;
    - :meth:`amend`, on the event rows about to be written;
    - :meth:`after`, once the event rows are written.

    :attr:`in_statement` says that PostgreSQL's one-statement path writes the effect
    itself (:mod:`kiln.store.pgstep`); any other effect takes the transaction.
    """

    __slots__ = ()
    in_statement: ClassVar[bool] = False

    def needed(self, change: Change) -> bool:
        """Whether the effect does anything for ``change`` (a standing effect decides)."""
        return True

    async def lock(self, ops: Ops, tx: Tx, change: Change) -> None:
        return None

    async def before_events(self, ops: Ops, tx: Tx, applied: Applied) -> None:
        return None

    def amend(self, rows: list[EventRow]) -> None:
        return None

    async def after(self, ops: Ops, tx: Tx, applied: Applied) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Change:
    """One compare-and-set on a task plus the event rows of its status changes.

    The UPDATE matches only ``(task_id, expect_status, expect_epoch)``; ``steps`` chain
    from ``expect_status`` (``fail`` then ``schedule_retry`` is two steps, one
    transaction). ``fields`` are the columns to set besides status and bookkeeping;
    ``error`` goes on the event rows; ``fence`` guards it; ``effects`` are what the
    features add to it in the same transaction (the ledger row, counters, a pipeline's
    advance, ...: :class:`Effect`).
    """

    task_id: str
    expect_status: Status
    expect_epoch: int | None
    steps: tuple[tuple[Event, Status], ...]
    fields: dict[str, Any] = field(default_factory=dict)
    error: JSON | None = None
    fence: Fence = UNFENCED
    effects: tuple[Effect, ...] = ()

    @property
    def target(self) -> Status:
        """The status the change ends in."""
        return self.steps[-1][1]


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
