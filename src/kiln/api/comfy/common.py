"""What the v2 routes share: the caller, the asset book, the job of a task, its answer."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection

from kiln.api.auth import Principal, require_principal
from kiln.api.comfy import shapes
from kiln.api.comfy.book import AssetBook
from kiln.api.state import ApiState, api_state
from kiln.backends.comfy_workflow_params import KIND
from kiln.errors import NotFound
from kiln.models import JSON, Task

Caller = Annotated[Principal, Depends(require_principal)]
_BOOK = "kiln_comfy_book"


def book_of(connection: HTTPConnection) -> AssetBook:
    """The asset book of the app serving this request (one per app)."""
    found = getattr(connection.app.state, _BOOK, None)
    if not isinstance(found, AssetBook):
        found = AssetBook(api_state(connection).app)
        setattr(connection.app.state, _BOOK, found)
    return found


def base_of(connection: HTTPConnection) -> str:
    """The origin the client reached (scheme and Host): links are absolute."""
    url = connection.url
    return f"{url.scheme}://{url.netloc}"


async def job_task(state: ApiState, task_id: str, principal: Principal) -> Task:
    """The task of job ``task_id``; NotFound for another tenant's or another kind's."""
    task = await state.app.get(task_id, principal.scope)
    if task.kind != KIND:
        raise NotFound(f"no job {task_id}")
    return task


def retention_of(state: ApiState, tenant: str) -> float | None:
    settings = state.settings
    return settings.retention_tenants.get(tenant, settings.retention_s)


async def job_answer(connection: HTTPConnection, task: Task) -> JSON:
    """The v2 job of ``task``: where it stands in the queue, its outputs' blake3."""
    state = api_state(connection)
    book = book_of(connection)
    position = await state.app.queue_position(task) if shapes.status_of(task) == "queued" else None
    blake3: dict[str, str | None] = {}
    for output in shapes.outputs_of(task):
        blake3[output.sha256] = await book.blake3_of_object(output.key, output.sha256, output.size)
    view = shapes.JobView(base_of(connection), position, retention_of(state, task.tenant), blake3)
    return shapes.job_json(task, view)
