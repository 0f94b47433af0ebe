"""The task's wire form: the one place a task becomes the JSON API.md shows, and the
paths and headers that go with it.

The HTTP API answers with :func:`task_json`, webhooks send it, and
:mod:`kiln.client` reads it back and builds its request paths here. An output's storage
key never leaves: a client gets its URL under ``/v1/tasks/<id>/outputs/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from kiln.models import JSON, Task, iso
from kiln.states import Status

if TYPE_CHECKING:
    from kiln.store.pools import PoolWait

#: Where tasks live in the HTTP API.
TASKS_PATH = "/v1/tasks"
#: The header that marks a replay of an earlier request's Idempotency-Key.
REPLAYED_HEADER = "Idempotent-Replayed"
#: The request header that names a submission's idempotency key.
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: The most submissions one ``POST /v1/tasks/batch`` takes.
MAX_BATCH_ITEMS = 1000


def task_path(task_id: str, *rest: str) -> str:
    """``/v1/tasks/<id>[/<rest>...]``, each part quoted."""
    return "/".join([TASKS_PATH, quote(task_id, safe=""), *(quote(p, safe="") for p in rest)])


def output_url(task_id: str, name: str) -> str:
    """The URL path an output is downloaded from."""
    return f"{TASKS_PATH}/{task_id}/outputs/{name}"


def _error_json(error: JSON | None) -> JSON | None:
    if error is None:
        return None
    return {
        "code": str(error.get("code", "internal_error")),
        "message": str(error.get("message", "")),
        "retryable": bool(error.get("retryable", False)),
    }


def _result_json(task: Task) -> JSON | None:
    if task.status is not Status.SUCCESS or task.result is None:
        return None
    outputs = [
        {
            "name": o["name"],
            "content_type": o["content_type"],
            "size": o["size"],
            "sha256": o["sha256"],
            "url": output_url(task.id, o["name"]),
        }
        for o in task.result.get("outputs", [])
    ]
    return {"outputs": outputs}


def _input_json(raw: JSON) -> JSON:
    return {key: raw.get(key) for key in ("name", "content_type", "size", "sha256")}


def task_json(
    task: Task,
    *,
    queue_position: int | None,
    deduplicated: bool = False,
    resource_wait: PoolWait | None = None,
    steps: dict[str, Task] | None = None,
) -> JSON:
    """The task exactly as API.md shows it, plus ``resource_wait`` (its place in a shared
    pool's line while WAITING_FOR_RESOURCE, else null), and for pipelines
    (docs/pipelines.md) a step's ``pipeline_id`` and ``step``, a pipeline's ``steps``
    (``steps`` given: its steps made so far, by ``name/copy``)."""
    return {
        "id": task.id,
        "kind": task.kind,
        "status": str(task.status),
        "final": task.final,
        "stage": task.stage,
        "progress": task.progress(),
        "queue_position": queue_position,
        "resource_wait": None if resource_wait is None else resource_wait.to_json(),
        "attempt": task.attempt,
        "max_attempts": task.max_attempts,
        "priority": task.priority,
        "params": task.params,
        "metadata": task.metadata,
        "inputs": [_input_json(i) for i in task.inputs],
        "idempotency_key": task.idempotency_key,
        "deduplicated": deduplicated,
        "cancel_requested": task.cancel_requested,
        "next_retry_at": iso(task.next_retry_at),
        "error": None if task.status is Status.SUCCESS else _error_json(task.error),
        "result": _result_json(task),
        "created_at": iso(task.created_at),
        "updated_at": iso(task.updated_at),
        "started_at": iso(task.started_at),
        "finished_at": iso(task.finished_at),
        "webhook": task.webhook,
        "model": task.model,
        "scheduled_for": iso(scheduled_for(task)),
        "rerun_of": task.rerun_of,
        "pipeline_id": task.pipeline_id,
        "step": None if task.step is None else {"name": task.step, "copy": task.step_copy},
        "steps": None if steps is None else steps_json(task, steps),
    }


def steps_json(pipeline: Task, made: dict[str, Task]) -> list[JSON]:
    """Every copy of every step of a pipeline, in order: its task (null until made), its
    status, progress, outputs and error."""
    found = []
    for step in pipeline.params.get("steps", []):
        for copy in range(int(step.get("repeat", 1))):
            task = made.get(f"{step['name']}/{copy}")
            result = None if task is None else _result_json(task)
            found.append(
                {
                    "name": step["name"],
                    "copy": copy,
                    "kind": step["kind"],
                    "task_id": None if task is None else task.id,
                    "status": None if task is None else str(task.status),
                    "progress": None if task is None else task.progress(),
                    "outputs": [] if result is None else result["outputs"],
                    "error": None
                    if task is None or task.status is Status.SUCCESS
                    else _error_json(task.error),
                }
            )
    return found


def scheduled_for(task: Task) -> float | None:
    """When a delayed task not yet claimed becomes claimable (its ``ready_at``, while it
    is PENDING with no attempt made and was made ready later than it was created)."""
    if task.status is Status.PENDING and task.attempt == 0 and task.ready_at > task.created_at:
        return task.ready_at
    return None
