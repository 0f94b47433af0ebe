"""Engine: the policy every process shares, below the App.

Workers, supervisors, the webhook dispatcher, the circuit breakers and the reconciler all
take one :class:`Engine`; :class:`kiln.App` owns one and adds the registry, submission,
the user actions and the streams on top. The engine holds:

- the wiring: the store and the storage (opened lazily), the event hub, the clock;
- the one way a status changes (:meth:`Engine.apply`): the state table's check and the
  retry rules, then one fenced compare-and-set in the store with the effects the
  features' contributions add (:mod:`kiln.contributions`);
- the claim policy, the submission rate limit, and the reads the faces need (a task, the
  stats with the ghost rule, the metrics' reads), so no face reads the store itself.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from kiln import logs
from kiln.autoscaling import Autoscaling, signals
from kiln.bus import EventHub, ProgressEvent
from kiln.config import Settings
from kiln.contributions import (
    CONTRIBUTIONS,
    Contribution,
    Draft,
    Retry,
    committed,
    effects_of,
)
from kiln.counters import (
    DEDUP_HITS,
    ILLEGAL_TRANSITIONS,
    RATE_LIMITED,
)
from kiln.errors import NotFound, RateLimited
from kiln.kinds import TaskKind
from kiln.limits import rate_bucket
from kiln.models import JSON, NewTask, SubmitResult, Task, TaskEvent
from kiln.retry import RetryPolicy, retry_slot
from kiln.states import CLAIMABLE, RULES, RUNNING, Event, IllegalTransition, Status, check
from kiln.storage import Storage, open_storage
from kiln.store import BreakerRecord, Change, Stats, Store, WorkerRecord, open_store
from kiln.store.bulk import BulkFilter, BulkPage, Plan
from kiln.store.claims import Route, claim_policy
from kiln.store.pools import PoolUsage, PoolWait
from kiln.store.records import UNFENCED, Fence
from kiln.store.usage import FOREVER
from kiln.tracing import Tracing, open_tracing

log = logging.getLogger("kiln")
Contributions = Sequence[Contribution]


def ghost_after_s(lease_ttl_s: float, interval_s: float) -> float:
    """How long ago a running task's lease may have lapsed before it is a ghost: one lease
    plus two sweeps, by which time a supervisor should have moved it."""
    return lease_ttl_s + 2 * interval_s


class Engine:
    """The store, the storage and the policy on top of them, for one process.

    ``kinds`` is the registry the engine reads the kinds' retry policies from (the App
    shares its own); ``clock`` stands in for the store's clock in tests.
    """

    def __init__(
        self,
        settings: Settings,
        kinds: dict[str, TaskKind] | None = None,
        *,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
        store: Store | None = None,
        storage: Storage | None = None,
    ) -> None:
        self.settings = settings
        self.kinds: dict[str, TaskKind] = kinds if kinds is not None else {}
        self.clock = clock
        self.rng = rng or random.Random()
        self.retry_policy = RetryPolicy(settings.retry_base_s, settings.retry_max_s)
        self._store = store
        self._storage = storage
        self._hub: EventHub | None = None
        self._wake: asyncio.Event | None = None
        self.illegal_transitions = 0
        #: Called with a task id when this process asks a running task to stop, so a
        #: worker in the same process stops at once instead of at its next heartbeat.
        self.cancel_listeners: list[Callable[[str], None]] = []
        self._tracing: Tracing | None = None
        self._tracing_opened = False
        #: The features' contributions to every status change (kiln.contributions).
        self.contributions: Contributions = CONTRIBUTIONS

    # wiring

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self._settings = settings
        self.claim_policy = claim_policy(settings)

    @property
    def store(self) -> Store:
        """The store, opened on first use from ``settings.database_url``."""
        if self._store is None:
            self._store = open_store(
                self.settings.resolved_database_url,
                clock=self.clock,
                synchronous=self.settings.sqlite_synchronous,
                pool_size=self.settings.db_pool_size,
                submit_process=self.settings.sqlite_submit_process == "on",
            )
        return self._store

    @property
    def storage(self) -> Storage:
        """The object storage, opened on first use from ``settings.storage_url``."""
        if self._storage is None:
            self._storage = open_storage(self.settings.resolved_storage_url)
        return self._storage

    @property
    def hub(self) -> EventHub:
        """This process's fan-out of the event log to streams."""
        if self._hub is None:
            self._hub = EventHub(self.store)
        return self._hub

    @property
    def wake(self) -> asyncio.Event:
        """Set when work became claimable (here, or in another process where the store
        can tell); workers in this process wait on it."""
        if self._wake is None:
            self._wake = asyncio.Event()
            self.store.watch_ready(self._wake.set)  # and when another process did
        return self._wake

    @property
    def tracing(self) -> Tracing | None:
        """This process's OpenTelemetry spans (KILN_TRACING, docs/tracing.md), or None
        when tracing is off; opened on first use."""
        if not self._tracing_opened:
            self._tracing = open_tracing(self.settings)
            self._tracing_opened = True
        return self._tracing

    @tracing.setter
    def tracing(self, tracing: Tracing | None) -> None:
        self._tracing, self._tracing_opened = tracing, True

    def now(self) -> float:
        """The store's clock: the time every lease, deadline and retry is measured in."""
        return self.store.clock()

    def open(self) -> None:
        """Open the store and the storage now (a bad URL fails here, not later)."""
        _ = self.store, self.storage, self.tracing

    async def close(self) -> None:
        """Stop the event hub, export the spans still pending and close the store."""
        if self._hub is not None:
            await self._hub.close()
        if self._tracing is not None:
            await asyncio.to_thread(self._tracing.close)
            self._tracing_opened = False
            self._tracing = None
        if self._store is not None:
            await self._store.close()

    # publishing

    def written(self, events: Sequence[TaskEvent]) -> None:
        """Events this process wrote: streams read them now, workers claim what is ready."""
        if self._hub is not None and events:
            self._hub.poke()
        if any(e.status in CLAIMABLE for e in events):
            self.wake.set()

    def submitted(self) -> None:
        """A task was created: streams read the log now, and a worker may claim it."""
        if self._hub is not None:
            self._hub.poke()
        self.wake.set()

    async def submit(
        self, new: NewTask, *, pipeline: bool = False, place: bool = False
    ) -> SubmitResult:
        """Insert-or-get a checked submission's task (a pipeline with its first steps);
        ``place``: a task's queue position read with it (``SubmitResult.placed``; not for
        a pipeline)."""
        if pipeline:
            result = await self.store.submit_pipeline(new)
        else:
            result = await self.store.submit(new, place=place, policy=self.claim_policy)
        if result.created:
            submitted = {"task_id": result.task.id, "event": "submit", "to": "PENDING"}
            logs.line(log, "transition", {**submitted, "attempt": 0})
            self.submitted()
        return result

    def publish_progress(self, event: ProgressEvent) -> None:
        """Live progress to this process's streams (never persisted here)."""
        if self._hub is not None:
            self._hub.publish(event)

    # the one way a status changes

    async def apply(
        self,
        task: Task,
        event: Event,
        target: Status | None = None,
        *,
        fields: dict[str, Any] | None = None,
        error: JSON | None = None,
        fence: Fence = UNFENCED,
        retry: Retry | None = None,
        facts: Sequence[object] = (),
    ) -> Task:
        """Apply ``event`` to ``task`` as read: CAS on its status (and on its epoch when
        the ``fence`` says so: a worker's write, a leader's, an epoch bump).

        ``retry`` may schedule the next attempt, or chain one more event, in the same
        transaction (:class:`~kiln.contributions.Retry`). An event the state table
        refuses raises IllegalTransition and is counted, never applied. ``error`` goes on
        the event rows (the retry's error when not given). ``facts`` are what the caller
        tells the features' contributions (:mod:`kiln.contributions`: what a worker knows
        of the attempt, counters to add); they add the change's effects in its
        transaction (the GPU-second ledger's row, ...) and act after its commit (trace
        spans, ...).
        """
        try:
            to = check(task.status, event, target)
        except IllegalTransition as exc:
            await self._refused(task, event, exc)
            raise
        draft = Draft(task, [(event, to)], retry, facts, self.now())
        changes = _released(to, fields)
        if retry is not None:
            changes.update(await _plan_retry(self, draft, retry))
            error = retry.error if error is None else error
        updated, events = await self.store.apply(
            _change(draft, changes, error, fence, self.contributions)
        )
        _log_transitions(events)
        self.written(events)
        await committed(self, draft, updated, events, self.contributions)
        return updated

    async def _refused(self, task: Task, event: Event, exc: IllegalTransition) -> None:
        """Count an event the state table refused (here and in the store) and log it."""
        self.illegal_transitions += 1
        wanted = exc.target or "|".join(sorted(RULES[event].targets))
        await self.store.bump(ILLEGAL_TRANSITIONS, f"{task.status}>{wanted}")
        log.error("illegal_transition", extra={"task_id": task.id, "event": str(event)})

    # claims

    def claim(
        self,
        *,
        worker_id: str,
        kinds: list[str],
        limit: int,
        lease_ttl_s: float,
        acquire: Sequence[str] = (),
        route: Route | None = None,
    ) -> Awaitable[list[Task]]:
        """Claim up to ``limit`` ready tasks of ``kinds`` under the claim policy
        (KILN_CLAIM_*: aging, fair turns, running caps); those of ``acquire`` kinds come
        back acquired (GENERATING: they wait for no resource); ``route`` prefers the
        tasks of the models the worker holds (warm-model routing)."""
        return self.store.claim(
            worker_id=worker_id,
            kinds=kinds,
            limit=limit,
            lease_ttl_s=lease_ttl_s,
            policy=self.claim_policy,
            acquire=acquire,
            route=route,
        )

    async def request_cancel(self, task: Task) -> Task:
        """Ask the worker running ``task`` to stop; a worker of this process hears at once."""
        if not task.cancel_requested:
            task = await self.store.request_cancel(task.id)
        for listener in self.cancel_listeners:
            listener(task.id)
        return task

    # many tasks at once (bulk actions)

    def user_change(self, task: Task, event: Event, fields: dict[str, Any] | None = None) -> Change:
        """The compare-and-set :meth:`apply` makes for a user's action on ``task`` as read
        (cancel, retry: no retry to plan, no attempt ended), for a page of such changes in
        one transaction (:meth:`act_page`). IllegalTransition when the table refuses."""
        to = check(task.status, event)
        draft = Draft(task, [(event, to)], None, (), self.now())
        return _change(draft, _released(to, fields), None, UNFENCED, self.contributions)

    async def act_page(
        self, found: BulkFilter, after: str | None, limit: int, plan: Callable[[Task], Plan]
    ) -> BulkPage:
        """One page of a bulk action in one transaction of at most about
        ``KILN_BULK_PAGE_ROWS`` rows changed (:mod:`kiln.store.bulk`), then what
        :meth:`apply` and :meth:`request_cancel` do after theirs: the log lines, the wake-up
        of this process's streams, and the cancel listeners of its workers."""
        page = await self.store.bulk.page(
            found, after, limit, plan, rows=self.settings.bulk_page_rows
        )
        _log_transitions(page.events)
        self.written(page.events)
        for task in page.asked:
            for listener in self.cancel_listeners:
                listener(task.id)
        return page

    # reads

    async def get(self, task_id: str, tenant: str | None = None) -> Task:
        """The task, or NotFound, also when it belongs to another tenant."""
        task = await self.store.get(task_id)
        if task is None or (tenant is not None and task.tenant != tenant):
            raise NotFound(f"no task {task_id!r}")
        return task

    async def standing(self, task_id: str, tenant: str | None = None) -> tuple[Task, int | None]:
        """:meth:`get` and the task's queue position in one read of the store."""
        task, position = await self.store.read_standing(task_id, self.claim_policy)
        if task is None or (tenant is not None and task.tenant != tenant):
            raise NotFound(f"no task {task_id!r}")
        return task, position

    async def pool_wait(self, task: Task) -> PoolWait | None:
        """Where a WAITING_FOR_RESOURCE task stands in a shared pool's line, or None."""
        if task.status is not Status.WAITING_FOR_RESOURCE or not self.settings.pools:
            return None
        return await self.store.pools.wait(task.id)

    @property
    def ghost_after_s(self) -> float:
        """The ghost rule (:func:`ghost_after_s`) under the settings' lease and sweep."""
        return ghost_after_s(self.settings.lease_ttl_s, self.settings.supervisor_interval_s)

    async def stats(self, tenant: str | None) -> Stats:
        """Counts, dwell times, failures and ghosts of a tenant's tasks (None: all)."""
        return await self.store.stats(tenant=tenant, ghost_after_s=self.ghost_after_s)

    # what the faces read (the API's metrics, the dashboard, the App)

    async def events(
        self,
        *,
        task_id: str | None = None,
        tenant: str | None = None,
        after: int = 0,
        limit: int = 500,
    ) -> list[TaskEvent]:
        """Persisted status events after ``after``, in seq order."""
        return await self.store.events(task_id=task_id, tenant=tenant, after=after, limit=limit)

    async def counters(self) -> dict[tuple[str, str], int]:
        """Every counter the store keeps (names in :mod:`kiln.counters`), by (name, labels)."""
        return await self.store.counters()

    async def pools(self) -> list[PoolUsage]:
        """The shared resource pools: capacity, units held, tasks waiting."""
        return await self.store.pools.usage()

    async def shared_breakers(self) -> list[BreakerRecord]:
        """The circuit breakers' states as every process shares them."""
        return await self.store.limits.breakers()

    async def workers(self) -> list[WorkerRecord]:
        """The worker processes whose beat has not lapsed (the worker registry)."""
        return await self.store.workers.live()

    async def gpu_seconds(
        self, *, since: float = 0.0, until: float = FOREVER
    ) -> dict[tuple[str, str, str, str], float]:
        """GPU-seconds by (tenant, kind, model, outcome) of the attempts that ended in
        ``[since, until)``."""
        return await self.store.usage.gpu_seconds(since=since, until=until)

    async def webhook_pending(self) -> int:
        """Webhook deliveries not yet delivered or given up."""
        return await self.store.outbox.pending()

    async def autoscaling(
        self,
        *,
        workers: Sequence[WorkerRecord] | None = None,
        pools: Sequence[PoolUsage] | None = None,
    ) -> Autoscaling:
        """The autoscaling signals of every kind (registered or seen) and pool; pass the
        live workers and the pools when already read, so a scrape reads each once."""
        load = await self.store.load.read()
        if workers is None:
            workers = await self.workers()
        if pools is None:
            pools = await self.pools()
        return signals(load, workers, pools, self.kinds)

    async def probe(self, key: str) -> None:
        """Raise unless the store answers and the storage takes and drops ``key``."""
        await self.store.last_seq()
        await self.storage.put(key, b"ok")
        await self.storage.delete(key)

    # submission policy

    async def check_rate(self, tenant: str, tasks: int = 1) -> None:
        """Take a token for each of the ``tasks`` a submission creates from the tenant's
        bucket (in the store, so the limit holds across API nodes; kiln.limits.bucket_take),
        or count the refusal and raise RateLimited."""
        rate = self.settings.tenant_limit(tenant).rate
        if rate is None:
            return
        wait_s = await self.store.limits.take_token(rate_bucket(tenant), rate, tasks)
        if wait_s > 0:
            await self.count_rate_limited()
            what = "this request's task" if tasks == 1 else f"this request's {tasks} tasks"
            raise RateLimited(
                f"tenant {tenant!r} may create {rate.per_s:g} tasks a second"
                f" (bursts of {rate.burst:g}); {what} could be created in {wait_s:.1f} s",
                retry_after_s=wait_s,
            )

    async def count_rate_limited(self, refused: int = 1) -> None:
        """Count ``refused`` submissions refused by a tenant's rate (kiln_rate_limited)."""
        if refused > 0:
            await self.store.bump(RATE_LIMITED, delta=refused)

    async def count_dedup_hit(self, how: str) -> None:
        """Count a submission answered with an existing task (``idempotency`` or
        ``content``) without the store's insert-or-get having seen it."""
        await self.store.bump(DEDUP_HITS, how)

    async def count_dedup_hits(self, hits: Mapping[str, int]) -> None:
        """:meth:`count_dedup_hit` for many at once: one store write per ``how``."""
        for how, n in sorted(hits.items()):
            await self.store.bump(DEDUP_HITS, how, n)


