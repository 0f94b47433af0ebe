"""App: kiln as a library. Submission, on top of an :class:`~kiln.engine.Engine` that holds
the wiring and the policy; the App's other groups live beside it: the task-kind registry
(:mod:`kiln.app_kinds`), the engine's parts and lifecycle (:mod:`kiln.app_engine`), the
task reads (:mod:`kiln.app_reads`), the user actions (:mod:`kiln.app_actions`), the streams
(:mod:`kiln.app_streams`), the schedules and what an operator reads (:mod:`kiln.app_parts`).

Every status change goes through :meth:`Engine.apply <kiln.engine.Engine.apply>`, which
checks the state table first (an illegal transition is refused and counted, never applied)
and then asks the store for one fenced compare-and-set with its event rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from kiln import bulk_actions, pipelines
from kiln.app_actions import Actions, rerun_request
from kiln.app_counts import BatchedCounts
from kiln.app_engine import EngineParts
from kiln.app_kinds import KindRegistry
from kiln.app_parts import Operations, Schedules
from kiln.app_reads import CURSOR_PATTERN, TaskReads
from kiln.app_streams import Streams
from kiln.backends.comfy_workflow_params import KIND as COMFY_WORKFLOW
from kiln.breakers import Breakers
from kiln.bus import Message, ProgressEvent
from kiln.config import Settings
from kiln.contributions import Counts, Retry
from kiln.engine import Engine
from kiln.errors import (
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
)
from kiln.models import JSON, NewTask, SubmitResult, Task, Timeouts
from kiln.states import Event, Status
from kiln.storage import Storage
from kiln.store import LeaderToken, Store
from kiln.store.bulk import BulkFilter
from kiln.store.effects import Count
from kiln.store.records import Fence
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
    "CURSOR_PATTERN",
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


class App(KindRegistry, EngineParts, TaskReads):
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
        self._actions = Actions(self.engine)
        self._streams = Streams(self.engine)
        #: The dedup hits of single-flight copies, written together (a burst's copies).
        self._dedup_hits = BatchedCounts(self.engine.count_dedup_hits)

    @property
    def breakers(self) -> Breakers:
        """This process's circuit breakers, shared with every process through the store
        (one set per process, whatever the number of workers in it)."""
        if self._breakers is None:
            self._breakers = Breakers(self.engine)
        return self._breakers

    @functools.cached_property
    def schedules(self) -> Schedules:
        """The recurring schedules (:class:`kiln.app_parts.Schedules`)."""
        return Schedules(self.engine)

    @functools.cached_property
    def operations(self) -> Operations:
        """What an operator reads (:class:`kiln.app_parts.Operations`)."""
        return Operations(self.engine)

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
        """The one way a status changes: see :meth:`Engine.apply <kiln.engine.Engine.apply>`
        (``fenced``, ``bump_epoch`` and ``leader`` make its fence; ``retry_error``,
        ``retry_after_s`` and ``then`` its retry)."""
        wants_retry = retry_error is not None or then is not None
        return await self.engine.apply(
            task,
            event,
            target,
            fields=fields,
            error=error,
            fence=Fence(fenced, bump_epoch, leader),
            retry=Retry(retry_error, retry_after_s, then) if wants_retry else None,
            facts=(Counts(tuple(counters)),) if counters else (),
        )

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
                kind,
                params,
                tenant=tenant,
                idempotency_key=idempotency_key,
                dedup=dedup,
                priority=priority,
                max_attempts=max_attempts,
                deadline_s=deadline_s,
                timeouts=timeouts,
                metadata=metadata,
                inputs=inputs or (),
                webhook_url=webhook_url,
                webhook_events=webhook_events,
                run_at=run_at,
                delay_s=delay_s,
                rerun_of=rerun_of,
            )
        )

    async def enter(
        self, submission: Submission, new: NewTask | None = None, *, place: bool = False
    ) -> SubmitResult:
        """Store a :class:`Submission` (checked when it was made, not again): the task it
        creates, or the one an earlier identical request made. ``new``: its task row when
        :meth:`task_row` made it already; ``place``: its queue position read in the same
        transaction (``SubmitResult.placed``; not for a pipeline)."""
        if new is None:
            new = self.task_row(submission)
        pipeline = submission.kind == pipelines.KIND
        return await self.engine.submit(new, pipeline=pipeline, place=place)

    async def dedup_hit(
        self, submission: Submission, content: str
    ) -> tuple[SubmitResult, int | None] | None:
        """The answer to a submission without an Idempotency-Key whose content (``content``:
        its :meth:`~kiln.submission.Submission.content_key`) a live or successful task
        holds (a content-dedup hit), with that task's queue position, from one read of
        the store and a counted hit (written with the hits that come with it); None when
        no task holds it (:meth:`enter` then inserts or gets it)."""
        if submission.idempotency_key is not None or submission.kind == pipelines.KIND:
            return None
        task, position = await self.engine.store.read_dedup(
            submission.tenant, content, self.engine.claim_policy
        )
        if task is None:
            return None
        await self._dedup_hits.add("content")
        return SubmitResult(task, created=False, deduplicated=True), position

    def task_row(self, submission: Submission, content_key: str | None = None) -> NewTask:
        """The task row a submission inserts (its id, fingerprint and dedup key), in the
        trace context of the caller when tracing is on; ``content_key``: its dedup key
        when the caller made it already."""
        tracing = self.engine.tracing  # the API's request span, when tracing is on
        trace = tracing.current() if tracing is not None else None
        return submission.new_task(self.kind(submission.kind), trace, content_key)

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
            self.engine.store,
            self.storage,
            submission,
            self.kind,
            files,
            max_pixels=self.settings.max_image_pixels,
            drop=drop,
        )

    def pinned(
        self, files: Sequence[tuple[str, bytes]], *, drop: bool = True
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """Input files (sha256, bytes) kept and pinned while the block runs."""
        return pinned(self.engine.store, self.storage, files, drop=drop)

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
        merged, fields = rerun_request(original, params, priority=priority)
        submission = self.submission(
            original.kind, merged, idempotency_key=idempotency_key, dedup=dedup, **fields
        )
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
        await self._dedup_hits.add("idempotency" if replayed else "content")
        return SubmitResult(
            result.task, created=False, replayed=replayed, deduplicated=not replayed
        )

    # user actions

    async def cancel(self, task_id: str, tenant: str | None = None) -> Task:
        """Cancel now when nothing runs; otherwise ask the worker (cancel_requested)."""
        return await self._actions.cancel(task_id, tenant)

    async def retry(self, task_id: str, tenant: str | None = None) -> Task:
        """Manual retry of a final FAILED, TIMEOUT or CANCELLED task: due now; a step of
        a pipeline that ended is retried with its pipeline (:class:`Actions`)."""
        return await self._actions.retry(task_id, tenant)

    async def bulk_action(
        self, action: str, found: BulkFilter, *, dry_run: bool, limit: int, cursor: str | None
    ) -> JSON:
        """One page of a bulk cancel or retry by filter (:mod:`kiln.bulk_actions`)."""
        return await bulk_actions.bulk_action(
            self.engine, action, found, dry_run=dry_run, limit=limit, cursor=cursor
        )

    async def review(self, task_id: str, decision: str, reason: str | None = None) -> Task:
        """An admin's moderation decision on a task in NEEDS_REVIEW."""
        return await self._actions.review(task_id, decision, reason)

    # streams

    def watch(
        self,
        task_id: str | None = None,
        *,
        tenant: str | None = None,
        after: int | None = None,
        replay: bool = True,
    ) -> AsyncIterator[Message]:
        """Status events (replayed from the log, then live) and live progress.

        For one task the stream ends after its final event; the tenant feed never ends. A
        pipeline's stream carries its steps' events too (:class:`Streams`).
        """
        return self._streams.watch(task_id, tenant=tenant, after=after, replay=replay)

    async def wait(self, task_id: str, *, timeout_s: float | None = None) -> Task:
        """Wait until the task is final and return it."""
        return await self._streams.wait(task_id, timeout_s=timeout_s)

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
            self.engine,
            breakers=self.breakers,
            concurrency=concurrency,
            kinds=kinds,
            resources=resources,
            worker_id=worker_id,
            lease_ttl_s=lease_ttl_s,
            idle_poll_s=idle_poll_s,
        )

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
