"""Retention: final tasks, their events, idempotency keys and outputs go after a while.

``KILN_RETENTION_S`` keeps final tasks that long after they finished (unset: forever);
``KILN_RETENTION_TENANTS`` (``tenant:seconds,...``) overrides it per tenant (``0`` keeps a
tenant's tasks forever). The leading supervisor runs a pass every ``PASS_EVERY_S``: each
page of tasks leaves the store in one transaction, then their objects are deleted from
storage. An object whose delete fails is an orphan that ``kiln reconcile`` finds later.

A task is a dedup and idempotency target for as long as it exists: once purged, the same
request makes a new task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln.models import Task
from kiln.storage import Storage
from kiln.store import Store

log = logging.getLogger("kiln.retention")

PASS_EVERY_S = 60.0
PAGE = 500


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    default_s: float | None = None
    per_tenant: Mapping[str, float] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.default_s is not None or any(s > 0 for s in self.per_tenant.values())


@dataclass(slots=True)
class RetentionReport:
    tasks: int = 0
    objects: int = 0
    object_errors: int = 0


async def purge(
    store: Store, storage: Storage, policy: RetentionPolicy, now: float, *, page: int = PAGE
) -> RetentionReport:
    """One pass: every task past its tenant's retention, page by page."""
    report = RetentionReport()
    for tenant, keep_s in policy.per_tenant.items():
        if keep_s > 0:
            await _drain(store, storage, report, page, now - keep_s, tenant=tenant)
    if policy.default_s is not None:
        exclude = list(policy.per_tenant)
        await _drain(store, storage, report, page, now - policy.default_s, exclude=exclude)
    if report.tasks:
        log.info("retention_purged", extra={"tasks": report.tasks, "objects": report.objects})
    return report


async def _drain(
    store: Store,
    storage: Storage,
    report: RetentionReport,
    page: int,
    before: float,
    *,
    tenant: str | None = None,
    exclude: list[str] | None = None,
) -> None:
    while True:
        tasks = await store.purge(
            finished_before=before, tenant=tenant, exclude=exclude or (), limit=page
        )
        report.tasks += len(tasks)
        for task in tasks:
            await _delete_objects(storage, task, report)
        if len(tasks) < page:
            return


async def _delete_objects(storage: Storage, task: Task, report: RetentionReport) -> None:
    try:
        keys = [info.key async for info in storage.list(f"tasks/{task.id}/")]
        for key in keys:
            await storage.delete(key)
            report.objects += 1
    except Exception:  # the store no longer knows the task: reconcile removes the rest
        report.object_errors += 1
        log.warning("retention_objects_left", extra={"task_id": task.id}, exc_info=True)
