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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.config import Settings

CLAIMABLE_SQL = "('PENDING', 'RETRYING')"
RUNNING_SQL = "('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING')"
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


#: Columns of a candidate row, in :class:`Candidate` order.
CANDIDATE_COLUMNS = "id, priority, ready_at, status, status_since, version, tenant"


def candidates(rows: Iterable[Sequence[Any]]) -> list[Candidate]:
    return [Candidate(r[0], int(r[1]), float(r[2]), r[3], float(r[4]), int(r[5]), r[6])
            for r in rows]  # fmt: skip


def levels_sql(ph: str, *, tenant: bool) -> str:
    """The distinct priorities of a kind's (or a kind and tenant's) claimable tasks, highest
    first, each found by one index probe: (kind, [tenant,] kind, [tenant])."""
    where = f"kind = {ph}" + (f" AND tenant = {ph}" if tenant else "")
    where += f" AND status IN {CLAIMABLE_SQL}"
    return (
        "WITH RECURSIVE levels(p) AS ("
        f" SELECT (SELECT priority FROM tasks WHERE {where} ORDER BY priority DESC LIMIT 1)"
        " UNION ALL"
        f" SELECT (SELECT priority FROM tasks WHERE {where} AND priority < levels.p"
        " ORDER BY priority DESC LIMIT 1) FROM levels WHERE levels.p IS NOT NULL"
        ") SELECT p FROM levels WHERE p IS NOT NULL"
    )


def heads_sql(ph: str, *, tenant: bool, level: bool) -> str:
    """The first ready tasks of a line: (kind, [tenant,] [priority,] now, now, limit)."""
    where = f"kind = {ph}" + (f" AND tenant = {ph}" if tenant else "")
    where += f" AND status IN {CLAIMABLE_SQL}"
    order = "ready_at, id"
    if level:
        where += f" AND priority = {ph}"
    else:
        order = "priority DESC, ready_at, id"
    return (
        f"SELECT {CANDIDATE_COLUMNS} FROM tasks WHERE {where}"
        f" AND ready_at <= {ph} AND deadline_at > {ph} ORDER BY {order} LIMIT {ph}"
    )


#: Tenants with claimable tasks (from the per-status counts; no task row is read).
READY_TENANTS_SQL = (
    f"SELECT tenant FROM task_counts WHERE status IN {CLAIMABLE_SQL}"
    " GROUP BY tenant HAVING sum(n) > 0 ORDER BY tenant"
)


def running_sql(ph: str, count: int) -> str:
    """Claimed-and-unfinished tasks of some (capped) tenants, counted from the tasks
    themselves so a claim sees its own transaction's earlier claims: (tenant, ...). The
    cost follows the caps: at most a cap's worth of rows per tenant."""
    marks = ", ".join([ph] * count)
    return (
        f"SELECT tenant, COUNT(*) FROM tasks WHERE tenant IN ({marks})"
        f" AND status IN {RUNNING_SQL} GROUP BY tenant"
    )


def order_key(policy: ClaimPolicy) -> Any:
    if policy.aging_s is None:
        return lambda c: (-c.priority, c.ready_at, c.id)
    aging_s = policy.aging_s
    return lambda c: (c.ready_at - c.priority * aging_s, c.ready_at, c.id)


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
) -> list[Candidate]:
    """The candidates a claim takes, in claim order: ``room`` is how many more tasks each
    tenant may have claimed (None: no cap); with fair turns, ``tenants`` is this claim's
    turn order (see :func:`turn`)."""
    key = order_key(policy)
    ordered = sorted({c.id: c for c in found}.values(), key=key)
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


def ahead_sql(ph: str, *, tenant: bool, level: bool) -> str:
    """Ready tasks of a line claimed before a given one.

    By level (aging): (kind, [tenant,] priority, now, now, bound, bound, id): those of one
    priority level that became ready before ``bound``, the ready time at which that level
    ties with the task. Else (kind, [tenant,] now, now, priority, priority, ready_at,
    ready_at, id): the plain order.
    """
    where = f"kind = {ph}" + (f" AND tenant = {ph}" if tenant else "")
    where += f" AND status IN {CLAIMABLE_SQL}"
    if level:
        return (
            f"SELECT COUNT(*) FROM tasks WHERE {where} AND priority = {ph}"
            f" AND ready_at <= {ph} AND deadline_at > {ph}"
            f" AND (ready_at < {ph} OR (ready_at = {ph} AND id < {ph}))"
        )
    return (
        f"SELECT COUNT(*) FROM tasks WHERE {where} AND ready_at <= {ph} AND deadline_at > {ph}"
        f" AND (priority > {ph} OR (priority = {ph} AND (ready_at < {ph}"
        f" OR (ready_at = {ph} AND id < {ph}))))"
    )


def tenant_depth_sql(ph: str) -> str:
    """How many ready tasks a tenant's line holds, counted up to a bound:
    (kind, tenant, now, now, bound)."""
    return (
        "SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE kind = "
        f"{ph} AND tenant = {ph} AND status IN {CLAIMABLE_SQL} AND ready_at <= {ph}"
        f" AND deadline_at > {ph} LIMIT {ph}) AS line"
    )


def ahead_args(
    kind: str, tenant: str | None, level: int | None, task: Any, now: float, aging_s: float | None
) -> tuple[Any, ...]:
    """Parameters of :func:`ahead_sql` for ``task`` (id, priority, ready_at)."""
    key: tuple[Any, ...] = (kind,) if tenant is None else (kind, tenant)
    if level is None:
        return (*key, now, now, task.priority, task.priority, task.ready_at, task.ready_at,
                task.id)  # fmt: skip
    assert aging_s is not None
    bound = task.ready_at + (level - task.priority) * aging_s
    return (*key, level, now, now, bound, bound, task.id)


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
        running_caps={t: lim.running for t, lim in settings.tenant_limits.items()
                      if lim.running is not None},
    )  # fmt: skip
    return None if policy.plain else policy
