"""What the features add to a status change, as contributions the engine runs.

``Engine.apply`` is the one way a status changes: the state table's check, the retry
rules, then one compare-and-set in the store. Everything else a change does belongs to a
feature, and each feature registers a :class:`Contribution` in :data:`CONTRIBUTIONS` (the
way dramatiq's middleware or procrastinate's job context hook a job without touching its
core). A contribution may:

- add effects to the change (:meth:`Contribution.effects`): what the store does in the
  change's transaction (:mod:`kiln.store.effects`: the ledger's row, counters, a model
  load's seconds on the event row, a pipeline's advance);
- act once the change committed (:meth:`Contribution.committed`): trace spans, the
  wake-up of a pipeline's next steps.

What a caller knows that only a feature reads travels as a fact (``facts=`` of
``Engine.apply``): :class:`Ran` (what a worker knows of the attempt), :class:`Counts`
(counters to add). A new feature adds a contribution (and a fact when callers must tell
it something), not a parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kiln.counters import FAILURES, FAILURES_BY_MINUTE
from kiln.models import JSON, Task, TaskEvent
from kiln.states import RUNNING, Event, Status
from kiln.store import Store
from kiln.store.effects import Count, Counted, Ledger, Loaded, PipelineStep
from kiln.store.records import AttemptUsage, Effect
from kiln.store.usage import outcome_of
from kiln.tracing import EVENTS_READ, Load, Tracing, ended_attempt, ended_review, spans_of

log = logging.getLogger("kiln")

Events = list[TaskEvent]

F = TypeVar("F")


@dataclass(frozen=True, slots=True)
class Retry:
    """What a change that may retry says: with ``error`` (a failure) the next attempt is
    scheduled in the same transaction by the kind's backoff when the error is retryable,
    attempts and time are left (``fail``/``expire`` then ``schedule_retry``), no sooner
    than ``after_s`` from now when given; ``then`` chains one more event unconditionally
    (``lose`` then ``schedule_retry``; ``generated`` then ``uploaded`` to ``then_to`` when
    an attempt has nothing to upload)."""

    error: JSON | None = None
    after_s: float | None = None
    then: Event | None = None
    then_to: Status | None = None


@dataclass(frozen=True, slots=True)
class Ran:
    """What a worker knows of the attempt its change ends: the seconds it timed loading
    models, the shared pools its kind takes (comma-separated), its share of a batch's
    call, and the model loads it timed (for the trace). The supervisor knows none of it:
    no load timed, the pools from the attempt's pool slots, a whole share."""

    loading_s: float = 0.0
    pool: str | None = None
    share: float = 1.0
    loads: Sequence[Load] = ()


@dataclass(frozen=True, slots=True)
class Counts:
    """Counters to add to in the change's transaction: ``(name, labels)`` each."""

    counts: tuple[Count, ...]


@dataclass(slots=True)
class Draft:
    """A change as the engine planned it, for the contributions: the task as read, the
    change's steps, its retry and the caller's facts, at ``now`` (the store's clock)."""

    task: Task
    steps: list[tuple[Event, Status]]
    retry: Retry | None
    facts: Sequence[object]
    now: float
    failure_code: str | None = field(init=False)

    def __post_init__(self) -> None:
        error = None if self.retry is None else self.retry.error
        self.failure_code = None if error is None else str(error.get("code"))

    def fact(self, kind: type[F]) -> F | None:
        """The caller's fact of ``kind``, or None."""
        if not self.facts:
            return None
        for fact in self.facts:
            if isinstance(fact, kind):
                return fact
        return None


class Host(Protocol):
    """What the contributions need of the engine after a commit."""

    @property
    def store(self) -> Store: ...

    @property
    def tracing(self) -> Tracing | None: ...

    def submitted(self) -> None: ...


class Contribution:
    """A feature's part in every status change; both hooks do nothing unless overridden
    (``acts_after``: whether :meth:`committed` does anything)."""

    acts_after = False

    def effects(self, draft: Draft) -> Iterable[Effect]:
        """The effects the change takes in its transaction."""
        return ()

    async def committed(
        self, host: Host, draft: Draft, task: Task, events: list[TaskEvent]
    ) -> None:
        """After the commit, with the task as updated and the change's events."""


