"""The records the Store takes and gives (besides the task models of kiln.models)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.models import JSON, Task
from kiln.states import Event, Status

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
    #: Set when the change ends a running attempt: its row of the GPU-second ledger is
    #: written in the same transaction.
    usage: AttemptUsage | None = None
    #: The seconds the attempt spent loading models in GENERATING, for the event row of
    #: the step that leaves it (None: no model was loaded, or it does not leave it).
    loading_s: float | None = None
    #: The pipeline of a step (docs/pipelines.md): a final status advances it in the same
    #: transaction. None for every other task (and for the changes that path makes).
    pipeline_id: str | None = None


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
