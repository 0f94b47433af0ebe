"""Claim policies: which ready tasks a worker's claim takes, beyond plain priority order.

The default order (API.md) is priority, higher first, then the time the task became
ready; each kind's queue is read from the ``tasks_claim`` index. A :class:`ClaimPolicy`
changes it three ways, all optional:

- **aging** (``aging_s``): every ``aging_s`` seconds a task waits counts as one priority
  point, so low-priority work cannot starve. The order key is then
  ``ready_at - priority * aging_s`` (earlier first): it does not move with time, so two
  tasks keep their order; the store reads each priority level's queue (an index range)
  and merges them.
- **fair** turns: tenants take turns, one task each per turn (round robin, each tenant's
  own line in the order above), so one tenant's flood does not stall the others.
- **running caps**: a tenant's tasks that are claimed and not yet done (WAITING_FOR_RESOURCE,
  GENERATING, UPLOADING) stay under its cap across every worker; a capped tenant's tasks
  stay PENDING and others are claimed instead.

With fair turns or caps the store reads each tenant's line from ``tasks_claim_tenant``
(at most ``MAX_TENANTS`` tenants a claim, in turns, so the cost is bounded however many
tenants there are); tenants with ready work come from the per-status counts.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kiln import counters as names
from kiln import logs
from kiln.models import SubmitResult, Task
from kiln.states import CLAIMABLE, Event, Status
from kiln.store.positions import Places
from kiln.store.rows import task_from_row
from kiln.store.tx import EventRow, Ops, Refused, Tx

if TYPE_CHECKING:
    from kiln.config import Settings

T = TypeVar("T")
log = logging.getLogger("kiln.store")

#: Tenants whose lines one claim reads at most (the next claim goes on from there).
MAX_TENANTS = 32


@dataclass(frozen=True, slots=True)
class ClaimPolicy:
    #: Seconds of waiting worth one priority point (None: strict priority).
    aging_s: float | None = None
    #: Tenants take turns instead of one global order.
    fair: bool = False
    #: Claimed-and-unfinished tasks a tenant may have at once (None: no cap), and
    #: per-tenant caps over that default.
    running_cap: int | None = None
    running_caps: Mapping[str, int] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """The default order: one indexed query per kind does it."""
        return self.aging_s is None and not self.by_tenant

    @property
    def by_tenant(self) -> bool:
        """Lines are read per tenant (fair turns or caps)."""
        return self.fair or self.running_cap is not None or bool(self.running_caps)

    def cap(self, tenant: str) -> int | None:
        return self.running_caps.get(tenant, self.running_cap)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A ready task a claim may take: what choosing and claiming it needs."""

    id: str
    priority: int
    ready_at: float
    status: str
    status_since: float
    version: int
    tenant: str
    model: str | None = None


