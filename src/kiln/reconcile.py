"""Reconciler: compare storage with the store, report, and repair only when asked.

Two kinds of problem: a SUCCESS task whose output is missing or no longer matches its
recorded size and sha256 (``missing``, ``corrupt``), and an object under ``tasks/`` that
no SUCCESS task refers to (``orphan``: a stale attempt's upload, or a task that is gone).
Objects of tasks still in flight or in review are in use, never orphans. Repair deletes
orphans older than a grace period and touches nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kiln.models import StoredOutput, Task
from kiln.states import FINAL, Status
from kiln.storage import MANIFEST, ObjectInfo, Storage, verify
from kiln.store import Store

log = logging.getLogger("kiln.reconcile")

TASKS_PREFIX = "tasks/"
DEFAULT_GRACE_S = 3600.0


@dataclass(frozen=True, slots=True)
class Missing:
    """A SUCCESS task's output that is not in storage as recorded."""

    task_id: str
    key: str
    problem: str  # "missing" or "corrupt"


@dataclass(frozen=True, slots=True)
class Orphan:
    """An object no SUCCESS task refers to."""

    key: str
    size: int
    task_id: str | None
    task_status: str | None
    age_s: float | None


@dataclass(slots=True)
class Report:
    tasks_checked: int = 0
    outputs_checked: int = 0
    objects_checked: int = 0
    missing: list[Missing] = field(default_factory=list)
    orphans: list[Orphan] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    repair: bool = False
    grace_s: float = DEFAULT_GRACE_S

    @property
    def clean(self) -> bool:
        """Nothing wrong was found."""
        return not self.missing and not self.orphans

    @property
    def resolved(self) -> bool:
        """Nothing wrong is left: clean, or every problem found was repaired."""
        return not self.missing and len(self.deleted) == len(self.orphans)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body.update(clean=self.clean, resolved=self.resolved)
        return body


async def reconcile(
    store: Store,
    storage: Storage,
    *,
    repair: bool = False,
    grace_s: float = DEFAULT_GRACE_S,
    page_size: int = 500,
    clock: Callable[[], float] = time.time,
) -> Report:
    """Check every SUCCESS task's outputs and every object under ``tasks/``."""
    report = Report(repair=repair, grace_s=grace_s)
    referenced = await _check_successes(store, storage, report, page_size)
    tasks: dict[str, Task | None] = {}
    async for info in storage.list(TASKS_PREFIX):
        report.objects_checked += 1
        if info.key in referenced:
            continue
        task_id = _task_id(info.key)
        if task_id is not None and task_id not in tasks:
            tasks[task_id] = await store.get(task_id)
        task = tasks.get(task_id) if task_id is not None else None
        if task is not None and task.status not in FINAL:
            continue  # in flight or in review: the object is in use
        orphan = Orphan(
            key=info.key,
            size=info.size,
            task_id=task_id,
            task_status=None if task is None else str(task.status),
            age_s=_age_s(storage, info, task, clock),
        )
        report.orphans.append(orphan)
        if repair:
            await _repair(storage, orphan, report)
    return report


async def _check_successes(
    store: Store, storage: Storage, report: Report, page_size: int
) -> set[str]:
    """Verify the outputs of every SUCCESS task; the keys they refer to (manifests too)."""
    referenced: set[str] = set()
    cursor: str | None = None
    while True:
        page, cursor = await store.list_tasks(
            tenant=None, status=Status.SUCCESS, limit=page_size, cursor=cursor
        )
        for task in page:
            report.tasks_checked += 1
            for raw in (task.result or {}).get("outputs", []):
                output = StoredOutput.from_json(raw)
                referenced.add(output.key)
                referenced.add(f"{output.key.rsplit('/', 1)[0]}/{MANIFEST}")
                report.outputs_checked += 1
                if not await verify(storage, output):
                    problem = "missing" if await storage.stat(output.key) is None else "corrupt"
                    report.missing.append(Missing(task.id, output.key, problem))
        if cursor is None:
            return referenced


def _task_id(key: str) -> str | None:
    parts = key.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == TASKS_PREFIX.rstrip("/") else None


def _age_s(
    storage: Storage, info: ObjectInfo, task: Task | None, clock: Callable[[], float]
) -> float | None:
    if info.modified_at is not None:
        return max(clock() - info.modified_at, 0.0)
    if task is not None:
        return max(clock() - task.updated_at, 0.0)
    return None


async def _repair(storage: Storage, orphan: Orphan, report: Report) -> None:
    if (orphan.age_s or 0.0) < report.grace_s:  # an unknown age counts as brand new
        report.kept.append(orphan.key)
        return
    await storage.delete(orphan.key)
    report.deleted.append(orphan.key)
    log.info("orphan_deleted", extra={"key": orphan.key, "task_id": orphan.task_id})
