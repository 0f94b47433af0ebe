"""Records: frozen dataclasses the store returns and the engine passes around.

Times are float seconds since the epoch inside the engine (the clock is injectable);
``iso()`` renders them as RFC 3339 UTC at the edges.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from kiln.states import FINAL, Event, Status

JSON = dict[str, Any]


def iso(ts: float | None) -> str | None:
    """``ts`` as UTC ISO 8601 to the millisecond (``2026-12-06T12:00:00.123Z``), as
    ``datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")`` writes it (the
    microseconds rounded half to even, then cut to milliseconds), with the text of the
    second made once for all the times within it (an answer holds several)."""
    if ts is None:
        return None
    second = int(ts)
    if second != ts and ts < 0:
        second -= 1  # the floor, as fromtimestamp splits a negative time
    micro = round((ts - second) * 1e6)
    if micro >= 1_000_000:
        second, micro = second + 1, micro - 1_000_000
    last = _last_second  # one read: another thread may replace it meanwhile
    prefix = last[1] if last[0] == second else _second_text(second)
    return f"{prefix}.{micro // 1000:03d}Z"


#: The last second :func:`iso` wrote, and its text (replaced whole, never changed).
_last_second: tuple[int, str] = (-(2**62), "")


def _second_text(second: int) -> str:
    global _last_second
    text = dt.datetime.fromtimestamp(second, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    _last_second = (second, text)
    return text


@dataclass(frozen=True, slots=True)
class Timeouts:
    waiting_s: float = 600.0
    generating_s: float = 600.0
    uploading_s: float = 120.0

    def for_status(self, status: Status) -> float | None:
        return {
            Status.WAITING_FOR_RESOURCE: self.waiting_s,
            Status.GENERATING: self.generating_s,
            Status.UPLOADING: self.uploading_s,
        }.get(status)


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The W3C trace context a task was submitted in (``traceparent``, ``tracestate``):
    kept in ``task_traces`` when tracing is on (kiln.tracing), its spans' parent."""

    traceparent: str
    tracestate: str | None = None


@dataclass(frozen=True, slots=True)
class NewTask:
    """What a submission asks for, validated and canonical."""

    id: str
    tenant: str
    kind: str
    params: JSON
    fingerprint: str
    idempotency_key: str | None
    dedup_key: str | None
    priority: int
    max_attempts: int
    deadline_s: float
    timeouts: Timeouts
    metadata: JSON = field(default_factory=dict)
    inputs: list[JSON] = field(default_factory=list)
    #: ``{"url", "events"}`` when the task's changes are posted to a webhook (kiln.webhooks).
    webhook: JSON | None = None
    #: The model the task needs, as its kind names it from the params (None: none named).
    model: str | None = None
    #: The batch it may join: a digest of the params its kind's batch policy matches on.
    batch_key: str | None = None
    #: A delayed task: not claimable before this moment (unix seconds); None means now.
    run_at: float | None = None
    #: The task this one runs again (POST /v1/tasks/{id}/rerun); None for a submission.
    rerun_of: str | None = None
    #: The trace context it was submitted in, when tracing is on (None: none to store).
    trace: TraceContext | None = None
    #: A step of a pipeline (docs/pipelines.md): the pipeline's id, the step's name and
    #: its copy (0 unless the step repeats); None for every other task.
    pipeline_id: str | None = None
    step: str | None = None
    step_copy: int | None = None
    #: Fingerprints of the same request as earlier versions computed them
    #: (kiln.canonical.request_fingerprints): a key stored with one of them still replays.
    older_fingerprints: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    tenant: str
    kind: str
    status: Status
    params: JSON
    metadata: JSON
    inputs: list[JSON]
    priority: int
    attempt: int
    max_attempts: int
    epoch: int
    version: int
    idempotency_key: str | None
    dedup_key: str | None
    fingerprint: str
    lease_owner: str | None
    lease_expires_at: float | None
    state_deadline_at: float | None
    deadline_s: float
    deadline_at: float
    timeouts: Timeouts
    stage: str | None
    progress_step: int | None
    progress_total: int | None
    progress_at: float | None
    cancel_requested: bool
    cancel_requested_at: float | None
    next_retry_at: float | None
    ready_at: float
    result_prefix: str | None
    error: JSON | None
    result: JSON | None
    created_at: float
    updated_at: float
    status_since: float
    started_at: float | None
    finished_at: float | None
    webhook: JSON | None = None
    model: str | None = None
    batch_key: str | None = None
    #: When the leading supervisor asked the running attempt to yield its pool slot at its
    #: next step (KILN_PREEMPT_AFTER_S); None: not asked. Cleared by every claim.
    yield_requested_at: float | None = None
    #: The task this one runs again (POST /v1/tasks/{id}/rerun); None for a submission.
    rerun_of: str | None = None
    #: A step of a pipeline (docs/pipelines.md): the pipeline's id, the step's name and
    #: its copy (0 unless the step repeats); None for every other task.
    pipeline_id: str | None = None
    step: str | None = None
    step_copy: int | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def progress(self) -> JSON | None:
        if self.progress_total is None or self.progress_step is None:
            return None
        total = max(self.progress_total, 1)
        return {
            "step": self.progress_step,
            "total": self.progress_total,
            "fraction": round(min(self.progress_step / total, 1.0), 4),
        }


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """One persisted status change; ``seq`` is global and increasing."""

    seq: int
    id: str
    task_id: str
    tenant: str
    event: Event
    from_status: Status | None
    status: Status
    attempt: int
    epoch: int
    error: JSON | None
    at: float
    dwell_s: float | None
    final: bool
    #: Seconds the attempt spent loading models in the status this event leaves
    #: (``ctx.loading_model``); None when it loaded none.
    loading_s: float | None = None

    def to_json(self) -> JSON:
        found: JSON = {
            "seq": self.seq,
            "task_id": self.task_id,
            "type": "status",
            "event": str(self.event),
            "from": None if self.from_status is None else str(self.from_status),
            "status": str(self.status),
            "attempt": self.attempt,
            "final": self.final,
            "error": self.error,
            "at": iso(self.at),
        }
        if self.loading_s is not None:
            found["loading_s"] = round(self.loading_s, 3)
        return found


@dataclass(frozen=True, slots=True)
class Output:
    """One file a handler produced."""

    name: str
    data: bytes
    content_type: str = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class StoredOutput:
    name: str
    key: str
    content_type: str
    size: int
    sha256: str

    def to_json(self) -> JSON:
        return {
            "name": self.name,
            "key": self.key,
            "content_type": self.content_type,
            "size": self.size,
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, raw: JSON) -> StoredOutput:
        return cls(
            name=str(raw["name"]),
            key=str(raw["key"]),
            content_type=str(raw["content_type"]),
            size=int(raw["size"]),
            sha256=str(raw["sha256"]),
        )


@dataclass(frozen=True, slots=True)
class SubmitResult:
    task: Task
    created: bool
    replayed: bool = False
    deduplicated: bool = False
    #: The task's queue position, read in the submit's own transaction when the submit
    #: asked for it (``placed``); None: not queued and due.
    queue_position: int | None = None
    placed: bool = False
