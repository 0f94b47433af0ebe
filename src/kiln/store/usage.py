"""The GPU-second ledger: one row per attempt, written with the transition that ends it.

A change that ends a running attempt (it leaves WAITING_FOR_RESOURCE, GENERATING or
UPLOADING) carries a :class:`~kiln.store.effects.Ledger` effect; the store writes the
attempt's row in the same transaction, before the change's own event rows, with the one
SQL text of the ledger (``usage_row``, over ``usage_ended``; on PostgreSQL's
one-statement path, over the statement's own rows: :mod:`kiln.store.pgstep`).
The row's ``waiting_s`` and ``generating_s`` are read from the event log, so
they are exactly the ``dwell_s`` of the attempt's events that leave those statuses,
whoever ends the attempt (a worker, or the supervisor with no memory of it). Its key is
(task id, attempt, epoch): a replayed write adds nothing.

GPU-seconds are ``generating_s * share``: the GPU is held while GENERATING (a model load
included); waiting for a slot and uploading are not counted. Rows are kept past the
tasks' retention purge: they are billing data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kiln.states import Event, Status
from kiln.store.records import Applied, AttemptUsage
from kiln.store.tx import Concern, Driver, Row

#: How an attempt ended, by the event that ended it: ``uploaded`` (success,
#: needs_review), ``fail`` (retry when a retry was scheduled, else failed), ``stopped`` and
#: ``force_cancel`` (cancelled), ``release`` (released: a drain gave it back, uncounted),
#: ``expire`` (expired when its lease lapsed, timeout for a state timeout or the deadline),
#: ``recover`` (success: the supervisor found its complete outputs).
OUTCOMES = (
    "success",
    "needs_review",
    "retry",
    "failed",
    "cancelled",
    "released",
    "expired",
    "timeout",
)
#: What a report may group by, and the column (or expression) each reads.
GROUPS = {
    "tenant": "tenant",
    "kind": "kind",
    "model": "model",
    "day": "{DAY}",
    "outcome": "outcome",
    "worker": "worker",
    "pool": "pool",
}
#: A time after every attempt's end (the open end of a window).
FOREVER = 1e18
#: The most groups one report returns.
MAX_GROUPS = 10_000
_COLUMNS = (
    "task_id, attempt, epoch, tenant, kind, model, pool, worker, outcome, waiting_s, "
    "loading_s, generating_s, share, ended_at"
)


def outcome_of(event: Event, target: Status, *, retried: bool, error_code: str | None) -> str:
    """The outcome of the attempt that ``event`` (to ``target``) ends."""
    if event is Event.UPLOADED:
        return "needs_review" if target is Status.NEEDS_REVIEW else "success"
    if event is Event.RECOVER:
        return "success"
    if event is Event.FAIL:
        return "retry" if retried else "failed"
    if event is Event.RELEASE:
        return "released"
    if event is Event.EXPIRE:
        return "expired" if error_code == "lease_expired" else "timeout"
    return "cancelled"  # stopped, force_cancel


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One attempt's row of the ledger."""

    task_id: str
    attempt: int
    epoch: int
    tenant: str
    kind: str
    model: str | None
    pool: str
    worker: str | None
    outcome: str
    waiting_s: float
    loading_s: float
    generating_s: float
    share: float
    ended_at: float

    @property
    def gpu_seconds(self) -> float:
        return self.generating_s * self.share


def usage_from_row(row: Row) -> UsageRecord:
    return UsageRecord(
        task_id=row[0],
        attempt=int(row[1]),
        epoch=int(row[2]),
        tenant=row[3],
        kind=row[4],
        model=row[5],
        pool=row[6],
        worker=row[7],
        outcome=row[8],
        waiting_s=float(row[9]),
        loading_s=float(row[10]),
        generating_s=float(row[11]),
        share=float(row[12]),
        ended_at=float(row[13]),
    )


