"""Request and response bodies of the HTTP API (API.md), as pydantic models.

The request models validate what clients send; the response models document what the
API answers (OpenAPI) and let tests check every answer against them. The task's JSON
itself is built in one place, :func:`kiln.wire.task_json`.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.config import JsonDict, JsonValue

from kiln import webhooks
from kiln.inputs import REFERENCE_PATTERN
from kiln.states import Status
from kiln.timing import MAX_DELAY_S
from kiln.wire import MAX_BATCH_ITEMS

JSONObject = dict[str, Any]
#: The largest event seq (a signed 64-bit integer in both databases): a larger resume
#: point (``?after=``, ``Last-Event-ID``) is refused before the store is asked.
MAX_SEQ = 2**63 - 1
#: A webhook URL as the OpenAPI document takes it: http(s), a host (a name or an IP
#: address), an optional port (1 to 65535), then anything. Which hosts may be called is
#: the server's policy, not the document's: a loopback, private or link-local address is
#: refused unless KILN_WEBHOOK_ALLOW_PRIVATE allows it (kiln.webhooks.check_url).
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
WEBHOOK_URL_PATTERN = (
    rf"^https?://([A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?|\[[0-9A-Fa-f:.]+\])(:{_PORT})?"
    r"([/?#][^\s]*)?$"
)


def _run_at_schema(schema: JsonDict) -> None:
    """``run_at`` as the OpenAPI document shows it: unix seconds (no further ahead than a
    year from when the document was built, a bound that only loosens as time passes), or
    an RFC 3339 time with its offset (at most a year ahead: the server checks)."""
    schema.clear()
    schema.update(
        {
            "anyOf": [
                {"type": "number", "minimum": 0, "maximum": math.floor(time.time() + MAX_DELAY_S)},
                {"type": "string", "format": "date-time", "examples": ["2027-01-01T09:00:00Z"]},
                {"type": "null"},
            ],
            "description": "run no earlier than this: unix seconds, or an RFC 3339 time with an "
            "offset (2027-01-01T09:00:00Z); at most a year ahead; not with delay_s",
        }
    )


def _webhook_events_schema(schema: JsonDict) -> None:
    """The list's items are event names, ``final`` or ``*`` (in the list's own branch, so
    that a generated client types them too)."""
    branches = schema.get("anyOf")
    names: list[JsonValue] = list(sorted(webhooks.SELECTORS))
    for branch in branches if isinstance(branches, list) else []:
        if isinstance(branch, dict) and branch.get("type") == "array":
            branch["items"] = {"type": "string", "enum": names}


def _integral(value: Any) -> Any:
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema says), 3.5 is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Requests -------------------------------------------------------------------------------


class TimeoutsIn(BaseModel):
    """Per-state time limits in seconds; each omitted one takes its default."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    waiting_s: Annotated[float | None, Field(ge=1, le=86_400, description="default 600")] = None
    generating_s: Annotated[float | None, Field(ge=1, le=86_400, description="default 600")] = None
    uploading_s: Annotated[float | None, Field(ge=1, le=86_400, description="default 120")] = None


#: webhook_events only comes with a webhook_url.
_WITH_WEBHOOK_URL: JsonDict = {
    "required": ["webhook_url"],
    "properties": {"webhook_url": {"type": "string"}},
}


class SubmitRequest(BaseModel):
    """``POST /v1/tasks``: only ``kind`` and ``params`` are required."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        json_schema_extra={
            "dependentSchemas": {"webhook_events": _WITH_WEBHOOK_URL},
            "not": {"required": ["run_at", "delay_s"]},
        },
    )

    kind: Annotated[str, Field(examples=["image.generate"])]
    params: Annotated[
        JSONObject, Field(examples=[{"prompt": "a red fox in snow", "steps": 30, "seed": 7}])
    ]
    priority: Annotated[
        int, Field(ge=-100, le=100, description="higher first"), BeforeValidator(_integral)
    ] = 0
    max_attempts: Annotated[int, Field(ge=1, le=20), BeforeValidator(_integral)] = 3
    deadline_s: Annotated[float, Field(ge=1, le=604_800)] = 86_400
    dedup: bool = True
    timeouts: TimeoutsIn | None = None
    metadata: JSONObject = Field(default_factory=dict)
    run_at: Annotated[float | str | None, Field(json_schema_extra=_run_at_schema)] = None
    delay_s: Annotated[
        float | None,
        Field(ge=0, le=31_622_400, description="run no earlier than this many seconds from now"),
    ] = None
    webhook_url: Annotated[
        str | None,
        Field(
            max_length=2048,
            description="http(s) URL the task's status changes are POSTed to (docs/webhooks.md); "
            "a loopback, private or link-local address is refused unless the server allows it",
            examples=["https://example.com/hooks/kiln"],
            json_schema_extra={"pattern": WEBHOOK_URL_PATTERN},
        ),
    ] = None
    inputs: Annotated[
        dict[
            Annotated[str, Field(min_length=1, max_length=64)],
            Annotated[str, Field(pattern=REFERENCE_PATTERN)],
        ]
        | None,
        Field(
            max_length=15,
            description="inputs named by content instead of uploaded: input name → "
            "'sha256:<64 hex>' of an earlier upload or output of this tenant's tasks "
            "(docs/uploads.md, 'Inputs by reference'); unknown content is 422",
            examples=[{"image": "sha256:" + "9f2c" * 16}],
        ),
    ] = None
    webhook_events: Annotated[
        list[str] | None,
        Field(
            min_length=1,
            max_length=32,
            description="event names, 'final' (the event that ends the task) or '*'; "
            "default ['final']",
            json_schema_extra=_webhook_events_schema,
        ),
    ] = None


class BatchItemIn(SubmitRequest):
    """One item of ``POST /v1/tasks/batch``: a submission, plus its own Idempotency-Key."""

    idempotency_key: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=255,
            pattern=r"^[\x20-\x7e]+$",
            description="as the Idempotency-Key header of POST /v1/tasks",
        ),
    ] = None


class BatchRequest(BaseModel):
    """``POST /v1/tasks/batch``: up to 1,000 submissions, each checked on its own."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tasks: Annotated[
        list[JSONObject],
        Field(
            min_length=1,
            max_length=MAX_BATCH_ITEMS,
            description="submissions as POST /v1/tasks takes them (BatchItemIn), plus an "
            "optional idempotency_key; an item that is not valid is refused alone",
        ),
    ]


