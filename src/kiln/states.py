"""The task state machine as data.

One declarative table, :data:`TRANSITIONS`, is the single source of truth: the engine
builds its compare-and-set guards from it, the docs diagram is generated from it
(:func:`mermaid`), and the tests enumerate it. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from kiln.errors import KilnError


class Status(StrEnum):
    PENDING = "PENDING"
    WAITING_FOR_RESOURCE = "WAITING_FOR_RESOURCE"
    GENERATING = "GENERATING"
    UPLOADING = "UPLOADING"
    NEEDS_REVIEW = "NEEDS_REVIEW"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    RETRYING = "RETRYING"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"


class Event(StrEnum):
    SUBMIT = "submit"
    CLAIM = "claim"
    ACQUIRE = "acquire"
    GENERATED = "generated"
    UPLOADED = "uploaded"
    APPROVE = "approve"
    REJECT = "reject"
    FAIL = "fail"
    SCHEDULE_RETRY = "schedule_retry"
    EXPIRE = "expire"
    RECOVER = "recover"
    CANCEL = "cancel"
    STOPPED = "stopped"
    FORCE_CANCEL = "force_cancel"
    RETRY = "retry"
    DEADLINE = "deadline"
    LOSE = "lose"
    RELEASE = "release"
    RUN_STEPS = "run_steps"
    STEPS_DONE = "steps_done"
    STEP_FAILED = "step_failed"
    STEPS_CANCELLED = "steps_cancelled"


class Actor(StrEnum):
    API = "api"
    WORKER = "worker"
    SUPERVISOR = "supervisor"
    ENGINE = "engine"
    ADMIN = "admin"
    RECONCILER = "reconciler"


S = Status

#: Statuses in which a worker holds the task under a lease.
RUNNING: frozenset[Status] = frozenset({S.WAITING_FOR_RESOURCE, S.GENERATING, S.UPLOADING})
#: Statuses a worker may claim from (RETRYING only once due).
CLAIMABLE: frozenset[Status] = frozenset({S.PENDING, S.RETRYING})
#: Statuses in which a task rests for good unless a manual retry revives it. FAILED and
#: TIMEOUT are final "when not retried": a scheduled retry moves them on to RETRYING in the
#: same transaction, so a task never rests in them while a retry is planned.
FINAL: frozenset[Status] = frozenset({S.SUCCESS, S.FAILED, S.TIMEOUT, S.CANCELLED})
#: Statuses that are not FINAL: the task still has somewhere to go (the bulk ``cancel`` set).
ACTIVE: frozenset[Status] = frozenset(set(Status) - FINAL)
#: FINAL without SUCCESS: the task ended without a result. The one set for every rule that
#: asks "did it end badly": a manual retry (``retry``, single or bulk) applies to exactly
#: these; a task in one of them no longer holds its dedup key (the store's dedup index and
#: its SQL token ``{ENDED_UNSUCCESSFULLY}`` leave them out); a pipeline step in one of them
#: ends its pipeline under its ``on_failure`` policy (kiln.pipelines).
ENDED_UNSUCCESSFULLY: frozenset[Status] = frozenset({S.FAILED, S.TIMEOUT, S.CANCELLED})
#: Statuses in which a task holds a slot of its resource pool: a ``pool_slots`` row counts
#: only while its task is in one of them (SQL token ``{HOLDS_SLOT}``).
HOLDS_SLOT: frozenset[Status] = frozenset({S.WAITING_FOR_RESOURCE, S.GENERATING})
#: Statuses a task reaches GENERATING from: a live stream holds a task's progress back
#: while it still knows the task in one of them.
BEFORE_GENERATING: frozenset[Status] = CLAIMABLE | {S.WAITING_FOR_RESOURCE}
#: Statuses in which a worker may already have written outputs: the sources of ``recover``
#: (the supervisor looks for a complete manifest before it expires such a task).
MAY_HAVE_OUTPUTS: frozenset[Status] = frozenset({S.GENERATING, S.UPLOADING})


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the transition table."""

    event: Event
    sources: frozenset[Status]
    targets: frozenset[Status]
    actor: Actor
    fenced: bool
    doc: str


def _rule(
    event: Event,
    sources: Iterable[Status],
    targets: Iterable[Status],
    actor: Actor,
    doc: str,
    *,
    fenced: bool = False,
) -> Rule:
    return Rule(event, frozenset(sources), frozenset(targets), actor, fenced, doc)


