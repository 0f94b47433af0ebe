"""Retention: final tasks, their events, idempotency keys, outputs and inputs go after a while.

``KILN_RETENTION_S`` keeps final tasks that long after they finished (unset: forever);
``KILN_RETENTION_TENANTS`` (``tenant:seconds,...``) overrides it per tenant (``0`` keeps a
tenant's tasks forever). The leading supervisor runs a pass every ``PASS_EVERY_S``: each
page of tasks leaves the store in one transaction, then their objects are deleted from
storage. An object whose delete fails is an orphan that ``kiln reconcile`` finds later.

An uploaded input (kept once per content, kiln/inputs.py) goes once no task refers to it,
no upload holds it, and it was last used longer ago than ``KILN_RETENTION_S`` (or the
shortest per-tenant period, when only those are set); see kiln/store/inputs.py for how an
upload of the same content never finds it half gone.

A task is a dedup target for as long as it exists, and an idempotency target as long as
its key: with the task, or ``KILN_IDEMPOTENCY_TTL_S`` after the key was first used,
whichever comes first. Then the same request makes a new task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln import inputs
from kiln.config import Settings
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
    #: How long an idempotency key answers with its task (None: as long as the task).
    keys_s: float | None = None

    @classmethod
    def of(cls, settings: Settings) -> RetentionPolicy:
        return cls(
            settings.retention_s, dict(settings.retention_tenants), settings.idempotency_ttl_s
        )

    @property
    def enabled(self) -> bool:
        return self.inputs_s is not None or self.keys_s is not None

    @property
    def inputs_s(self) -> float | None:
        """How long an input no task refers to stays after its last use (None: forever)."""
        periods = [s for s in self.per_tenant.values() if s > 0]
        if self.default_s is not None:
            periods.append(self.default_s)
        return min(periods) if periods else None


@dataclass(slots=True)
class RetentionReport:
    tasks: int = 0
    objects: int = 0
    object_errors: int = 0
    inputs: int = 0
    keys: int = 0


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
    if policy.inputs_s is not None:  # after the tasks: theirs may be unused now
        await _drain_inputs(store, storage, report, page, now - policy.inputs_s)
    if policy.keys_s is not None:
        while gone := await store.keys.expire(created_before=now - policy.keys_s, limit=page):
            report.keys += gone
            if gone < page:
                break
    if report.tasks or report.inputs or report.keys:
        counts = {"tasks": report.tasks, "objects": report.objects, "inputs": report.inputs}
        log.info("retention_purged", extra={**counts, "keys": report.keys})
    return report


async def _drain_inputs(
    store: Store, storage: Storage, report: RetentionReport, page: int, used_before: float
) -> None:
    while True:
        deletion = await store.inputs.claim_unused(used_before=used_before, limit=page)
        report.inputs += await inputs.delete(store, storage, deletion)
        if len(deletion.sha256s) < page:
            return


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