async def _plan_retry(engine: Engine, draft: Draft, retry: Retry) -> dict[str, Any]:
    """The steps and the columns of ``retry``: its ``then``, and its failure's next
    attempt when the kind's backoff (and KILN_RETRY_RATE) allows one."""
    task, to = draft.task, draft.steps[0][1]
    if retry.then is not None:
        draft.steps.append((retry.then, check(to, retry.then, retry.then_to)))
    if retry.error is None:
        return {}
    due = _retry_due(engine, task, retry.error, retry.after_s)
    if due is not None and engine.settings.retry_rate is not None:
        due = await retry_slot(engine.store, task, due, engine.settings.retry_rate)
    if due is None:
        return {"error": retry.error}
    draft.steps.append((Event.SCHEDULE_RETRY, check(to, Event.SCHEDULE_RETRY)))
    return {"error": retry.error, "next_retry_at": due, "ready_at": due}


def _retry_due(
    engine: Engine, task: Task, error: JSON, retry_after_s: float | None
) -> float | None:
    """When the failed attempt's task retries by its kind's backoff, or None: a
    permanent error, a cancel asked, no attempts or no time left. (KILN_RETRY_RATE may
    push it later: see :func:`kiln.retry.retry_slot`.)"""
    if not error.get("retryable") or task.cancel_requested:
        return None
    kind = engine.kinds.get(task.kind)
    policy = (kind.retry if kind is not None else None) or engine.retry_policy
    return policy.next_retry_at(task, engine.now(), engine.rng, min_delay_s=retry_after_s or 0.0)