# The state machine as a table, one rule per entry (event, from, to, actor, note): kept
# unformatted so it reads as a table (ruff format would spread each rule over six lines).
TRANSITIONS: tuple[Rule, ...] = (
    _rule(Event.SUBMIT, (), (S.PENDING,), Actor.API,
          "atomic insert-or-get on idempotency and dedup keys"),
    _rule(Event.CLAIM, CLAIMABLE, (S.WAITING_FOR_RESOURCE,), Actor.WORKER,
          "attempt+1, epoch+1, lease set, result location reserved"),
    _rule(Event.ACQUIRE, (S.WAITING_FOR_RESOURCE,), (S.GENERATING,), Actor.WORKER,
          "resource slot held", fenced=True),
    _rule(Event.GENERATED, (S.GENERATING,), (S.UPLOADING,), Actor.WORKER, "", fenced=True),
    _rule(Event.UPLOADED, (S.UPLOADING,), (S.SUCCESS, S.NEEDS_REVIEW), Actor.WORKER,
          "every output verified in storage", fenced=True),
    _rule(Event.APPROVE, (S.NEEDS_REVIEW,), (S.SUCCESS,), Actor.ADMIN, "outputs verified again"),
    _rule(Event.REJECT, (S.NEEDS_REVIEW,), (S.FAILED,), Actor.ADMIN,
          "content_rejected, final; outputs deleted"),
    _rule(Event.FAIL, RUNNING, (S.FAILED,), Actor.WORKER, "reason code, retryable flag",
          fenced=True),
    _rule(Event.SCHEDULE_RETRY, (S.FAILED, S.TIMEOUT), (S.RETRYING,), Actor.ENGINE,
          "same transaction; retryable, attempts left, deadline allows"),
    _rule(Event.EXPIRE, RUNNING, (S.TIMEOUT,), Actor.SUPERVISOR,
          "lease lost or state timeout; epoch+1"),
    _rule(Event.RECOVER, MAY_HAVE_OUTPUTS, (S.SUCCESS,), Actor.SUPERVISOR,
          "complete verified outputs found at the attempt's location; epoch+1"),
    _rule(Event.CANCEL, (S.PENDING, S.RETRYING, S.NEEDS_REVIEW), (S.CANCELLED,), Actor.API,
          "a running task only gets cancel_requested"),
    _rule(Event.STOPPED, RUNNING, (S.CANCELLED,), Actor.WORKER,
          "the worker saw cancel_requested", fenced=True),
    _rule(Event.FORCE_CANCEL, RUNNING, (S.CANCELLED,), Actor.SUPERVISOR,
          "cancel_requested older than the grace period; epoch+1"),
    _rule(Event.RETRY, ENDED_UNSUCCESSFULLY, (S.RETRYING,), Actor.API,
          "manual retry; max_attempts+1, due now"),
    _rule(Event.DEADLINE, CLAIMABLE, (S.TIMEOUT,), Actor.SUPERVISOR,
          "the task's overall deadline passed"),
    _rule(Event.LOSE, (S.SUCCESS,), (S.FAILED,), Actor.RECONCILER,
          "result_lost: an output is gone or no longer matches; only at the epoch seen, "
          "epoch+1, result cleared; then schedule_retry (due now, max_attempts+1) under "
          "the rerun policy"),
    _rule(Event.RELEASE, RUNNING, (S.PENDING,), Actor.WORKER,
          "graceful stop (I9): the attempt goes back uncounted, attempt-1, epoch+1, "
          "ready_at kept", fenced=True),
    # A pipeline (kind ``pipeline``, docs/pipelines.md) is never claimed: it is GENERATING
    # from its submit transaction (its first steps created in it) until its steps end.
    _rule(Event.RUN_STEPS, (S.PENDING, S.RETRYING), (S.GENERATING,), Actor.ENGINE,
          "pipeline: its ready steps created in the same transaction; no lease, no deadline"),
    _rule(Event.STEPS_DONE, (S.GENERATING,), (S.SUCCESS,), Actor.ENGINE,
          "pipeline: its last step succeeded, in that step's transaction"),
    _rule(Event.STEP_FAILED, (S.GENERATING,), (S.FAILED,), Actor.ENGINE,
          "pipeline: a step failed or timed out for good (on_failure policy)"),
    _rule(Event.STEPS_CANCELLED, (S.GENERATING,), (S.CANCELLED,), Actor.ENGINE,
          "pipeline: cancelled, or a step was cancelled; pending steps cancelled with it"),
)  # fmt: skip

RULES: dict[Event, Rule] = {rule.event: rule for rule in TRANSITIONS}


class IllegalTransition(KilnError):
    """The table forbids applying ``event`` to a task in ``status``.

    An engine error (code ``illegal_transition``): the API answers it 500 without its
    message, as any error it does not map.
    """

    code = "illegal_transition"

    def __init__(self, status: Status | None, event: Event, target: Status | None = None) -> None:
        super().__init__(f"event {event} is not allowed from {status} to {target}")
        self.status = status
        self.event = event
        self.target = target


def check(status: Status | None, event: Event, target: Status | None = None) -> Status:
    """Return the target status of ``event`` from ``status``, or raise IllegalTransition.

    ``target`` picks one target when the event has several (``uploaded``).
    """
    rule = RULES[event]
    allowed_source = status in rule.sources if rule.sources else status is None
    if not allowed_source:
        raise IllegalTransition(status, event, target)
    if target is None:
        if len(rule.targets) != 1:
            raise IllegalTransition(status, event, target)
        (target,) = rule.targets
    elif target not in rule.targets:
        raise IllegalTransition(status, event, target)
    return target


def is_allowed(status: Status | None, event: Event, target: Status | None = None) -> bool:
    try:
        check(status, event, target)
    except IllegalTransition:
        return False
    return True


def is_final(status: Status) -> bool:
    return status in FINAL


def replay(events: Iterable[tuple[Event, Status | None, Status]]) -> Status | None:
    """Fold a task's (event, from, to) log into its status, checking every step."""
    status: Status | None = None
    for event, source, target in events:
        if source != status:
            raise IllegalTransition(status, event, target)
        status = check(status, event, target)
    return status


def mermaid() -> str:
    """The state diagram as Mermaid text, generated from :data:`TRANSITIONS`."""
    lines = ["stateDiagram-v2"]
    for rule in TRANSITIONS:
        sources: list[str] = [str(s) for s in sorted(rule.sources)] or ["[*]"]
        for source in sources:
            for target in sorted(rule.targets):
                lines.append(f"    {source} --> {target}: {rule.event}")
    for status in sorted(FINAL):
        lines.append(f"    {status} --> [*]")
    return "\n".join(lines) + "\n"
