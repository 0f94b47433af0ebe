"""Bulk cancel and bulk retry: the single actions' rules, applied to the tasks a filter
names, a page at a time.

A page is one transaction (:mod:`kiln.store.bulk`): up to ``limit`` tasks selected by
keyset on the (time-ordered) task id, each changed by the very compare-and-set (with its
event row) that ``POST /v1/tasks/{id}/cancel`` or ``/retry`` makes, and no further task
once the transaction changed ``KILN_BULK_PAGE_ROWS`` rows (a page of pipelines holds a few:
each moves its steps with it). The answer's ``cursor`` resumes after the page's last task;
an action interrupted and resumed, or run again from the start, never acts twice on a task:
a retried task is no longer FAILED, a cancelled one no longer live, a running one already
asked to stop is left out, and a task that changed since it was selected is refused by its
compare-and-set and counted as skipped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.engine import Engine, rerun_fields
from kiln.errors import InvalidCursor, InvalidRequest
from kiln.models import JSON, Task
from kiln.pipelines import KIND as PIPELINE
from kiln.states import ACTIVE, ENDED_UNSUCCESSFULLY, RUNNING, Event, IllegalTransition, Status
from kiln.store.bulk import (
    ASK_TO_STOP,
    CANCEL_PIPELINE,
    RETRY_PIPELINE,
    BulkFilter,
    Plan,
    StepRetry,
)
from kiln.timing import parse_moment

#: The statuses each action applies to, as the single action's rules say.
STATUSES: dict[str, frozenset[Status]] = {
    "cancel": ACTIVE,
    "retry": ENDED_UNSUCCESSFULLY,
}
#: The count of changed tasks in the answer, by action.
DONE_FIELD = {"cancel": "cancelled", "retry": "retried"}
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
#: A relative time: this long before now (``90s``, ``15m``, ``1h``, ``2d``, ``1w``).
_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
#: A cursor: the id of the page's last task (kiln.canonical.new_task_id).
CURSOR_TEXT = r"tsk_[0-9a-hjkmnp-tv-z]{26}"
_CURSOR = re.compile(CURSOR_TEXT)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def _detail(field: str, message: str) -> list[JSON]:
    return [{"loc": ["body", "filter", field], "msg": message, "type": "value_error"}]


def moment_of(field: str, value: float | int | str, now: float) -> float:
    """Unix seconds from a number, an RFC 3339 time with its offset, or a duration before
    ``now`` (``1h``, ``30m``, ``2d``); InvalidRequest for anything else."""
    if isinstance(value, str):
        ago = _AGO.match(value)
        if ago is not None:
            return now - float(ago.group(1)) * _UNIT_S[ago.group(2)]
        try:
            return parse_moment(value, field)
        except InvalidRequest as exc:
            raise InvalidRequest(
                f"filter.{field} must be unix seconds, an RFC 3339 time (2026-01-01T09:00:00Z)"
                " or a duration before now (90s, 15m, 1h, 2d, 1w)",
                details=_detail(field, exc.message),
            ) from None
    if isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(f"filter.{field} must be finite", details=_detail(field, "finite"))
    return float(value)


@dataclass(frozen=True, slots=True)
class FilterIn:
    """A filter as a request gives it (before the caller's tenant and the action apply)."""

    status: Sequence[str] = ()
    kind: Sequence[str] = ()
    code: Sequence[str] = ()
    tenant: str | None = None
    created_after: float | int | str | None = None
    created_before: float | int | str | None = None


def narrows(raw: FilterIn, after: float | None, before: float | None, now: float) -> bool:
    """Whether the filter can leave a task out (else it must be asked for with ``all``): it
    names a status, kind or code, or a time that some task can fall outside of. A
    ``created_after`` at or before the epoch (0, a negative number, 1970-01-01T00:00:00Z)
    leaves nothing out, nor does a ``created_before`` later than now; the tenant never
    counts (it only says whose tasks)."""
    if raw.status or raw.kind or raw.code:
        return True
    return (after is not None and after > 0) or (before is not None and before <= now)


def statuses_of(action: str, names: Sequence[str]) -> tuple[Status, ...]:
    """The statuses a filter names, each one the action applies to; all of those when it
    names none."""
    allowed = STATUSES[action]
    if not names:
        return tuple(s for s in Status if s in allowed)
    found: list[Status] = []
    for name in names:
        status = Status.__members__.get(name)
        if status is None or status not in allowed:
            can = ", ".join(s for s in Status if s in allowed)
            raise InvalidRequest(
                f"{action} applies to tasks in {can}; not {name!r}",
                details=_detail("status", f"not one of {can}"),
            )
        found.append(status)
    return tuple(dict.fromkeys(found))


def filter_of(
    action: str, raw: FilterIn, *, scope: str | None, everything: bool, now: float
) -> BulkFilter:
    """The store's filter for ``action`` by a caller who sees ``scope`` (None: every
    tenant, the admin). Refused: an empty filter without ``all``, a status the action does
    not apply to, a bad time. A tenant the caller may not name is the API's to refuse."""
    after, before = (
        None if value is None else moment_of(field, value, now)
        for field, value in (
            ("created_after", raw.created_after),
            ("created_before", raw.created_before),
        )
    )
    if not everything and not narrows(raw, after, before, now):
        raise InvalidRequest(
            "the filter names no status, kind, code or time that leaves any task out: every "
            'task would match; send "all": true to mean that',
            details=[{"loc": ["body", "filter"], "msg": "empty filter", "type": "value_error"}],
        )
    return BulkFilter(
        statuses=statuses_of(action, raw.status),
        kinds=tuple(dict.fromkeys(raw.kind)),
        codes=tuple(dict.fromkeys(raw.code)),
        tenant=scope if scope is not None else raw.tenant,
        created_after=after,
        created_before=before,
        not_cancel_requested=action == "cancel",
    )


def check_cursor(cursor: str | None) -> None:
    """Refuse (InvalidCursor) text that is not a task id, as no page could give it."""
    if cursor is not None and _CURSOR.fullmatch(cursor) is None:
        raise InvalidCursor(
            "the cursor is not one a page gave: pass the previous answer's cursor as is",
            details=[{"loc": ["body", "cursor"], "msg": "malformed cursor", "type": "cursor"}],
        )


def planner(engine: Engine, action: str) -> Callable[[Task], Plan]:
    """What a page does to each task it selected: the single action's change."""

    def plan(task: Task) -> Plan:
        if task.kind == PIPELINE:  # as App.cancel and App.retry treat one: with its steps
            return CANCEL_PIPELINE if action == "cancel" else RETRY_PIPELINE
        try:
            if action == "cancel":
                if task.status in RUNNING:
                    return None if task.cancel_requested else ASK_TO_STOP
                return engine.user_change(task, Event.CANCEL)
            change = engine.user_change(task, Event.RETRY, rerun_fields(task, engine.now()))
            return change if task.pipeline_id is None else StepRetry(change)
        except IllegalTransition:
            return None

    return plan


async def bulk_action(
    engine: Engine,
    action: str,
    found: BulkFilter,
    *,
    dry_run: bool,
    limit: int = DEFAULT_LIMIT,
    cursor: str | None = None,
) -> JSON:
    """One page of ``action`` (``cancel`` or ``retry``) on the tasks ``found`` names after
    ``cursor``; with ``dry_run``, only how many it would act on from there (nothing
    changes, no cursor)."""
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(
            f"limit must be 1..{MAX_LIMIT}",
            details=[{"loc": ["body", "limit"], "msg": f"1..{MAX_LIMIT}", "type": "value_error"}],
        )
    check_cursor(cursor)
    done = DONE_FIELD[action]
    answer: JSON = {"action": action, "dry_run": dry_run}
    if dry_run:
        matched = await engine.store.bulk.count(found, cursor)
        answer.update(matched=matched, skipped=0, cursor=None, **{done: 0})
        if action == "cancel":
            answer["cancel_requested"] = 0
        return answer
    page = await engine.act_page(found, cursor, limit, planner(engine, action))
    answer.update(matched=page.matched, skipped=page.skipped, cursor=page.last)
    answer[done] = len(page.changed)
    if action == "cancel":
        answer["cancel_requested"] = len(page.asked)
    answer["task_ids"] = [t.id for t in (*page.changed, *page.asked)]
    return answer
