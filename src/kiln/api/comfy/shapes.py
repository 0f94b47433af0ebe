"""The v2 shapes of kiln's records: a task as a job, its outputs as assets, its status,
progress and error (docs/comfy.md)."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import mimetypes
import re
from dataclasses import dataclass
from typing import Any

from kiln.app import CURSOR_PATTERN
from kiln.models import JSON, StoredOutput, Task, iso
from kiln.states import RUNNING, Status

PREFIX = "/api/v2"
_B64URL = re.compile(r"[A-Za-z0-9_-]+")
#: How long a content URL is said to be valid (it is the content route: it never expires).
URL_TTL_S = 3600.0
TERMINAL = frozenset({"succeeded", "failed", "expired", "canceled"})
STATUSES = ("queued", "running", "canceling", "succeeded", "failed", "expired", "canceled")

_BY_STATUS: dict[Status, str] = {
    Status.PENDING: "queued",
    Status.RETRYING: "queued",
    Status.WAITING_FOR_RESOURCE: "queued",
    Status.GENERATING: "running",
    Status.UPLOADING: "running",
    Status.NEEDS_REVIEW: "running",
    Status.SUCCESS: "succeeded",
    Status.FAILED: "failed",
    Status.TIMEOUT: "expired",
    Status.CANCELLED: "canceled",
}
#: The v2 statuses that are one kiln status (a list filter the store can apply itself).
ONE_STATUS: dict[str, Status] = {
    "succeeded": Status.SUCCESS,
    "failed": Status.FAILED,
    "expired": Status.TIMEOUT,
    "canceled": Status.CANCELLED,
}


def job_status(status: Status, cancel_requested: bool = False) -> str:
    """The v2 status of a kiln status (a cancel asked of a running task: canceling)."""
    if cancel_requested and status in RUNNING:
        return "canceling"
    return _BY_STATUS[status]


def status_of(task: Task) -> str:
    return job_status(task.status, task.cancel_requested)


def stamp(ts: float | None) -> str | None:
    return iso(ts)


def now_plus(seconds: float) -> str:
    moment = dt.datetime.now(tz=dt.UTC) + dt.timedelta(seconds=seconds)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# Outputs as assets ----------------------------------------------------------------------


def output_asset_id(task_id: str, name: str) -> str:
    """The asset id of a task's output: the task id, a dot, the name in base64url."""
    encoded = base64.urlsafe_b64encode(name.encode()).decode("ascii").rstrip("=")
    return f"{task_id}.{encoded}"


def parse_output_id(asset_id: str) -> tuple[str, str] | None:
    """(task id, output name) of an output's asset id, or None when it is not one."""
    task_id, dot, encoded = asset_id.partition(".")
    if not dot or CURSOR_PATTERN.fullmatch(task_id) is None or not _B64URL.fullmatch(encoded):
        return None
    try:
        name = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return task_id, name


def output_type(content_type: str) -> str:
    major = content_type.split("/", 1)[0]
    if major in ("image", "video", "audio", "text"):
        return major
    return "file"


def split_output_name(name: str) -> tuple[str, str]:
    """(node id, file name) of an output named ``<node_id>-<file name>``."""
    node_id, dash, file_name = name.partition("-")
    return (node_id, file_name) if dash and node_id and file_name else ("", name)


def outputs_of(task: Task) -> list[StoredOutput]:
    if task.status is not Status.SUCCESS or task.result is None:
        return []
    found = [StoredOutput.from_json(raw) for raw in task.result.get("outputs", [])]
    return [o for o in found if o.key.startswith(f"tasks/{task.id}/")]


def output_json(task: Task, output: StoredOutput, base: str, blake3: str | None) -> JSON:
    asset_id = output_asset_id(task.id, output.name)
    node_id, file_name = split_output_name(output.name)
    return {
        "node_id": node_id,
        "name": file_name,
        "type": output_type(output.content_type),
        "content_type": output.content_type,
        "size_bytes": output.size,
        "id": asset_id,
        "hash": blake3,
        "sha256": output.sha256,
        "url": f"{base}{PREFIX}/assets/{asset_id}/content",
        "url_expires_at": now_plus(URL_TTL_S),
        "job_id": task.id,
    }


