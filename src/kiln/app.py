"""App: the task-kind registry, the wiring of store and storage, and the engine's policy.

Every status change goes through :meth:`App.apply`, which checks the state table first
(an illegal transition is refused and counted, never applied) and then asks the store
for one fenced compare-and-set with its event rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pydantic

from kiln import canonical, webhooks
from kiln.bus import EventHub, Message, ProgressEvent, Subscription
from kiln.config import Settings
from kiln.errors import (
    AlreadyFinal,
    Conflict,
    InvalidRequest,
    NotFound,
    NotInReview,
    NotRetryable,
    UnknownKind,
)
from kiln.models import JSON, NewTask, Output, StoredOutput, SubmitResult, Task, TaskEvent, Timeouts
from kiln.retry import RetryPolicy, retry_slot
from kiln.states import CLAIMABLE, RULES, RUNNING, Event, IllegalTransition, Status, check
from kiln.storage import Storage, open_storage, verify
from kiln.store import FAILURES_BY_MINUTE, Change, LeaderToken, Store, open_store
from kiln.store.claims import claim_policy
from kiln.store.pools import PoolWait

if TYPE_CHECKING:
    from kiln.breakers import Breakers

log = logging.getLogger("kiln")

HandlerResult = Output | Sequence[Output] | None
Handler = Callable[..., Awaitable[HandlerResult]]
ReviewCheck = Callable[[Any, list[Output]], bool | Awaitable[bool]]
#: ``check(params, inputs)``: raises InvalidRequest when the params do not fit the inputs.
InputCheck = Callable[[Any, list[JSON]], None]

DEFAULT_TENANT = "default"
HISTORY_PAGE = 500
#: How many tasks' latest status a stream remembers to keep progress behind its status.
STATUS_MEMORY = 10_000


@dataclass(frozen=True, slots=True)
class TaskKind:
    """A registered kind of task: its handler and the policies the engine applies to it."""

    name: str
    handler: Handler
    params: type[pydantic.BaseModel] | None = None
    resources: dict[str, int] = field(default_factory=dict)
    timeouts: Timeouts | None = None
    retry: RetryPolicy | None = None
    review: ReviewCheck | None = None
    normalize: Callable[[JSON], JSON] | None = None
    #: Names of the inputs a task of this kind is submitted with (uploaded files).
    inputs: tuple[str, ...] = ()
    check: InputCheck | None = None

    def validate(self, params: Any) -> JSON:
        """Validated, canonical params (defaults applied) as plain JSON."""
        if self.params is None:
            if not isinstance(params, dict):
                raise InvalidRequest("params must be a JSON object")
            return dict(params)
        try:
            model = self.params.model_validate(params)
        except pydantic.ValidationError as exc:
            details = [
                {"loc": ["params", *map(str, err["loc"])], "msg": err["msg"], "type": err["type"]}
                for err in exc.errors()
            ]
            raise InvalidRequest(f"invalid params for {self.name}", details=details) from None
        data: JSON = model.model_dump(mode="json", exclude_none=True)
        return self.normalize(data) if self.normalize else data

    def parse(self, params: JSON) -> Any:
        return params if self.params is None else self.params.model_validate(params)

    def check_inputs(self, params: JSON, inputs: list[JSON]) -> None:
        """Refuse (InvalidRequest) an input this kind does not take or got twice, a missing
        one, and params that do not fit the inputs (``check``)."""
        names = [str(i["name"]) for i in inputs]
        for name in names:
            if name not in self.inputs or names.count(name) > 1:
                why = "twice" if name in self.inputs else f"but {self.name} does not take it"
                detail = {"loc": [name], "msg": "unexpected input", "type": "input"}
                raise InvalidRequest(f"the input {name!r} was sent {why}", details=[detail])
        for name in self.inputs:
            if name not in names:
                detail = {"loc": [name], "msg": "missing input", "type": "input"}
                raise InvalidRequest(
                    f"{self.name} needs the input {name!r}: upload it as a file part of a "
                    "multipart/form-data request",
                    details=[detail],
                )
        if self.check is not None:
            self.check(self.parse(params), inputs)


class App:
    """kiln as a library: ``app = kiln.App(database=..., storage=...)``.

    Register kinds with :meth:`task`, then ``async with app:`` to open the store, and
    :meth:`submit`, :meth:`get`, :meth:`cancel`, :meth:`retry`, :meth:`watch`. Run
    workers and the supervisor with :meth:`worker` and :meth:`supervisor`.
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
        self.settings = settings or Settings()
        if database:
            self.settings = self.settings.with_(database_url=database)
        if storage:
            self.settings = self.settings.with_(storage_url=storage)
        self.kinds: dict[str, TaskKind] = {}
        self.clock = clock
        self.rng = rng or random.Random()
        self.retry_policy = RetryPolicy(self.settings.retry_base_s, self.settings.retry_max_s)
        self._store = store
        self._storage = storage_backend
        self._hub: EventHub | None = None
        self._wake: asyncio.Event | None = None
        self.illegal_transitions = 0
        #: Called with a task id when this process asks a running task to stop, so a
        #: worker in the same process stops at once instead of at its next heartbeat.
        self.cancel_listeners: list[Callable[[str], None]] = []
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
    ) -> Callable[[Handler], Handler]:
        """Register ``handler(ctx, params)`` for tasks of kind ``name``.

        ``inputs`` names the files a task of this kind is submitted with; ``check`` refuses
        params that do not fit them (see :meth:`TaskKind.check_inputs`).
        """

        def register(handler: Handler) -> Handler:
            if name in self.kinds:
                raise ValueError(f"task kind {name!r} is already registered")
            self.kinds[name] = TaskKind(
                name, handler, params, dict(resources or {}), timeouts, retry, review, normalize,
                tuple(inputs), check,
            )  # fmt: skip
            return handler

        return register

    def kind(self, name: str) -> TaskKind:
        try:
            return self.kinds[name]
        except KeyError:
            raise UnknownKind(f"no task kind {name!r} is registered") from None

    # lifecycle

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(
                self.settings.resolved_database_url,
                clock=self.clock,
                synchronous=self.settings.sqlite_synchronous,
                pool_size=self.settings.db_pool_size,
            )
        return self._store

    @property
    def storage(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.settings.resolved_storage_url)
        return self._storage

    @property
    def hub(self) -> EventHub:
        if self._hub is None:
            self._hub = EventHub(self.store)
        return self._hub

    @property
    def breakers(self) -> Breakers:
        """This process's circuit breakers, shared with every process through the store
        (one set per process, whatever the number of workers in it)."""
        if self._breakers is None:
            from kiln.breakers import Breakers

            self._breakers = Breakers(self)
        return self._breakers

    @property
    def wake(self) -> asyncio.Event:
        """Set when work became claimable (here, or in another process where the store
        can tell); workers in this process wait on it."""
        if self._wake is None:
            self._wake = asyncio.Event()
            self.store.watch_ready(self._wake.set)  # and when another process did
        return self._wake

    def now(self) -> float:
        return self.store.clock()

    async def open(self) -> App:
        _ = self.store, self.storage
        return self

    async def close(self) -> None:
        if self._hub is not None:
            await self._hub.close()
        if self._store is not None:
            await self._store.close()

    async def __aenter__(self) -> App:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _written(self, events: Sequence[TaskEvent]) -> None:
        if self._hub is not None and events:
            self._hub.poke()
        if any(e.status in CLAIMABLE for e in events):
            self.wake.set()

    # the one way a status changes

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
        counters: Sequence[tuple[str, str]] = (),
        retry_after_s: float | None = None,
        then: Event | None = None,
    ) -> Task:
        """Apply ``event`` to ``task`` as read: CAS on its status (and on its epoch when
        fenced, led, or bumping the epoch: an epoch bump applies only at the epoch seen).

        With ``retry_error`` the failure may schedule the next attempt in the same
        transaction (``fail``/``expire`` then ``schedule_retry``), no sooner than
        ``retry_after_s`` from now when given. ``then`` chains one more event in the same
        transaction unconditionally (``lose`` then ``schedule_retry``).
        """
        try:
            to = check(task.status, event, target)
        except IllegalTransition as exc:
            self.illegal_transitions += 1
            wanted = exc.target or "|".join(sorted(RULES[event].targets))
            await self.store.bump("illegal_transitions", f"{task.status}>{wanted}")
            log.error("illegal_transition", extra={"task_id": task.id, "event": str(event)})
            raise
        steps = [(event, to)]
        if then is not None:
            steps.append((then, check(to, then)))
        changes = dict(fields or {})
        if to not in RUNNING:  # no worker holds the task any more
            changes.update(lease_owner=None, lease_expires_at=None, state_deadline_at=None)
        if retry_error is not None:
            changes["error"] = retry_error
            counters = [*counters, ("failures", f"{task.tenant}:{retry_error['code']}")]
            due = None
            if retry_error.get("retryable") and not task.cancel_requested:
                policy = self.kinds[task.kind].retry if task.kind in self.kinds else None
                due = (policy or self.retry_policy).next_retry_at(
                    task, self.now(), self.rng, min_delay_s=retry_after_s or 0.0
                )
            if due is not None and self.settings.retry_rate is not None:
                due = await retry_slot(self.store, task, due, self.settings.retry_rate)
            if due is not None:
                steps.append((Event.SCHEDULE_RETRY, check(to, Event.SCHEDULE_RETRY)))
                changes.update(next_retry_at=due, ready_at=due)
        minute = int(self.now() // 60)
        counters = [
            *counters,
            *((FAILURES_BY_MINUTE, f"{minute:010d}:{labels}") for name, labels in counters
              if name == "failures"),
        ]  # fmt: skip
        change = Change(
            task_id=task.id,
            expect_status=task.status,
            expect_epoch=task.epoch if (fenced or bump_epoch or leader is not None) else None,
            steps=tuple(steps),
            fields=changes,
            error=error if error is not None else retry_error,
            bump_epoch=bump_epoch,
            fenced=fenced,
            leader=leader,
            counters=tuple(counters),
        )
        updated, events = await self.store.apply(change)
        for e in events:
            log.info(
                "transition",
                extra={"task_id": e.task_id, "attempt": e.attempt, "epoch": e.epoch,
                       "from": e.from_status, "to": e.status, "event": str(e.event),
                       "duration_s": e.dwell_s},
            )  # fmt: skip
        self._written(events)
        return updated

    # submission

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
    ) -> SubmitResult:
        """Create a task, or return the one this request already made (see API.md).

        ``webhook_url`` and ``webhook_events`` ask for its status changes to be POSTed
        (see :mod:`kiln.webhooks`)."""
        task_kind = self.kind(kind)
        clean = task_kind.validate(params)
        webhook = webhooks.webhook_spec(
            webhook_url, webhook_events, allow_private=self.settings.webhook_allow_private
        )
        timeouts = timeouts or task_kind.timeouts or Timeouts()
        inputs = inputs or []
        task_kind.check_inputs(clean, inputs)
        contents = [f"{i['name']}:{i['sha256']}" for i in inputs]  # what, never a file name
        body = {
            "kind": kind,
            "params": clean,
            "priority": priority,
            "max_attempts": max_attempts,
            "deadline_s": deadline_s,
            "dedup": dedup,
            "timeouts": [timeouts.waiting_s, timeouts.generating_s, timeouts.uploading_s],
            "metadata": metadata or {},
            "inputs": contents,
        }
        if webhook is not None:  # only then: a body without one keeps its old fingerprint
            body["webhook"] = webhook
        new = NewTask(
            id=canonical.new_task_id(),
            tenant=tenant,
            kind=kind,
            params=clean,
            fingerprint=canonical.digest(body),
            idempotency_key=idempotency_key,
            dedup_key=canonical.dedup_key(kind, clean, contents) if dedup else None,
            priority=priority,
            max_attempts=max_attempts,
            deadline_s=deadline_s,
            timeouts=timeouts,
            metadata=metadata or {},
            inputs=inputs,
            webhook=webhook,
        )
        result = await self.store.submit(new)
        if result.created:
            log.info("transition", extra={"task_id": result.task.id, "event": "submit",
                                          "to": "PENDING", "attempt": 0})  # fmt: skip
            if self._hub is not None:
                self._hub.poke()
            self.wake.set()
        return result

    # reads

    async def get(self, task_id: str, tenant: str | None = None) -> Task:
        """The task, or NotFound, also when it belongs to another tenant."""
        task = await self.store.get(task_id)
        if task is None or (tenant is not None and task.tenant != tenant):
            raise NotFound(f"no task {task_id!r}")
        return task

    async def queue_position(self, task: Task) -> int | None:
        return await self.store.queue_position(task, claim_policy(self.settings))

    async def pool_wait(self, task: Task) -> PoolWait | None:
        """Where a WAITING_FOR_RESOURCE task stands in a shared pool's line, or None."""
        if task.status is not Status.WAITING_FOR_RESOURCE or not self.settings.pools:
            return None
        return await self.store.pool_wait(task.id)

    # user actions

    async def cancel(self, task_id: str, tenant: str | None = None) -> Task:
        """Cancel now when nothing runs; otherwise ask the worker (cancel_requested)."""
        for _ in range(20):
            task = await self.get(task_id, tenant)
            if task.final:
                raise AlreadyFinal(f"task {task_id} is already {task.status}")
            try:
                if task.status in RUNNING:
                    if not task.cancel_requested:
                        task = await self.store.request_cancel(task.id)
                    for listener in self.cancel_listeners:
                        listener(task.id)
                    return task
                return await self.apply(task, Event.CANCEL)
            except Conflict:
                continue
        raise Conflict(f"task {task_id} keeps changing; try again")

    async def retry(self, task_id: str, tenant: str | None = None) -> Task:
        """Manual retry of a final FAILED, TIMEOUT or CANCELLED task: due now."""
        for _ in range(20):
            task = await self.get(task_id, tenant)
            if task.status not in (Status.FAILED, Status.TIMEOUT, Status.CANCELLED):
                raise NotRetryable(f"task {task_id} is {task.status}; only final FAILED, "
                                   "TIMEOUT or CANCELLED tasks can be retried")  # fmt: skip
            now = self.now()
            fields = {
                "max_attempts": max(task.max_attempts, task.attempt) + 1,
                "finished_at": None,
                "next_retry_at": now,
                "ready_at": now,
                "cancel_requested": False,
                "cancel_requested_at": None,
                "deadline_at": max(task.deadline_at, now + task.deadline_s),
            }
            try:
                return await self.apply(task, Event.RETRY, fields=fields)
            except Conflict:
                continue
        raise Conflict(f"task {task_id} keeps changing; try again")

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
                    return await self.apply(task, Event.APPROVE, fields={"error": None})
                error = {"code": "result_lost", "message": "outputs are missing or corrupt",
                         "retryable": False}  # fmt: skip
            else:
                message = reason or "rejected by a moderator"
                error = {"code": "content_rejected", "message": message, "retryable": False}
            updated = await self.apply(
                task, Event.REJECT, error=error, fields={"error": error},
                counters=[("failures", f"{task.tenant}:{error['code']}")],
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

        For one task the stream ends after its final event; the tenant feed never ends.
        """
        async with self.hub.subscribe(task_id=task_id, tenant=tenant) as sub:
            live_only = task_id is None and after is None and not replay
            last = self.hub.last_seq if live_only else (after or 0)
            replayed, final_seen = False, False
            status_of: dict[str, Status] = {}
            # A feed of many tasks replays up to where the tail stands and takes the rest
            # live: past that point a smaller seq may still commit (PostgreSQL). One
            # task's events commit in seq order, so its replay reads to the end.
            upto = None if task_id is not None else self.hub.last_seq
            async for event in self._history(task_id, tenant, last, upto):
                last, replayed, final_seen = event.seq, True, event.final
                status_of[event.task_id] = event.status
                yield event
            if task_id is not None and await self._ended(task_id, replayed, final_seen):
                return
            while True:
                async for message in self._next(sub, task_id, tenant, last):
                    if isinstance(message, TaskEvent):
                        last = message.seq
                        status_of[message.task_id] = message.status
                    elif status_of.get(message.task_id, Status.GENERATING) != Status.GENERATING:
                        continue  # live progress overtook its GENERATING event: the next comes
                    yield message
                    if task_id is not None and message.final:
                        return
                    if len(status_of) > STATUS_MEMORY:  # a long-lived feed forgets old tasks
                        del status_of[next(iter(status_of))]

    async def _ended(self, task_id: str, replayed: bool, final_seen: bool) -> bool:
        """Whether a task stream is done after its replay: its latest event was final."""
        if replayed:
            return final_seen
        task = await self.store.get(task_id)
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
            page = await self.store.events(
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
        if self._hub is not None:
            self._hub.publish(event)

    # processes

    def worker(self, **options: Any) -> Any:
        from kiln.worker import Worker

        return Worker(self, **options)

    def supervisor(self, **options: Any) -> Any:
        from kiln.supervisor import Supervisor

        return Supervisor(self, **options)


async def call_review(check_fn: ReviewCheck, params: Any, outputs: list[Output]) -> bool:
    verdict = check_fn(params, outputs)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    return bool(verdict)


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