def _released(to: Status, fields: dict[str, Any] | None) -> dict[str, Any]:
    """The columns a change to ``to`` sets: ``fields``, and no lease when no worker holds
    the task any more."""
    changes = dict(fields or {})
    if to not in RUNNING:
        changes.update(lease_owner=None, lease_expires_at=None, state_deadline_at=None)
    return changes


def _change(
    draft: Draft, fields: dict[str, Any], error: JSON | None, fence: Fence, by: Contributions
) -> Change:
    """The compare-and-set of a drafted change, with the effects the contributions add."""
    task = draft.task
    expect_epoch = task.epoch if fence.on_epoch else None
    steps, effects = tuple(draft.steps), effects_of(draft, by)
    return Change(task.id, task.status, expect_epoch, steps, fields, error, fence, effects)


def _log_transitions(events: Sequence[TaskEvent]) -> None:
    for e in events:
        fields = {
            "task_id": e.task_id,
            "attempt": e.attempt,
            "epoch": e.epoch,
            "from": e.from_status,
            "to": e.status,
            "event": str(e.event),
            "duration_s": e.dwell_s,
        }
        if e.loading_s is not None:
            fields["loading_s"] = e.loading_s
        logs.line(log, "transition", fields)


def rerun_fields(task: Task, now: float) -> dict[str, Any]:
    """What a task run again by hand (a manual retry, a lost result's rerun) changes: due
    now, one more attempt allowed, no cancel asked, and a deadline that leaves it time."""
    return {
        "max_attempts": max(task.max_attempts, task.attempt) + 1,
        "finished_at": None,
        "next_retry_at": now,
        "ready_at": now,
        "cancel_requested": False,
        "cancel_requested_at": None,
        "deadline_at": max(task.deadline_at, now + task.deadline_s),
    }


class SupportsEngine(Protocol):
    """Anything that runs on an engine (:class:`kiln.App`)."""

    @property
    def engine(self) -> Engine: ...


def engine_of(owner: Engine | SupportsEngine) -> Engine:
    """``owner`` if it is an Engine, else its engine: the processes take either."""
    return owner if isinstance(owner, Engine) else owner.engine
