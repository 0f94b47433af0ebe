"""App: kiln as a library. The task-kind registry, submission, the user actions and the
streams, on top of an :class:`~kiln.engine.Engine` that holds the wiring and the policy.

Every status change goes through :meth:`Engine.apply <kiln.engine.Engine.apply>`, which
checks the state table first (an illegal transition is refused and counted, never applied)
and then asks the store for one fenced compare-and-set with its event rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import pydantic

from kiln import bulk_actions, pipelines, transform
from kiln.app_parts import Operations, Schedules
from kiln.backends.comfy_workflow_params import KIND as COMFY_WORKFLOW
from kiln.breakers import Breakers
from kiln.bus import EventHub, Message, ProgressEvent, Subscription
from kiln.config import Settings
from kiln.engine import Count, Engine, failure, rerun_fields
from kiln.errors import (
    AlreadyFinal,
    Conflict,
    InvalidCursor,
    InvalidRequest,
    NotFound,
    NotInReview,
    NotRetryable,
    RateLimited,
)
from kiln.kinds import (
    AmountsOf,
    BatchPolicy,
    Handler,
    HandlerResult,
    InputCheck,
    ModelOf,
    ReviewCheck,
    TaskKind,
    call_review,
    find_kind,
)
from kiln.models import JSON, StoredOutput, SubmitResult, Task, TaskEvent, Timeouts
from kiln.retry import RetryPolicy
from kiln.states import BEFORE_GENERATING, ENDED_UNSUCCESSFULLY, RUNNING, Event, Status
from kiln.storage import Storage, verify
from kiln.store import BreakerRecord, LeaderToken, Stats, Store
from kiln.store.bulk import BulkFilter
from kiln.store.outbox import WebhookDelivery
from kiln.store.pools import PoolUsage, PoolWait
from kiln.submission import (
    DEFAULT_TENANT,
    Submission,
    holding,
    pinned,
    submission_of,
)
from kiln.supervisor import Supervisor
from kiln.worker import Worker

#: Kinds a worker claims only when it names them: they drive a server of their own.
NAMED_ONLY = frozenset({COMFY_WORKFLOW})

__all__ = [
    "DEFAULT_TENANT",
    "AmountsOf",
    "App",
    "BatchPolicy",
    "Handler",
    "HandlerResult",
    "InputCheck",
    "ModelOf",
    "ReviewCheck",
    "TaskKind",
    "call_review",
    "running",
]

log = logging.getLogger("kiln")

HISTORY_PAGE = 500
#: The most webhook deliveries one task's listing shows (a task has one per event it sent).
MAX_DELIVERIES_SHOWN = 1000
#: How many tasks' latest status a stream remembers to keep progress behind its status.
STATUS_MEMORY = 10_000
#: A list cursor is the id of the last task of the page before (kiln.canonical.new_task_id).
CURSOR_PATTERN = re.compile(r"tsk_[0-9a-hjkmnp-tv-z]{26}")


def check_cursor(cursor: str | None) -> None:
    """Refuse (InvalidCursor) a cursor that is not a ``next_cursor`` kiln gave."""
    if cursor is not None and CURSOR_PATTERN.fullmatch(cursor) is None:
        raise InvalidCursor(
            "the cursor is not one a page gave: pass next_cursor of the previous page as is",
            details=[{"loc": ["query", "cursor"], "msg": "malformed cursor", "type": "cursor"}],
        )


class StreamOrder:
    """What a stream shows of its messages, in an order a client can trust: progress only
    once the task's GENERATING event was shown. Live progress may overtake that event (the
    event comes through the log's tail, progress at once); the latest such progress is held
    back and shown right after the event, and dropped if the task goes another way."""

    def __init__(self) -> None:
        self.status_of: dict[str, Status] = {}
        self.held: dict[str, Message] = {}

    def admit(self, message: Message) -> list[Message]:
        """The messages to show now for ``message`` (none, it, or it and held progress)."""
        shown: list[Message] = []
        if isinstance(message, TaskEvent):
            self.status_of[message.task_id] = message.status
            shown.append(message)
            if message.status is Status.GENERATING:
                early = self.held.pop(message.task_id, None)
                if early is not None:
                    shown.append(early)
            elif message.status not in BEFORE_GENERATING:
                self.held.pop(message.task_id, None)
        else:
            status = self.status_of.get(message.task_id, Status.GENERATING)
            if status == Status.GENERATING:
                shown.append(message)
            elif status in BEFORE_GENERATING:
                self.held[message.task_id] = message
        for memory in (self.status_of, self.held):  # a long-lived feed forgets old tasks
            if len(memory) > STATUS_MEMORY:
                del memory[next(iter(memory))]
        return shown


class App:
    """kiln as a library: ``app = kiln.App(database=..., storage=...)``.

    Register kinds with :meth:`task`, then ``async with app:`` to open the store, and
    :meth:`submit`, :meth:`get`, :meth:`cancel`, :meth:`retry`, :meth:`watch`. Run
    workers and the supervisor with :meth:`worker` and :meth:`supervisor`. The policy
    they share is :attr:`engine`'s.
    """

    def __init__(
        self,
        database: str | None = None,
        storage: str | None = None,
        *,
        settings: Settings | None = None,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
        store: Store | None = None,
        storage_backend: Storage | None = None,
    ) -> None:
        settings = settings or Settings()
        if database:
            settings = settings.with_(database_url=database)
        if storage:
            settings = settings.with_(storage_url=storage)
        self.engine = Engine(
            settings, {}, clock=clock, rng=rng, store=store, storage=storage_backend
        )
        self._breakers: Breakers | None = None

    # registry

    def task(
        self,
        name: str,
        *,
        params: type[pydantic.BaseModel] | None = None,
        resources: dict[str, int] | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        review: ReviewCheck | None = None,
        normalize: Callable[[JSON], JSON] | None = None,
        inputs: Sequence[str] = (),
        check: InputCheck | None = None,
        model: str | ModelOf | None = None,
        amounts: AmountsOf | None = None,
        batch: BatchPolicy | None = None,
    ) -> Callable[[Handler], Handler]:
        """Register ``handler(ctx, params)`` for tasks of kind ``name``.

        ``inputs`` names the files a task of this kind is submitted with; ``check`` refuses
        params that do not fit them (see :meth:`TaskKind.check_inputs`). ``model`` says
        which model a task needs: the name of a string param, or a function of the
        validated params (warm-model routing, docs/scheduling.md). ``amounts`` says how
        much of each pool a task takes, from its params (memory admission), over
        ``resources``. ``batch`` runs the kind's tasks in batches: the handler then takes
        lists, ``handler(ctxs, params)`` (:class:`BatchPolicy`).
        """

        def register(handler: Handler) -> Handler:
            if name in self.kinds:
                raise ValueError(f"task kind {name!r} is already registered")
            self.kinds[name] = TaskKind(
                name, handler, params, dict(resources or {}), timeouts, retry, review, normalize,
                tuple(inputs), check, model, amounts, batch,
            )  # fmt: skip
            return handler

        return register

    def kind(self, name: str) -> TaskKind:
        """The registered kind ``name``, or UnknownKind. ``pipeline`` is kiln's own
        (docs/pipelines.md): its params are checked step by step, no worker serves it."""
        if name == pipelines.KIND:
            return TaskKind(name, _no_handler, pipelines.Shape, normalize=self._plan_pipeline)
        return find_kind(self.kinds, name)

    def _plan_pipeline(self, params: JSON) -> JSON:
        limit = self.settings.max_image_pixels
        fits = functools.partial(transform.check_sheet_size, max_pixels=limit)
        return pipelines.plan(params, self.kind, transform.outputs_of, fits)

    # the engine's parts, as attributes of the App

    @property
    def settings(self) -> Settings:
        return self.engine.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self.engine.settings = settings

    @property
    def kinds(self) -> dict[str, TaskKind]:
        return self.engine.kinds

    @property
    def clock(self) -> Callable[[], float] | None:
        return self.engine.clock

    @property
    def rng(self) -> random.Random:
        return self.engine.rng

    @property
    def retry_policy(self) -> RetryPolicy:
        return self.engine.retry_policy

    @property
    def illegal_transitions(self) -> int:
        """Transitions the state table refused in this process."""
        return self.engine.illegal_transitions

    @property
    def cancel_listeners(self) -> list[Callable[[str], None]]:
        return self.engine.cancel_listeners

    @property
    def store(self) -> Store:
        return self.engine.store

    @property
    def storage(self) -> Storage:
        return self.engine.storage

    @property
    def hub(self) -> EventHub:
        return self.engine.hub

    @property
    def wake(self) -> asyncio.Event:
        """Set when work became claimable; workers in this process wait on it."""
        return self.engine.wake

    @property
    def breakers(self) -> Breakers:
        """This process's circuit breakers, shared with every process through the store
        (one set per process, whatever the number of workers in it)."""
        if self._breakers is None:
            self._breakers = Breakers(self.engine)
        return self._breakers

    def now(self) -> float:
        return self.engine.now()

    @functools.cached_property
    def schedules(self) -> Schedules:
        """The recurring schedules (:class:`kiln.app_parts.Schedules`)."""
        return Schedules(self.engine)

    @functools.cached_property
    def operations(self) -> Operations:
        """What an operator reads (:class:`kiln.app_parts.Operations`)."""
        return Operations(self.engine)

    async def connect(self) -> None:
        """Reach the store now (PostgreSQL: connect and apply pending migrations)."""
        await self.engine.store.last_seq()

    # lifecycle

    async def open(self) -> App:
        self.engine.open()
        return self

    async def close(self) -> None:
        await self.engine.close()

    async def __aenter__(self) -> App:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def apply(
        self,
        task: Task,
        event: Event,
        target: Status | None = None,
        *,
        fields: dict[str, Any] | None = None,
        error: JSON | None = None,
        fenced: bool = False,
        bump_epoch: bool = False,
        leader: LeaderToken | None = None,
        retry_error: JSON | None = None,
        counters: Sequence[Count] = (),
        retry_after_s: float | None = None,
        then: Event | None = None,
    ) -> Task:
        """The one way a status changes: see :meth:`Engine.apply <kiln.engine.Engine.apply>`."""
        return await self.engine.apply(
            task, event, target, fields=fields, error=error, fenced=fenced,
            bump_epoch=bump_epoch, leader=leader, retry_error=retry_error, counters=counters,
            retry_after_s=retry_after_s, then=then,
        )  # fmt: skip

    # submission

    def submission(self, kind: str, params: Any, **fields: Any) -> Submission:
        """A request as one checked value (:func:`kiln.submission.submission_of`: its
        params validated once), for :meth:`admit`, :meth:`holding` and :meth:`enter`."""
        return submission_of(self, kind, params, **fields)

    async def submit(
        self,
        kind: str,
        params: Any,
        *,
        tenant: str = DEFAULT_TENANT,
        idempotency_key: str | None = None,
        dedup: bool = True,
        priority: int = 0,
        max_attempts: int = 3,
        deadline_s: float = 86400,
        timeouts: Timeouts | None = None,
        metadata: JSON | None = None,
        inputs: list[JSON] | None = None,
        webhook_url: str | None = None,
        webhook_events: Sequence[str] | None = None,
        run_at: float | str | None = None,
        delay_s: float | None = None,
        rerun_of: str | None = None,
    ) -> SubmitResult:
        """Create a task, or return the one this request already made (see API.md).

        ``webhook_url`` and ``webhook_events`` ask for its status changes to be POSTed
        (see :mod:`kiln.webhooks`). ``run_at`` (unix seconds or RFC 3339) or ``delay_s``
        delay it: it stays PENDING, with no queue position, until then; its deadline
        counts from then (docs/schedules.md)."""
        return await self.enter(
            self.submission(
                kind, params, tenant=tenant, idempotency_key=idempotency_key, dedup=dedup,
                priority=priority, max_attempts=max_attempts, deadline_s=deadline_s,
                timeouts=timeouts, metadata=metadata, inputs=inputs or (),
                webhook_url=webhook_url, webhook_events=webhook_events, run_at=run_at,
                delay_s=delay_s, rerun_of=rerun_of,
            )
        )  # fmt: skip

    async def enter(self, submission: Submission) -> SubmitResult:
        """Store a :class:`Submission` (checked when it was made, not again): the task it
        creates, or the one an earlier identical request made."""
        tracing = self.engine.tracing  # the API's request span, when tracing is on
        trace = tracing.current() if tracing is not None else None
        new = submission.new_task(self.kind(submission.kind), trace)
        return await self.engine.submit(new, pipeline=submission.kind == pipelines.KIND)

    async def admit(self, submission: Submission) -> None:
        """Take the tenant's rate-limit tokens for a submission, one per task it creates
        (RateLimited, 429, counted)."""
        if self.settings.tenant_limit(submission.tenant).rate is not None:
            await self.engine.check_rate(submission.tenant, submission.tasks)

    async def admit_all(self, submissions: Mapping[int, Submission]) -> list[int]:
        """Tokens for a batch, in order: the indexes the tenant's rate lets through. Once
        one is refused the rest are (the limit holds for the whole batch), each counted in
        kiln_rate_limited."""
        allowed: list[int] = []
        for index, submission in submissions.items():
            try:
                await self.admit(submission)
            except RateLimited:
                await self.engine.count_rate_limited(len(submissions) - len(allowed) - 1)
                break
            allowed.append(index)
        return allowed

    def holding(
        self, submission: Submission, files: Sequence[tuple[str, bytes]] = (), *, drop: bool = True
    ) -> contextlib.AbstractAsyncContextManager[Submission]:
        """``async with app.holding(submission, files) as full:`` the submission with its
        inputs named by reference found and checked, its files (sha256, bytes) kept, all
        pinned while the block runs (:func:`kiln.submission.holding`)."""
        return holding(
            self.store, self.storage, submission, self.kind, files,
            max_pixels=self.settings.max_image_pixels, drop=drop,
        )  # fmt: skip

    def pinned(
        self, files: Sequence[tuple[str, bytes]], *, drop: bool = True
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """Input files (sha256, bytes) kept and pinned while the block runs."""
        return pinned(self.store, self.storage, files, drop=drop)

    async def rerun(
        self,
        task_id: str,
        *,
        tenant: str | None = None,
        params: JSON | None = None,
        priority: int | None = None,
        dedup: bool = True,
        idempotency_key: str | None = None,
    ) -> SubmitResult:
        """A new task of the same kind as ``task_id`` (NotFound outside ``tenant``), with
        ``params`` merged over its params (top-level keys) and validated as a submission;
        its ``rerun_of`` names the original. It keeps the original's tenant, attempts,
        deadline, timeouts, metadata, inputs and webhook. With ``dedup`` (the default) an
        identical live or successful task answers instead (``deduplicated``); without it,
        a new variation is always made."""
        original = await self.get(task_id, tenant)
        webhook = original.webhook or {}
        base = original.params
        if original.kind == pipelines.KIND:  # its own steps planned anew, any change checked
            base = pipelines.unplanned(base)
        submission = self.submission(
            original.kind, {**base, **(params or {})}, tenant=original.tenant,
            idempotency_key=idempotency_key, dedup=dedup,
            priority=original.priority if priority is None else priority,
            max_attempts=original.max_attempts, deadline_s=original.deadline_s,
            timeouts=original.timeouts, metadata=original.metadata, inputs=original.inputs,
            webhook_url=webhook.get("url"), webhook_events=webhook.get("events"),
            rerun_of=original.id,
        )  # fmt: skip
        await self.admit(submission)
        return await self.enter(submission)

    def timeouts_of(
        self,
        kind: str,
        *,
        waiting_s: float | None = None,
        generating_s: float | None = None,
        uploading_s: float | None = None,
    ) -> Timeouts:
        """A task's per-state timeouts: those given, the kind's for the others (or the
        defaults when the kind sets none)."""
        base = self.kind(kind).timeouts or Timeouts()
        return Timeouts(
            waiting_s=base.waiting_s if waiting_s is None else waiting_s,
            generating_s=base.generating_s if generating_s is None else generating_s,
            uploading_s=base.uploading_s if uploading_s is None else uploading_s,
        )

    def check_submission(self, kind: str, params: Any, **fields: Any) -> None:
        """Refuse (InvalidRequest, UnknownKind) what :meth:`submit` would refuse, before
        anything is stored (:meth:`submission` made and dropped)."""
        self.submission(kind, params, **fields)

    async def check_rate(self, tenant: str, kind: str | None = None, params: Any = None) -> None:
        """Refuse a submission past KILN_MAX_TASKS_PER_REQUEST (TooManyTasks, 413, with
        ``kind``), or over the tenant's rate, a token per task it creates (RateLimited, 429,
        counted). A bad ``kind`` or ``params`` is refused as such first (422)."""
        if kind is None:
            await self.admit(Submission("", {}, tenant=tenant))
        else:
            await self.admit(self.submission(kind, params, tenant=tenant))

    def tasks_of(self, kind: str, params: Any) -> int:
        """The tasks a submission creates (kiln.limits.tasks_in; a pipeline checked first),
        refused (TooManyTasks) past KILN_MAX_TASKS_PER_REQUEST."""
        return self.submission(kind, params).tasks

    async def coalesced(self, result: SubmitResult, *, replayed: bool) -> SubmitResult:
        """The answer to a copy of a submission that an identical concurrent one in this
        process answered (single-flight): what the store would have said, counted as the
        store would have counted it (a replay of the key, or a content-dedup hit)."""
        await self.engine.count_dedup_hit("idempotency" if replayed else "content")
        return SubmitResult(
            result.task, created=False, replayed=replayed, deduplicated=not replayed
        )

    # reads

    async def get(self, task_id: str, tenant: str | None = None) -> Task:
        """The task, or NotFound, also when it belongs to another tenant."""
        return await self.engine.get(task_id, tenant)

    async def pipeline_steps(self, pipeline: Task) -> dict[str, Task]:
        """The steps a pipeline made so far, by ``name/copy`` (docs/pipelines.md)."""
        return await self.store.pipeline_steps(pipeline)

    async def queue_position(self, task: Task) -> int | None:
        """1 for the next task a worker of its kind would claim, while it is ready."""
        return await self.engine.queue_position(task)

    async def webhook_deliveries(
        self, task_id: str, tenant: str | None = None
    ) -> list[WebhookDelivery]:
        """The task's webhook deliveries in event order (at most ``MAX_DELIVERIES_SHOWN``);
        NotFound as :meth:`get`."""
        task = await self.get(task_id, tenant)
        return await self.store.webhook_deliveries(task_id=task.id, limit=MAX_DELIVERIES_SHOWN)

    async def redeliver(
        self, task_id: str, delivery_id: str, tenant: str | None = None
    ) -> WebhookDelivery:
        """Send one of the task's deliveries again (the same event id and body), due now,
        whatever its status; NotFound for an unknown task or delivery. A delivery that had
        used up its attempts gets one more; one that had attempts left keeps its backoff."""
        task = await self.get(task_id, tenant)
        found = await self.store.webhook_redeliver(delivery_id, task_id=task.id)
        if found is None:
            raise NotFound(f"task {task.id} has no webhook delivery {delivery_id!r}")
        log.info(
            "webhook_redelivery_asked",
            extra={"task_id": task.id, "event_id": found.event_id, "attempts": found.attempts},
        )
        return found

    async def queue_positions(self, tasks: Sequence[Task]) -> dict[str, int]:
        """The positions of many tasks by id (one count per priority level, not per task)."""
        return await self.engine.queue_positions(tasks)

    async def pool_wait(self, task: Task) -> PoolWait | None:
        """Where a WAITING_FOR_RESOURCE task stands in a shared pool's line, or None."""
        return await self.engine.pool_wait(task)

    async def list_tasks(
        self,
        *,
        tenant: str | None,
        status: Status | None = None,
        kind: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Task], str | None]:
        """A page of tasks, newest first, and the cursor of the next page (None: the last).

        A ``cursor`` that no page gave is refused (InvalidCursor) before the store is read."""
        check_cursor(cursor)
        return await self.engine.list_tasks(
            tenant=tenant, status=status, kind=kind, limit=limit, cursor=cursor
        )

    async def stats(self, tenant: str | None = None) -> Stats:
        """Counts, dwell times, failures and ghosts of a tenant's tasks (None: all)."""
        return await self.engine.stats(tenant)

    async def pools(self) -> list[PoolUsage]:
        """The shared resource pools (KILN_POOLS): capacity, units held, tasks waiting."""
        return await self.engine.pools()

    async def shared_breakers(self) -> list[BreakerRecord]:
        """The circuit breakers' states as every process shares them through the store."""
        return await self.engine.shared_breakers()

    async def ready(self) -> None:
        """Raise unless the store answers and the storage takes a write and a delete."""
        await self.engine.probe(f"_kiln/readyz-{uuid.uuid4().hex}")

    # user actions

    async def cancel(self, task_id: str, tenant: str | None = None) -> Task:
        """Cancel now when nothing runs; otherwise ask the worker (cancel_requested)."""
        for _ in range(20):
            task = await self.get(task_id, tenant)
            if task.final:
                raise AlreadyFinal(f"task {task_id} is already {task.status}")
            try:
                if task.kind == pipelines.KIND:
                    return await self._cancel_pipeline(task.id)
                if task.status in RUNNING:
                    return await self.engine.request_cancel(task)
                return await self.engine.apply(task, Event.CANCEL)
            except Conflict:
                continue
        raise Conflict(f"task {task_id} keeps changing; try again")

    async def _cancel_pipeline(self, pipeline_id: str) -> Task:
        """Cancel a pipeline; the workers of this process hear at once of its steps that
        were running (asked to stop)."""
        cancelled = await self.store.cancel_pipeline(pipeline_id)
        for step in (await self.pipeline_steps(cancelled)).values():
            if step.cancel_requested and step.status in RUNNING:
                for listener in self.cancel_listeners:
                    listener(step.id)
        return cancelled

    async def retry(self, task_id: str, tenant: str | None = None) -> Task:
        """Manual retry of a final FAILED, TIMEOUT or CANCELLED task: due now. A step of
        a pipeline that ended is retried with its pipeline (the steps that did not
        succeed run again, the pipeline goes on from them); alone it would lead nowhere."""
        for _ in range(20):
            task = await self.get(task_id, tenant)
            if task.status not in ENDED_UNSUCCESSFULLY:
                raise NotRetryable(f"task {task_id} is {task.status}; only final FAILED, "
                                   "TIMEOUT or CANCELLED tasks can be retried")  # fmt: skip
            fields = rerun_fields(task, self.now())
            try:
                if task.kind == pipelines.KIND:
                    return await self.store.retry_pipeline(task.id, {})
                if task.pipeline_id is not None:
                    pipeline = await self.store.get(task.pipeline_id)
                    if pipeline is not None and pipeline.status in ENDED_UNSUCCESSFULLY:
                        await self.store.retry_pipeline(pipeline.id, {})
                        return await self.get(task_id, tenant)
                return await self.engine.apply(task, Event.RETRY, fields=fields)
            except Conflict:
                continue
        raise Conflict(f"task {task_id} keeps changing; try again")

    async def bulk_action(
        self, action: str, found: BulkFilter, *, dry_run: bool, limit: int, cursor: str | None
    ) -> JSON:
        """One page of a bulk cancel or retry by filter (:mod:`kiln.bulk_actions`)."""
        return await bulk_actions.bulk_action(
            self.engine, action, found, dry_run=dry_run, limit=limit, cursor=cursor
        )

    async def review(self, task_id: str, decision: str, reason: str | None = None) -> Task:
        """An admin's moderation decision on a task in NEEDS_REVIEW."""
        if decision not in ("approve", "reject"):
            raise InvalidRequest("decision must be 'approve' or 'reject'")
        task = await self.get(task_id)
        if task.status is not Status.NEEDS_REVIEW:
            raise NotInReview(f"task {task_id} is {task.status}, not NEEDS_REVIEW")
        outputs = [StoredOutput.from_json(o) for o in (task.result or {}).get("outputs", [])]
        try:
            if decision == "approve":
                if all([await verify(self.storage, o) for o in outputs]) and outputs:
                    return await self.engine.apply(task, Event.APPROVE, fields={"error": None})
                error = {"code": "result_lost", "message": "outputs are missing or corrupt",
                         "retryable": False}  # fmt: skip
            else:
                message = reason or "rejected by a moderator"
                error = {"code": "content_rejected", "message": message, "retryable": False}
            updated = await self.engine.apply(
                task, Event.REJECT, error=error, fields={"error": error},
                counters=[failure(task, str(error["code"]))],
            )  # fmt: skip
        except Conflict:
            raise NotInReview(f"task {task_id} left NEEDS_REVIEW") from None
        for output in outputs:
            await self.storage.delete(output.key)
        return updated

    # streams

    async def watch(
        self,
        task_id: str | None = None,
        *,
        tenant: str | None = None,
        after: int | None = None,
        replay: bool = True,
    ) -> AsyncIterator[Message]:
        """Status events (replayed from the log, then live) and live progress.

        For one task the stream ends after its final event; the tenant feed never ends. A
        pipeline's stream carries its steps' events too (:meth:`_watch_pipeline`).
        """
        found = None if task_id is None else await self.engine.store.get(task_id)
        if found is not None and found.kind == pipelines.KIND:
            stream = self._watch_pipeline(found, after or 0)
        else:
            stream = self._watch(task_id, tenant=tenant, after=after, replay=replay)
        async for message in stream:
            yield message

    async def _watch(
        self, task_id: str | None, *, tenant: str | None, after: int | None, replay: bool
    ) -> AsyncIterator[Message]:
        async with self.hub.subscribe(task_id=task_id, tenant=tenant) as sub:
            live_only = task_id is None and after is None and not replay
            last = after or 0
            if live_only:  # "from now": what committed before, even if the tail lags
                last = max(self.hub.last_seq, await self.engine.store.last_seq())
            replayed, final_seen = False, False
            order = StreamOrder()
            # A feed of many tasks replays up to where the tail stands and takes the rest
            # live: past that point a smaller seq may still commit (PostgreSQL). One
            # task's events commit in seq order, so its replay reads to the end.
            upto = None if task_id is not None else self.hub.last_seq
            async for event in self._history(task_id, tenant, last, upto):
                last, replayed, final_seen = event.seq, True, event.final
                order.admit(event)
                yield event
            if task_id is not None and await self._ended(task_id, replayed, final_seen):
                return
            while True:
                async for message in self._next(sub, task_id, tenant, last):
                    if isinstance(message, TaskEvent):
                        last = message.seq
                    for shown in order.admit(message):
                        yield shown
                        if task_id is not None and shown.final:
                            return

    async def _watch_pipeline(self, pipeline: Task, after: int) -> AsyncIterator[Message]:
        """A pipeline's events and its steps' (status and progress), replayed then live,
        until the pipeline's final event. New steps appear with a step's final event or
        the pipeline's own: the steps are read again then."""
        async with self.hub.subscribe(task_id=None, tenant=pipeline.tenant) as sub:
            follow = _PipelineFollow(self, pipeline.id, after)
            for event in await follow.catch_up() + await follow.catch_up():
                yield event  # twice: steps made while the first replay read
            current = await self.engine.store.get(pipeline.id)
            if current is None or current.final:
                return
            while True:
                message = await sub.queue.get()
                batch = await follow.catch_up() if sub.lagged else follow.admit(message)
                sub.lagged = False
                while batch:
                    shown = batch.pop(0)
                    yield shown
                    if shown.task_id == pipeline.id and shown.final:
                        return
                    if isinstance(shown, TaskEvent) and (
                        shown.final or shown.task_id == pipeline.id
                    ):
                        batch += await follow.catch_up()

    async def _ended(self, task_id: str, replayed: bool, final_seen: bool) -> bool:
        """Whether a task stream is done after its replay: its latest event was final."""
        if replayed:
            return final_seen
        task = await self.engine.store.get(task_id)
        return task is not None and task.final

    async def _next(
        self, sub: Subscription, task_id: str | None, tenant: str | None, last: int
    ) -> AsyncIterator[Message]:
        """The next messages of a subscription, re-read from the log if it fell behind."""
        message = await sub.queue.get()
        if sub.lagged:
            sub.lagged = False
            upto = None if task_id is not None else self.hub.last_seq
            async for event in self._history(task_id, tenant, last, upto):
                yield event
        elif not isinstance(message, TaskEvent) or message.seq > last:
            yield message

    async def _history(
        self, task_id: str | None, tenant: str | None, after: int, upto: int | None = None
    ) -> AsyncIterator[TaskEvent]:
        """The persisted events after ``after`` (up to ``upto``), read page by page."""
        while True:
            page = await self.engine.events(
                task_id=task_id, tenant=tenant, after=after, limit=HISTORY_PAGE
            )
            for event in page:
                if upto is not None and event.seq > upto:
                    return
                yield event
            if len(page) < HISTORY_PAGE:
                return
            after = page[-1].seq

    async def wait(self, task_id: str, *, timeout_s: float | None = None) -> Task:
        """Wait until the task is final and return it."""

        async def follow() -> Task:
            async for _ in self.watch(task_id):
                pass
            return await self.get(task_id)

        return await asyncio.wait_for(follow(), timeout_s)

    def publish_progress(self, event: ProgressEvent) -> None:
        """Live progress to this process's streams."""
        self.engine.publish_progress(event)

    # processes

    def worker(
        self,
        *,
        concurrency: int = 4,
        kinds: Sequence[str] | None = None,
        resources: dict[str, int] | None = None,
        worker_id: str | None = None,
        lease_ttl_s: float | None = None,
        idle_poll_s: tuple[float, float] = (0.05, 1.0),
    ) -> Worker:
        """A worker of this process (see :class:`kiln.worker.Worker`); every worker of
        the App shares its circuit breakers. Without ``kinds`` it claims every kind but
        those that drive a server of their own (``comfy.workflow``): name them."""
        if kinds is None and any(name in NAMED_ONLY for name in self.kinds):
            kinds = [name for name in self.kinds if name not in NAMED_ONLY] or None
        return Worker(
            self.engine, breakers=self.breakers, concurrency=concurrency, kinds=kinds,
            resources=resources, worker_id=worker_id, lease_ttl_s=lease_ttl_s,
            idle_poll_s=idle_poll_s,
        )  # fmt: skip

    def supervisor(
        self,
        *,
        interval_s: float | None = None,
        owner: str | None = None,
        batch: int = 500,
        leader_ttl_s: float | None = None,
    ) -> Supervisor:
        """A supervisor (see :class:`kiln.supervisor.Supervisor`)."""
        return Supervisor(
            self.engine, interval_s=interval_s, owner=owner, batch=batch, leader_ttl_s=leader_ttl_s
        )