def candidates(rows: Iterable[Sequence[Any]]) -> list[Candidate]:
    return [
        Candidate(r[0], int(r[1]), float(r[2]), r[3], float(r[4]), int(r[5]), r[6], r[7])
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class Route:
    """Warm-model routing of one worker's claim (docs/scheduling.md).

    A task whose model the worker holds loaded (``held``) is ordered as if it had become
    ready ``wait_s`` sooner: among tasks of a priority it goes ahead of those that became
    ready less than ``wait_s`` before it, never of older ones, so a task is passed only by
    warm tasks that came within ``wait_s`` after it and nothing starves; the order does not
    move with time, so a backlog keeps its warm preference however old it is. A task whose
    model another idle worker holds (``reserved``) is left to that worker until it has
    waited ``wait_s``; then any worker may take it.
    """

    held: frozenset[str] = frozenset()
    reserved: frozenset[str] = frozenset()
    wait_s: float = 0.0

    @property
    def active(self) -> bool:
        return self.wait_s > 0 and bool(self.held or self.reserved)

    def allows(self, cand: Candidate, now: float) -> bool:
        """Whether this worker may take ``cand`` now."""
        model = cand.model
        return (
            model is None
            or model in self.held
            or model not in self.reserved
            or cand.ready_at <= now - self.wait_s
        )

    def head_start(self, cand: Candidate) -> float:
        """Seconds a task goes ahead of its place: ``wait_s`` for a model held, else 0."""
        return self.wait_s if cand.model is not None and cand.model in self.held else 0.0


def order_key(policy: ClaimPolicy, route: Route | None = None) -> Any:
    ahead = route.head_start if route is not None and route.active else (lambda c: 0.0)
    if policy.aging_s is None:
        return lambda c: (-c.priority, c.ready_at - ahead(c), c.id)
    aging_s = policy.aging_s
    return lambda c: (c.ready_at - c.priority * aging_s - ahead(c), c.ready_at, c.id)


def turn(tenants: Sequence[str], offset: int) -> list[str]:
    """At most MAX_TENANTS tenants, starting at ``offset`` (the claim's turn): successive
    claims start with the next tenant, so even one-task claims go round the tenants."""
    if not tenants:
        return []
    start = offset % len(tenants)
    rotated = [*tenants[start:], *tenants[:start]]
    return rotated[:MAX_TENANTS]


class _Room:
    """How many more tasks each tenant may have claimed (None: no cap), as a claim fills."""

    def __init__(self, room: Mapping[str, int | None]) -> None:
        self.left = dict(room)

    def take(self, tenant: str) -> bool:
        spare = self.left.get(tenant)
        if spare is None:
            return True
        if spare <= 0:
            return False
        self.left[tenant] = spare - 1
        return True


def choose(
    found: Iterable[Candidate],
    limit: int,
    policy: ClaimPolicy,
    room: Mapping[str, int | None],
    tenants: Sequence[str] = (),
    route: Route | None = None,
    now: float = 0.0,
) -> list[Candidate]:
    """The candidates a claim takes, in claim order: ``room`` is how many more tasks each
    tenant may have claimed (None: no cap); with fair turns, ``tenants`` is this claim's
    turn order (see :func:`turn`); ``route`` leaves and orders tasks by their model."""
    key = order_key(policy, route)
    unique: Iterable[Candidate] = {c.id: c for c in found}.values()
    if route is not None and route.active:
        unique = [c for c in unique if route.allows(c, now)]
    ordered = sorted(unique, key=key)
    left = _Room(room)
    if not policy.fair:
        return [c for c in ordered if left.take(c.tenant)][:limit]
    lines: dict[str, list[Candidate]] = {t: [] for t in tenants}
    for cand in ordered:  # each tenant's line in order
        lines.setdefault(cand.tenant, []).append(cand)
    chosen: list[Candidate] = []
    for depth in range(limit):  # turn by turn: each tenant's next task
        took = [line[depth] for line in lines.values() if depth < len(line)]
        took = [c for c in took if left.take(c.tenant)]
        if not took:
            break
        chosen += took
    return chosen[:limit]


def room(
    policy: ClaimPolicy, tenants: Iterable[str], running: Mapping[str, int]
) -> dict[str, int | None]:
    """How many more tasks each tenant may have claimed now."""
    found: dict[str, int | None] = {}
    for tenant in tenants:
        cap = policy.cap(tenant)
        found[tenant] = None if cap is None else max(cap - int(running.get(tenant, 0)), 0)
    return found


def fair_position(own: int, others: Iterable[int]) -> int:
    """A task's estimated place under fair turns: ``own`` is its place in its tenant's
    line; each other tenant's line gets up to ``own - 1`` turns before it."""
    return own + sum(min(n, own - 1) for n in others)


def claim_policy(settings: Settings) -> ClaimPolicy | None:
    """The claim order the settings ask for; None for the default (priority, ready time)."""
    policy = ClaimPolicy(
        aging_s=settings.priority_aging_s,
        fair=settings.claim_order == "fair",
        running_cap=settings.tenant_running,
        running_caps={
            t: lim.running for t, lim in settings.tenant_limits.items() if lim.running is not None
        },
    )
    return None if policy.plain else policy


@dataclass(frozen=True, slots=True)
class Lease:
    """Who claims, for how long, and the kinds whose tasks it acquires at once."""

    worker_id: str
    ttl_s: float
    acquire: list[str]
    route: Route | None = None


#: The PostgreSQL advisory lock namespace of capped tenants' claims ("kcap").
ADVISORY_CAPS = 0x6B636170


class ClaimOps(Ops):
    """Claims and queue positions, for :class:`kiln.store.sqlstore.Store`."""

    _claim_turn: int

    async def claim(
        self,
        *,
        worker_id: str,
        kinds: list[str],
        limit: int,
        lease_ttl_s: float,
        policy: ClaimPolicy | None = None,
        acquire: Sequence[str] = (),
        route: Route | None = None,
    ) -> list[Task]:
        """Claim up to ``limit`` ready tasks of ``kinds``: in priority, then ready-time
        order, or as ``policy`` says (aging, fair turns, running caps: store/claims.py).
        A task of a kind in ``acquire`` (one that waits for no resource) is acquired in
        the same write: it comes back GENERATING, with both events and a wait of zero.
        ``route`` prefers the tasks whose model the worker holds (:class:`Route`)."""

        if not kinds or limit <= 0:
            return []
        self._claim_turn += 1
        turn_no = self._claim_turn
        route = route if route is not None and route.active else None
        lease = Lease(worker_id, lease_ttl_s, [k for k in acquire if k in kinds], route)
        if route is None and (policy is None or policy.plain):
            done = await self._claim_in_order(lease, kinds, limit)
            if done is not None:
                return done
        claimed, events = await self._write(
            lambda tx: self._claim(tx, lease, kinds, limit, policy, turn_no)
        )
        for row in events:  # once committed, in claim order
            log_claim(row.task, row.source, row.target, row.dwell_s, worker_id)
        return claimed

    async def _claim(
        self,
        tx: Tx,
        lease: Lease,
        kinds: list[str],
        limit: int,
        policy: ClaimPolicy | None,
        turn_no: int,
    ) -> tuple[list[Task], list[EventRow]]:
        now = self.clock()
        route = lease.route
        if route is not None and (policy is None or policy.plain):
            chosen = await self._routed_candidates(tx, kinds, limit, route, now)
        elif policy is None or policy.plain:
            found: list[Candidate] = []
            for kind in kinds:  # locked on PostgreSQL (SKIP LOCKED)
                found += candidates(await tx.all(self.q.claim_candidates, (kind, now, now, limit)))
            chosen = sorted(found, key=lambda c: (-c.priority, c.ready_at, c.id))[:limit]
        else:
            chosen = await self._policy_candidates(tx, kinds, limit, policy, now, turn_no, route)
        return await self._take(tx, lease, chosen, now)

    async def _claim_in_order(
        self, lease: Lease, kinds: list[str], limit: int
    ) -> list[Task] | None:
        """A driver's own way to claim in the default order (PostgreSQL: one statement),
        or None: the row path below."""
        return None

    async def claim_batch(
        self, *, worker_id: str, kind: str, batch_key: str, limit: int, lease_ttl_s: float
    ) -> list[Task]:
        """Claim up to ``limit`` ready tasks of ``kind`` that join the batch ``batch_key``
        (durable dynamic batching), in priority, then ready-time order. They come back
        WAITING_FOR_RESOURCE: the batch takes its resources once, for all its members."""
        if limit <= 0:
            return []
        lease = Lease(worker_id, lease_ttl_s, [])

        async def claim(tx: Tx) -> tuple[list[Task], list[EventRow]]:
            now = self.clock()
            args = (kind, batch_key, now, now, limit)
            chosen = candidates(await tx.all(self.q.claim_batch, args))
            return await self._take(tx, lease, chosen, now)

        claimed, events = await self._write(claim)
        for row in events:  # once committed, in claim order
            log_claim(row.task, row.source, row.target, row.dwell_s, worker_id)
        return claimed

    async def _take(
        self, tx: Tx, lease: Lease, chosen: list[Candidate], now: float
    ) -> tuple[list[Task], list[EventRow]]:
        """Claim the ``chosen`` candidates (locked, in claim order) under ``lease``."""
        if not chosen:
            return [], []
        acq = lease.acquire
        held = (lease.worker_id, now + lease.ttl_s)  # lease_owner, lease_expires_at
        args = (acq, acq, *held, now, acq, now, now, now, [c.id for c in chosen])
        by_id = {row[0]: task_from_row(row) for row in await tx.all(self.q.claim_tasks, args)}
        claimed: list[Task] = []
        events: list[EventRow] = []
        waiting = Status.WAITING_FOR_RESOURCE
        generating = Status.GENERATING
        for cand in chosen:  # in claim order
            task = by_id.get(cand.id)
            if task is None:
                continue
            source, dwell = Status(cand.status), now - cand.status_since
            acquired = task.status is generating
            version = task.version - 1 if acquired else task.version
            events.append(EventRow(task, version, Event.CLAIM, source, waiting, None, now, dwell))
            tx.count_status(task.tenant, source, -1)
            tx.count_status(task.tenant, task.status, 1)
            tx.bump(names.TRANSITIONS, f"{source}>{waiting}")
            if acquired:
                events.append(
                    EventRow(task, task.version, Event.ACQUIRE, waiting, generating, None, now, 0.0)
                )
                tx.bump(names.TRANSITIONS, f"{waiting}>{generating}")
            claimed.append(task)
        await tx.insert_events(events)
        return claimed, events

    async def _routed_candidates(
        self, tx: Tx, kinds: list[str], limit: int, route: Route, now: float
    ) -> list[Candidate]:
        """What a routed claim takes in the default order, locked: the first ready tasks
        of each model the worker holds (one index range each) and the first it may take
        of each kind, ordered with the warm ones' head start (:class:`Route`). Any task
        of the claim's first ``limit`` is in one of those reads: within a model the head
        start is the same for all, and a cold task has ahead of it every task ahead of it
        in plain order."""
        reserved, ready_by = sorted(route.reserved - route.held), now - route.wait_s
        found: list[Candidate] = []
        for kind in kinds:  # locked on PostgreSQL (SKIP LOCKED)
            for model in sorted(route.held):
                found += candidates(await tx.all(self.q.claim_warm, (kind, model, now, now, limit)))
            args = (kind, now, now, reserved, ready_by, limit)
            found += candidates(await tx.all(self.q.claim_routed, args))
        unique = {c.id: c for c in found}.values()
        return sorted(unique, key=order_key(ClaimPolicy(), route))[:limit]

    async def _policy_candidates(
        self,
        tx: Tx,
        kinds: list[str],
        limit: int,
        policy: ClaimPolicy,
        now: float,
        turn_no: int,
        route: Route | None = None,
    ) -> list[Candidate]:
        """What a claim under ``policy`` takes, in claim order, locked: rows are read
        unlocked, chosen, then locked (SKIP LOCKED: another claim's pick is left to it).
        A capped tenant is claimed for by one claim at a time (a lock on PostgreSQL; the
        SQLite writer is serial), so its cap holds across workers."""
        rooms: dict[str, int | None] = {}
        tenants: list[str] = []
        lines: list[str | None] = [None]
        if policy.by_tenant:
            tenants = turn([r[0] for r in await tx.all(self.q.ready_tenants)], turn_no)
            capped = [t for t in tenants if policy.cap(t) is not None]
            rooms = room(policy, tenants, await self._running(tx, capped))
            lines = [t for t in tenants if rooms[t] != 0]
        found: list[Candidate] = []
        for kind in kinds:
            for tenant in lines:
                spare = rooms.get(tenant) if tenant is not None else None
                take = limit if spare is None else min(limit, spare)
                found += await self._line(tx, kind, tenant, policy.aging_s, now, take)
            for model in sorted(route.held) if route is not None else ():
                args = (kind, model, now, now, limit)
                found += candidates(await tx.all(self.q.heads_of_model, args))
        picked = choose(found, limit, policy, rooms, tenants, route, now)
        locking = sorted({c.tenant for c in picked if policy.cap(c.tenant) is not None})
        if locking:
            waited = [t for t in locking if await tx.lock_tenant(t)]  # in name order
            rooms.update(room(policy, locking, await self._running(tx, locking)))
            for tenant in waited:  # another claim ran meanwhile: read its line again
                found = [c for c in found if c.tenant != tenant]
                for kind in kinds:
                    take = min(limit, rooms[tenant] or 0)
                    found += await self._line(tx, kind, tenant, policy.aging_s, now, take)
            picked = choose(found if waited else picked, limit, policy, rooms, tenants, route, now)
        if not picked:
            return []
        rows = await tx.all(self.q.lock_candidates, ([c.id for c in picked], now, now))
        locked = {row[0] for row in rows}
        return [c for c in picked if c.id in locked]

    async def _line(
        self, tx: Tx, kind: str, tenant: str | None, aging_s: float | None, now: float, take: int
    ) -> list[Candidate]:
        """The first ``take`` ready tasks of a kind's line (of one tenant, or all): one
        index range, or one per priority level under aging."""
        q = self.q
        key: tuple[str, ...] = (kind,) if tenant is None else (kind, tenant)
        if aging_s is None:
            sql = q.heads if tenant is None else q.heads_of_tenant
            return candidates(await tx.all(sql, (*key, now, now, take)))
        levels = await tx.all(q.levels if tenant is None else q.levels_of_tenant, (*key, *key))
        sql = q.heads_of_level if tenant is None else q.heads_of_tenant_level
        found: list[Candidate] = []
        for (level,) in levels:
            found += candidates(await tx.all(sql, (*key, level, now, now, take)))
        return found

    async def _running(self, tx: Tx, tenants: Sequence[str]) -> dict[str, int]:
        if not tenants:
            return {}
        return {r[0]: int(r[1]) for r in await tx.all(self.q.running_of_tenants, (list(tenants),))}

    async def queue_position(self, task: Task, policy: ClaimPolicy | None = None) -> int | None:
        """1 for the next task a claim of its kind takes (under ``policy``: with fair
        turns, an estimate from the task's place in its tenant's line), while it is ready."""

        now = self.clock()
        if not queued_and_due(task, now):
            return None
        return await self._read(lambda tx: self._position(tx, task, policy, now))

    async def read_standing(
        self, task_id: str, policy: ClaimPolicy | None = None
    ) -> tuple[Task | None, int | None]:
        """The task and its :meth:`queue_position`, in one read (a GET's one round trip)."""

        return await self._read(lambda tx: self._standing(tx, self.q.get_task, (task_id,), policy))

    async def read_dedup(
        self, tenant: str, dedup_key: str, policy: ClaimPolicy | None = None
    ) -> tuple[Task | None, int | None]:
        """The live or successful task holding a dedup key, and its :meth:`queue_position`,
        in one read: what a submission of that content is answered with (no write)."""
        args = (tenant, dedup_key)
        return await self._read(lambda tx: self._standing(tx, self.q.dedup_lookup, args, policy))

    async def _standing(
        self, tx: Tx, sql: str, args: tuple[str, ...], policy: ClaimPolicy | None
    ) -> tuple[Task | None, int | None]:
        row = await tx.one(sql, args)
        if row is None:
            return None, None
        task, now = task_from_row(row), self.clock()
        if not queued_and_due(task, now):
            return task, None
        return task, await self._position(tx, task, policy, now)

    async def queue_positions(
        self, tasks: Sequence[Task], policy: ClaimPolicy | None = None
    ) -> dict[str, int]:
        """The queue positions of many tasks (a listing's page) by id, as
        :meth:`queue_position` gives each; a task with none is left out. In the default
        order, per kind and priority level of those tasks, one count of the line ahead of
        the level's first one and one pass over the level from it to its last; under aging
        or fair turns, task by task."""
        now = self.clock()
        ready = [t for t in tasks if queued_and_due(t, now)]
        if not ready:
            return {}
        if policy is not None and (policy.fair or policy.aging_s is not None):
            return await self._read(
                lambda tx: _each(ready, lambda t: self._position(tx, t, policy, now))
            )
        return await self._read(lambda tx: self._places(tx, ready, now))

    async def _places(self, tx: Tx, ready: Sequence[Task], now: float) -> dict[str, int]:
        levels: dict[tuple[str, int], list[Task]] = {}
        for task in ready:
            levels.setdefault((task.kind, task.priority), []).append(task)
        found: dict[str, int] = {}
        places = Places(tx, self.q, now)
        for (kind, priority), level in levels.items():
            level.sort(key=lambda t: (t.ready_at, t.id))
            first, last = level[0], level[-1]
            ahead = await places.ahead(first, None, None)
            args = (kind, priority, first.ready_at, first.id, last.ready_at, last.id, now, now)
            rows = await tx.all(self.q.queue_places_of_level, (*args, [t.id for t in level]))
            found.update({str(row[0]): ahead + int(row[1]) for row in rows})
        return found

    async def _placed(
        self, tx: Tx, submitted: Awaitable[SubmitResult | Refused], policy: ClaimPolicy | None
    ) -> SubmitResult | Refused:
        """A submit's answer (``submitted``, run in ``tx``) with its task's
        :meth:`queue_position` read in the submit's own transaction (no read after it)."""
        result = await submitted
        if isinstance(result, Refused):
            return result
        task, now = result.task, self.clock()
        position = None
        if queued_and_due(task, now):
            position = await self._position(tx, task, policy, now)
        return replace(result, queue_position=position, placed=True)

    async def _position(self, tx: Tx, task: Task, policy: ClaimPolicy | None, now: float) -> int:
        """From the kept counts (:mod:`kiln.store.positions`): flat in the line's length."""
        places = Places(tx, self.q, now)
        aging_s = None if policy is None else policy.aging_s
        if policy is None or not policy.fair:
            return await places.ahead(task, None, aging_s) + 1
        own = await places.ahead(task, task.tenant, aging_s) + 1
        others = [r[0] for r in await tx.all(self.q.ready_tenants) if r[0] != task.tenant]
        depths = [await places.depth(task.kind, other) for other in others]
        return fair_position(own, depths)


def queued_and_due(task: Task, now: float) -> bool:
    return task.status in CLAIMABLE and task.ready_at <= now < task.deadline_at


async def _each(
    tasks: Sequence[Task], position: Callable[[Task], Awaitable[int]]
) -> dict[str, int]:
    return {task.id: await position(task) for task in tasks}


def log_claim(
    task: Task, source: Status | None, target: Status, dwell_s: float | None, worker_id: str
) -> None:
    """The transition line of a claim (``claim``, or the ``acquire`` that came with it)."""
    if log.isEnabledFor(logging.INFO):
        logs.line(
            log,
            "transition",
            {
                "task_id": task.id,
                "attempt": task.attempt,
                "epoch": task.epoch,
                "from": str(source),
                "to": str(target),
                "event": "claim" if target is Status.WAITING_FOR_RESOURCE else "acquire",
                "duration_s": dwell_s,
                "worker": worker_id,
            },
        )