@dataclass(frozen=True, slots=True)
class UsageSum:
    """The ledger's sums over one group of attempts (``group`` holds its keys)."""

    group: dict[str, str | None]
    attempts: int
    waiting_s: float
    loading_s: float
    generating_s: float
    gpu_seconds: float

    def to_json(self) -> dict[str, object]:
        """The wire form (``GET /v1/usage``)."""
        return {
            **self.group,
            "attempts": self.attempts,
            "waiting_s": self.waiting_s,
            "loading_s": self.loading_s,
            "generating_s": self.generating_s,
            "gpu_seconds": self.gpu_seconds,
        }


def ledger_values(usage: AttemptUsage, applied: Applied) -> dict[str, Any]:
    """The row of the relation ``usage_row`` reads (``usage_ended``'s parameters) for the
    attempt that ``applied`` ends: as it ran (its attempt and epoch before the change),
    the status the change left and its dwell there."""
    task = applied.task
    return {
        "task_id": task.id,
        "attempt": applied.attempt,
        "epoch": applied.epoch,
        "tenant": task.tenant,
        "kind": task.kind,
        "model": task.model,
        "pool": usage.pool,  # None: the attempt's pool slots
        "worker": usage.worker,
        "outcome": usage.outcome,
        "source": str(applied.change.expect_status),
        "dwell_s": applied.dwell_s,
        "loading_s": usage.loading_s,
        "share": usage.share,
        "ended_at": applied.now,
    }


def report_sql(
    group_by: Sequence[str], since: float, until: float, tenant: str | None
) -> tuple[str, list[Any]]:
    """The report's query (``?`` placeholders, tokens unrendered) and its parameters."""
    unknown = [name for name in group_by if name not in GROUPS]
    if unknown:
        raise ValueError(f"cannot group usage by {unknown}")
    keys = ", ".join(GROUPS[name] for name in group_by)
    sql = (
        "SELECT " + (keys + ", " if keys else "") + "count(*), coalesce(sum(waiting_s), 0), "
        "coalesce(sum(loading_s), 0), coalesce(sum(generating_s), 0), "
        "coalesce(sum(generating_s * share), 0) FROM usage_ledger"
        " WHERE ended_at >= ? AND ended_at < ?"
    )
    args: list[Any] = [since, until]
    if tenant is not None:
        sql += " AND tenant = ?"
        args.append(tenant)
    if keys:
        sql += f" GROUP BY {keys} ORDER BY {keys}"
    sql += " LIMIT ?"
    args.append(MAX_GROUPS)
    return sql, args


class Usage(Concern[Driver]):
    """The GPU-second ledger's reads (``store.usage``; its rows are written by ``apply``,
    with the change that ends each attempt)."""

    async def of_task(self, task_id: str) -> list[UsageRecord]:
        """A task's ledger rows, one per attempt, in attempt order."""
        return await self._rows(self.q.usage_of_task, (task_id,), usage_from_row)

    async def report(
        self,
        *,
        since: float,
        until: float,
        group_by: Sequence[str] = (),
        tenant: str | None = None,
    ) -> list[UsageSum]:
        """The sums of the attempts that ended in ``[since, until)`` (of ``tenant``, or of
        every tenant), by the keys of ``group_by`` (:data:`GROUPS`); at most
        :data:`MAX_GROUPS` groups, in key order. No attempt and no keys: one empty sum."""
        names = list(dict.fromkeys(group_by))
        sql, args = report_sql(names, since, until, tenant)

        def row(found: Row) -> UsageSum:
            keys = {name: _key(value) for name, value in zip(names, found, strict=False)}
            n = len(names)
            return UsageSum(
                keys,
                int(found[n]),
                float(found[n + 1]),
                float(found[n + 2]),
                float(found[n + 3]),
                float(found[n + 4]),
            )

        return await self._rows(self.q.sql(sql), args, row)

    async def gpu_seconds(
        self, *, since: float = 0.0, until: float = FOREVER
    ) -> dict[tuple[str, str, str, str], float]:
        """GPU-seconds by (tenant, kind, model, outcome) of the attempts that ended in
        ``[since, until)`` (a model of None is ``""``): ``kiln_gpu_seconds_total``."""
        rows = await self._rows(self.q.gpu_seconds, (since, until), tuple)
        return {(str(a), str(b), str(c), str(d)): float(n) for a, b, c, d, n in rows}


def _key(value: object) -> str | None:
    return None if value is None else str(value)