def failure(task: Task, code: str) -> Count:
    """The ``failures`` counter of a failed attempt of ``task`` with ``code``."""
    return (FAILURES, f"{task.tenant}:{code}")


class Counters(Contribution):
    """The caller's counters and the failure of a retried error, each failure also in its
    per-minute bucket (the stats' last hour)."""

    def effects(self, draft: Draft) -> Iterable[Effect]:
        given, code = draft.fact(Counts), draft.failure_code
        if given is None and code is None:
            return ()
        counted = list(given.counts if given is not None else ())
        if code is not None:
            counted.append(failure(draft.task, code))
        minute = int(draft.now // 60)
        counted += [
            (FAILURES_BY_MINUTE, f"{minute:010d}:{labels}")
            for name, labels in list(counted)
            if name == FAILURES
        ]
        return (Counted(tuple(counted)),) if counted else ()


def attempt_usage(draft: Draft) -> AttemptUsage | None:
    """What the ledger records of the attempt the change ends, or None when it ends none
    (the task was not running, or still is)."""
    task = draft.task
    ends = [(event, to) for event, to in draft.steps if to not in RUNNING]
    if task.status not in RUNNING or not ends:
        return None
    event, to = ends[0]  # the step that leaves the running statuses
    retried = draft.steps[-1][0] is Event.SCHEDULE_RETRY
    outcome = outcome_of(event, to, retried=retried, error_code=draft.failure_code)
    ran = draft.fact(Ran) or Ran()
    return AttemptUsage(outcome, ran.loading_s, ran.pool, task.lease_owner, ran.share)


class LedgerRow(Contribution):
    """The GPU-second ledger: a change that ends a running attempt writes its row."""

    def effects(self, draft: Draft) -> Iterable[Effect]:
        usage = attempt_usage(draft)
        return () if usage is None else (Ledger(usage),)


class ModelLoads(Contribution):
    """A change that leaves GENERATING after a model load records the load's seconds on
    its event row."""

    def effects(self, draft: Draft) -> Iterable[Effect]:
        ran = draft.fact(Ran)
        if ran is None or ran.loading_s <= 0 or draft.task.status is not Status.GENERATING:
            return ()
        return (Loaded(ran.loading_s),)


class Pipelines(Contribution):
    """A step's final change advances its pipeline in its transaction; once committed,
    streams and workers look for the steps it made ready."""

    acts_after = True

    def effects(self, draft: Draft) -> Iterable[Effect]:
        pipeline_id = draft.task.pipeline_id
        return () if pipeline_id is None else (PipelineStep(pipeline_id),)

    async def committed(
        self, host: Host, draft: Draft, task: Task, events: list[TaskEvent]
    ) -> None:
        if task.pipeline_id is not None and task.final:
            host.submitted()


class Traces(Contribution):
    """With tracing on, a change that ends an attempt (or a review) emits its spans, built
    from the task's event rows. Tracing never fails a change: what goes wrong is logged
    and the change stands."""

    acts_after = True

    async def committed(
        self, host: Host, draft: Draft, task: Task, events: list[TaskEvent]
    ) -> None:
        tracing = host.tracing
        if tracing is None or not (ended_attempt(events) or ended_review(events)):
            return
        ran = draft.fact(Ran)
        try:
            history = await host.store.events(task_id=task.id, limit=EVENTS_READ)
            stored = await host.store.trace(task.id)
            tracing.emit(spans_of(task, history, events, stored, ran.loads if ran else ()))
        except Exception:
            log.exception("tracing_failed", extra={"task_id": task.id})


#: The features' contributions, in the order they run.
CONTRIBUTIONS: tuple[Contribution, ...] = (
    Counters(),
    LedgerRow(),
    ModelLoads(),
    Pipelines(),
    Traces(),
)


def effects_of(draft: Draft, contributions: Sequence[Contribution]) -> tuple[Effect, ...]:
    """Every effect the ``contributions`` add to the drafted change."""
    found: list[Effect] = []
    for contribution in contributions:
        found += contribution.effects(draft)
    return tuple(found)


async def committed(
    host: Host, draft: Draft, task: Task, events: Events, contributions: Sequence[Contribution]
) -> None:
    """Run the ``contributions`` that act after the commit of the drafted change."""
    for contribution in contributions:
        if contribution.acts_after:
            await contribution.committed(host, draft, task, events)