class RerunRequest(BaseModel):
    """``POST /v1/tasks/{id}/rerun``: a new task of the same kind, with changes."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    params: Annotated[JSONObject, Field(description="merged over the original task's params")] = (
        Field(default_factory=dict)
    )
    priority: Annotated[
        int | None,
        Field(ge=-100, le=100, description="default: the original's"),
        BeforeValidator(_integral),
    ] = None
    dedup: Annotated[
        bool,
        Field(description="false: a new variation, never answered with an existing task"),
    ] = True


class ReviewRequest(BaseModel):
    """``POST /v1/tasks/{id}/review``: an admin's moderation decision."""

    model_config = ConfigDict(extra="forbid", strict=True)

    decision: Literal["approve", "reject"]
    reason: Annotated[str | None, Field(max_length=2000)] = None


# Responses ------------------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProgressOut(_Out):
    step: int
    total: int
    fraction: float


class ResourceWaitOut(_Out):
    """Where a WAITING_FOR_RESOURCE task stands in a shared pool's line."""

    pool: str
    position: Annotated[int, Field(ge=1, description="1 for the next waiter to get a slot")]
    capacity: int
    held: int
    waiting: int


class ErrorInfo(_Out):
    """The latest failure of a task."""

    code: str
    message: str
    retryable: bool


class OutputOut(_Out):
    name: str
    content_type: str
    size: int
    sha256: str
    url: Annotated[str, Field(description="/v1/tasks/<id>/outputs/<name>")]


class InputOut(_Out):
    name: str
    content_type: str
    size: int
    sha256: str


class ResultOut(_Out):
    outputs: list[OutputOut]


class WebhookOut(_Out):
    url: str
    events: list[str]


class StepOfOut(_Out):
    """Which step of its pipeline a task is (docs/pipelines.md)."""

    name: str
    copy_index: Annotated[int, Field(alias="copy", description="0 unless the step repeats")]


class StepOut(_Out):
    """One copy of one step of a pipeline: its task, null until its inputs exist."""

    name: str
    copy_index: Annotated[int, Field(alias="copy", description="0 unless the step repeats")]
    kind: str
    task_id: str | None
    status: Status | None
    progress: ProgressOut | None
    outputs: list[OutputOut]
    error: ErrorInfo | None


class TaskOut(_Out):
    """A task as the API shows it (API.md, "The task")."""

    id: str
    kind: str
    status: Status
    final: bool
    stage: str | None
    progress: ProgressOut | None
    queue_position: Annotated[
        int | None,
        Field(ge=1, description="1 for the next task a worker of its kind would claim"),
    ]
    resource_wait: ResourceWaitOut | None = None
    attempt: int
    max_attempts: int
    priority: int
    params: JSONObject
    metadata: JSONObject
    inputs: list[InputOut]
    idempotency_key: str | None
    deduplicated: Annotated[
        bool, Field(description="true only on the answer to a submission that matched it")
    ]
    cancel_requested: bool
    next_retry_at: AwareDatetime | None
    error: ErrorInfo | None
    result: ResultOut | None
    created_at: AwareDatetime
    updated_at: AwareDatetime
    started_at: AwareDatetime | None
    finished_at: AwareDatetime | None
    webhook: WebhookOut | None
    model: Annotated[
        str | None,
        Field(description="the model the task needs, as its kind names it (warm-model routing)"),
    ] = None
    scheduled_for: Annotated[
        AwareDatetime | None,
        Field(description="a delayed task not yet claimed: when it becomes claimable"),
    ] = None
    rerun_of: Annotated[
        str | None,
        Field(description="the task this one runs again (POST /v1/tasks/{id}/rerun)"),
    ] = None
    pipeline_id: Annotated[
        str | None, Field(description="a step's pipeline (docs/pipelines.md)")
    ] = None
    step: StepOfOut | None = None
    steps: Annotated[
        list[StepOut] | None, Field(description="a pipeline's steps, in order, each copy")
    ] = None