def guess_type(file_name: str) -> str:
    return mimetypes.guess_type(file_name)[0] or "application/octet-stream"


# Jobs -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeAt:
    """The node a worker said it executes (stage ``node:<id>:<class>``)."""

    node_id: str | None
    class_type: str | None
    message: str | None


def node_at(stage: str | None) -> NodeAt:
    if stage is None:
        return NodeAt(None, None, None)
    if not stage.startswith("node:"):
        return NodeAt(None, None, stage)
    node_id, _, class_type = stage.removeprefix("node:").rpartition(":")
    if not node_id:  # "node:<id>" with no class
        node_id, class_type = class_type, ""
    return NodeAt(node_id or None, class_type or None, None)


def progress_json(
    stage: str | None, step: int | None, total: int | None, nodes: int, done: bool
) -> JSON | None:
    """A v2 progress snapshot (None before the first step of a job not done)."""
    if step is None and stage is None and not done:
        return None
    at = node_at(stage)
    value = 1.0 if done else 0.0
    if not done and step is not None and total:
        value = round(min(max(step / total, 0.0), 1.0), 4)
    message = at.message
    if message is None and step is not None and total:
        message = f"{at.class_type or at.node_id or 'step'} {step}/{total}"
    return {
        "value": value,
        "nodes_done": nodes if done else 0,
        "nodes_total": nodes,
        "current_node": None if done else at.node_id,
        "current_node_class": None if done else at.class_type,
        "step": step,
        "steps": total,
        "message": message,
    }


def error_json(error: JSON | None) -> JSON | None:
    """A kiln task error as v2's ``JobError``: a node's failure names the node."""
    if error is None:
        return None
    details: Any = error.get("details")
    if isinstance(details, list):
        details = details[0] if details else None
    node: JSON = details if isinstance(details, dict) else {}
    node_id, class_type = node.get("node_id"), node.get("node_type")
    return {
        "code": str(error.get("code") or "failed"),
        "message": str(error.get("message") or ""),
        "node_id": None if node_id is None else str(node_id),
        "class_type": None if class_type is None else str(class_type),
        "traceback": node.get("traceback") if isinstance(node.get("traceback"), str) else None,
    }


def _ms(start: float | None, end: float | None) -> int | None:
    if start is None or end is None:
        return None
    return max(0, round((end - start) * 1000))


@dataclass(frozen=True, slots=True)
class JobView:
    """What a job's answer needs besides the task."""

    base: str
    queue_position: int | None
    retention_s: float | None
    blake3: dict[str, str | None]


def expires_at(task: Task, retention_s: float | None) -> float:
    if task.finished_at is not None and retention_s is not None:
        return task.finished_at + retention_s
    return task.deadline_at


def job_json(task: Task, view: JobView) -> JSON:
    status = status_of(task)
    urls = f"{view.base}{PREFIX}/jobs/{task.id}"
    graph = task.params.get("workflow")
    nodes = len(graph) if isinstance(graph, dict) else 0
    progress = progress_json(
        task.stage, task.progress_step, task.progress_total, nodes, status == "succeeded"
    )
    outputs = [output_json(task, o, view.base, view.blake3.get(o.sha256)) for o in outputs_of(task)]
    labels = task.metadata if isinstance(task.metadata, dict) else {}
    return {
        "id": task.id,
        "status": status,
        "created_at": stamp(task.created_at),
        "started_at": stamp(task.started_at),
        "completed_at": stamp(task.finished_at) if task.final else None,
        "expires_at": stamp(expires_at(task, view.retention_s)),
        "queue_position": view.queue_position if status == "queued" else None,
        "progress": progress,
        "outputs": outputs,
        "error": error_json(task.error) if status in ("failed", "expired", "canceled") else None,
        "metrics": {
            "queue_ms": _ms(task.created_at, task.started_at),
            "execution_ms": _ms(task.started_at, task.finished_at),
        },
        "metadata": {k: v for k, v in labels.items() if isinstance(v, str)},
        "urls": {"self": urls, "events": f"{urls}/events", "cancel": f"{urls}/cancel"},
        "create_time": stamp(task.created_at),
        "update_time": stamp(task.updated_at),
    }