class _PipelineFollow:
    """What a pipeline's stream has shown: the tasks it follows, the events it sent."""

    def __init__(self, app: App, pipeline_id: str, after: int) -> None:
        self.app, self.pipeline_id, self.after = app, pipeline_id, after
        self.ids: set[str] = {pipeline_id}
        self.seen: set[int] = set()

    async def catch_up(self) -> list[Message]:
        """The pipeline's steps read again, and the events of them all not sent yet."""
        current = await self.app.engine.store.get(self.pipeline_id)
        if current is not None:
            self.ids.update(t.id for t in (await self.app.pipeline_steps(current)).values())
        found = [e for i in sorted(self.ids) async for e in self.app._history(i, None, self.after)]
        fresh = sorted((e for e in found if e.seq not in self.seen), key=lambda e: e.seq)
        self.seen.update(e.seq for e in fresh)
        return list(fresh)

    def admit(self, message: Message) -> list[Message]:
        """A live message, when it is one of the pipeline's and was not sent yet."""
        if message.task_id not in self.ids:
            return []
        if isinstance(message, TaskEvent):
            if message.seq in self.seen:
                return []
            self.seen.add(message.seq)
        return [message]


async def _no_handler(ctx: Any, params: Any) -> None:
    raise AssertionError("a pipeline is never claimed")


@contextlib.asynccontextmanager
async def running(*coros: Awaitable[None]) -> AsyncIterator[list[asyncio.Task[None]]]:
    """Run background loops for the duration of a block, then cancel them."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        yield tasks
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
