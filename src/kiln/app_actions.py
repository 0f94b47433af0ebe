"""The App's user actions on one task: cancel, retry and a moderator's review (``App.cancel``,
``App.retry``, ``App.review``), each through :meth:`Engine.apply <kiln.engine.Engine.apply>`
or the store's pipeline-wide change, tried again while the task keeps changing."""

from __future__ import annotations

from typing import Any

from kiln import pipelines
from kiln.contributions import Counts, failure
from kiln.engine import Engine, rerun_fields
from kiln.errors import AlreadyFinal, Conflict, InvalidRequest, NotInReview, NotRetryable
from kiln.models import JSON, StoredOutput, Task
from kiln.states import ENDED_UNSUCCESSFULLY, RUNNING, Event, Status
from kiln.storage import verify

__all__ = ["TRIES", "Actions", "rerun_request"]

#: How often an action reads the task again when it changed in between (Conflict).
TRIES = 20


class Actions:
    """What a user does to a task: cancel it, retry it, approve or reject it in review."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def cancel(self, task_id: str, tenant: str | None = None) -> Task:
        """Cancel now when nothing runs; otherwise ask the worker (cancel_requested)."""
        for _ in range(TRIES):
            task = await self.engine.get(task_id, tenant)
            if task.final:
                raise AlreadyFinal(f"task {task_id} is already {task.status}")
            try:
                if task.kind == pipelines.KIND:
                    return await self._cancel_pipeline(task.id)
                if task.status in RUNNING:
                    return await self.engine.request_cancel(task)
                return await self.engine.apply(task, Event.CANCEL)
            except Conflict:
                continue
        raise Conflict(f"task {task_id} keeps changing; try again")

    async def _cancel_pipeline(self, pipeline_id: str) -> Task:
        """Cancel a pipeline; the workers of this process hear at once of its steps that
        were running (asked to stop)."""
        store = self.engine.store
        cancelled = await store.cancel_pipeline(pipeline_id)
        for step in (await store.pipeline_steps(cancelled)).values():
            if step.cancel_requested and step.status in RUNNING:
                for listener in self.engine.cancel_listeners:
                    listener(step.id)
        return cancelled

    async def retry(self, task_id: str, tenant: str | None = None) -> Task:
        """Manual retry of a final FAILED, TIMEOUT or CANCELLED task: due now. A step of
        a pipeline that ended is retried with its pipeline (the steps that did not
        succeed run again, the pipeline goes on from them); alone it would lead nowhere."""
        store = self.engine.store
        for _ in range(TRIES):
            task = await self.engine.get(task_id, tenant)
            if task.status not in ENDED_UNSUCCESSFULLY:
                raise NotRetryable(
                    f"task {task_id} is {task.status}; only final FAILED, "
                    "TIMEOUT or CANCELLED tasks can be retried"
                )
            fields = rerun_fields(task, self.engine.now())
            try:
                if task.kind == pipelines.KIND:
                    return await store.retry_pipeline(task.id, {})
                if task.pipeline_id is not None:
                    pipeline = await store.get(task.pipeline_id)
                    if pipeline is not None and pipeline.status in ENDED_UNSUCCESSFULLY:
                        await store.retry_pipeline(pipeline.id, {})
                        return await self.engine.get(task_id, tenant)
                return await self.engine.apply(task, Event.RETRY, fields=fields)
            except Conflict:
                continue
        raise Conflict(f"task {task_id} keeps changing; try again")

    async def review(self, task_id: str, decision: str, reason: str | None = None) -> Task:
        """An admin's moderation decision on a task in NEEDS_REVIEW."""
        if decision not in ("approve", "reject"):
            raise InvalidRequest("decision must be 'approve' or 'reject'")
        task = await self.engine.get(task_id)
        if task.status is not Status.NEEDS_REVIEW:
            raise NotInReview(f"task {task_id} is {task.status}, not NEEDS_REVIEW")
        storage = self.engine.storage
        outputs = [StoredOutput.from_json(o) for o in (task.result or {}).get("outputs", [])]
        try:
            if decision == "approve":
                if all([await verify(storage, o) for o in outputs]) and outputs:
                    return await self.engine.apply(task, Event.APPROVE, fields={"error": None})
                message = "outputs are missing or corrupt"
                error: JSON = {"code": "result_lost", "message": message, "retryable": False}
            else:
                message = reason or "rejected by a moderator"
                error = {"code": "content_rejected", "message": message, "retryable": False}
            counted = Counts((failure(task, str(error["code"])),))
            updated = await self.engine.apply(
                task, Event.REJECT, error=error, fields={"error": error}, facts=[counted]
            )
        except Conflict:
            raise NotInReview(f"task {task_id} left NEEDS_REVIEW") from None
        for output in outputs:
            await storage.delete(output.key)
        return updated


def rerun_request(
    original: Task, params: JSON | None, *, priority: int | None
) -> tuple[JSON, dict[str, Any]]:
    """The params and submission fields of a rerun of ``original``: ``params`` merged over
    its params (a pipeline's own steps planned anew), and its tenant, attempts, deadline,
    timeouts, metadata, inputs and webhook kept; ``rerun_of`` names it."""
    webhook = original.webhook or {}
    base = original.params
    if original.kind == pipelines.KIND:  # its own steps planned anew, any change checked
        base = pipelines.unplanned(base)
    fields: dict[str, Any] = {
        "tenant": original.tenant,
        "priority": original.priority if priority is None else priority,
        "max_attempts": original.max_attempts,
        "deadline_s": original.deadline_s,
        "timeouts": original.timeouts,
        "metadata": original.metadata,
        "inputs": original.inputs,
        "webhook_url": webhook.get("url"),
        "webhook_events": webhook.get("events"),
        "rerun_of": original.id,
    }
    return {**base, **(params or {})}, fields