class TaskList(_Out):
    items: list[TaskOut]
    next_cursor: str | None


class Percentiles(_Out):
    p50: float
    p95: float


class PoolOut(_Out):
    capacity: int
    held: int
    waiting: int


class BreakerOut(_Out):
    state: Literal["closed", "open", "half_open"]
    #: Open: when the next probe may go; half-open: when the probe out expires.
    until: AwareDatetime | None


class WorkerOut(_Out):
    id: str
    host: str
    pid: int
    version: str
    kinds: list[str]
    slots: int
    #: Attempts in the worker's hands at its last beat.
    running: int
    #: What each of its kinds takes ({kind: {pool: units}}); kinds that take none left out.
    resources: dict[str, dict[str, int]]
    #: The models it holds loaded.
    models: list[str]
    started_at: AwareDatetime
    last_seen_at: AwareDatetime
    #: When it stops being listed if it beats no more.
    expires_at: AwareDatetime


class KindLoadOut(_Out):
    """One kind's autoscaling signals (docs/autoscaling.md)."""

    waiting: int
    ready: int
    waiting_for_resource: int
    running: int
    oldest_waiting_age_s: float
    workers: int
    worker_slots: int


class PoolLoadOut(_Out):
    """One shared pool's autoscaling signals (docs/autoscaling.md)."""

    capacity: int
    waiting: int
    running: int
    oldest_waiting_age_s: float
    worker_slots: int


class AutoscalingOut(_Out):
    kinds: dict[str, KindLoadOut]
    pools: dict[str, PoolLoadOut]


class StatsOut(_Out):
    counts: dict[str, int]
    dwell_seconds: dict[str, Percentiles]
    failures: dict[str, int]
    failures_last_hour: dict[str, int]
    ghosts: int
    #: Shared resource pools (KILN_POOLS): capacity, units held, tasks waiting.
    pools: dict[str, PoolOut] = Field(default_factory=dict)
    #: Circuit breakers by name (a generator backend, ``storage``), as shared in the store.
    breakers: dict[str, BreakerOut] = Field(default_factory=dict)
    #: The live worker processes, as ``GET /v1/workers`` lists them: for the admin only.
    workers: list[WorkerOut] | None = None
    #: What each kind and pool asks of the workers and what they offer: for the admin only.
    autoscaling: AutoscalingOut | None = None


class WorkersOut(_Out):
    workers: list[WorkerOut]


class DeliveryOut(_Out):
    """A webhook delivery: one event of the task POSTed to its webhook, and its attempts."""

    #: The delivery's id: the event's id, sent as ``webhook-id`` and ``Kiln-Webhook-Id``.
    id: str
    event_id: str
    task_id: str
    seq: int
    event: str
    url: str
    #: The outbox's status: ``pending`` (waiting for its next attempt), ``delivered`` (a
    #: 2xx answer) or ``failed`` (410, refused address, or its last attempt failed).
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    #: The HTTP status of the last answer, if one came.
    last_response_status: int | None
    last_error: str | None
    #: When the next attempt is due; null unless pending.
    next_attempt_at: AwareDatetime | None
    created_at: AwareDatetime
    updated_at: AwareDatetime


class DeliveriesOut(_Out):
    """``GET /v1/tasks/{id}/webhooks``: the task's webhook and its deliveries, in event
    order."""

    task_id: str
    webhook: WebhookOut | None
    items: list[DeliveryOut]


class UsageItemOut(_Out):
    """One group of the GPU-second ledger: its keys (those grouped by) and its sums."""

    tenant: str | None = None
    kind: str | None = None
    model: str | None = None
    day: str | None = None
    outcome: str | None = None
    worker: str | None = None
    pool: str | None = None
    #: Attempts that ended in the window.
    attempts: int
    waiting_s: float
    loading_s: float
    generating_s: float
    #: generating_s x each attempt's share of its batch.
    gpu_seconds: float


class UsageOut(_Out):
    #: The window, RFC 3339 UTC: attempts that ended at or after ``from``, before ``to``.
    from_: str = Field(alias="from")
    to: str
    group_by: list[str]
    items: list[UsageItemOut]
    #: More groups than one answer holds: narrow the window or the grouping.
    truncated: bool


class HealthOut(_Out):
    status: Literal["ok"]


class ErrorBody(_Out):
    code: str
    message: str
    details: list[Any]


class ErrorEnvelope(_Out):
    """Every error answer: ``{"error": {"code", "message", "details"}}``."""

    error: ErrorBody


class BatchItemOut(_Out):
    """The answer to one item of a batch, at its index."""

    index: int
    status: Literal["created", "replayed", "deduplicated", "refused"]
    task: TaskOut | None
    error: Annotated[ErrorBody | None, Field(description="why it was refused")]


class BatchOut(_Out):
    """``POST /v1/tasks/batch``'s answer: one item per submission, in order."""

    items: list[BatchItemOut]
