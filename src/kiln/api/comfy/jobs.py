"""The v2 job routes: submit, list, get, cancel, the workflow (docs/comfy.md).

A job is a kiln task of kind ``comfy.workflow``, submitted exactly as ``POST /v1/tasks``
submits one (:func:`kiln.api.tasks.submit`: single-flight, idempotency, dedup, webhooks,
metrics and traces see the same task); its assets are held as kiln inputs meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.api.comfy import shapes
from kiln.api.comfy.common import Caller, book_of, job_answer, job_task
from kiln.api.comfy.errors import V2Error, V2Route
from kiln.api.comfy.workflow import Resolved, check_graph, resolve, restore
from kiln.api.state import api_state
from kiln.api.tasks import read_body, submit
from kiln.app import CURSOR_PATTERN
from kiln.backends.comfy_workflow_params import KIND
from kiln.errors import AlreadyFinal
from kiln.models import JSON, Task
from kiln.wire import REPLAYED_HEADER

# Not in kiln's /openapi.json (API.md's /v1): the v2 contract is Comfy's (docs/comfy.md).
router = APIRouter(
    prefix=shapes.PREFIX, route_class=V2Route, tags=["Comfy API v2"], include_in_schema=False
)

BODY_FIELDS = frozenset({"workflow", "extra_data", "metadata", "dedup"})
#: How many tasks one list page reads at most while a filter skips jobs.
LIST_SCAN = 500
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]


def _bad(message: str, **details: Any) -> V2Error:
    return V2Error("invalid_request", message, 400, details or None)


def check_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isascii() or not key.isprintable():
        raise _bad("Idempotency-Key must be 1-255 printable ASCII characters")
    return key


def _labels(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise _bad("'metadata' must be an object of string labels")
    return dict(raw)


def parse_body(raw: bytes) -> JSON:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        raise _bad(f"unknown field(s): {', '.join(unknown)}", fields=unknown)
    extra = body.get("extra_data")
    if extra is not None and not isinstance(extra, dict):
        raise _bad("'extra_data' must be an object")
    if not isinstance(body.get("dedup", False), bool):
        raise _bad("'dedup' must be true or false")
    return body


async def _files(request: Request, resolved: Resolved) -> list[tuple[str, bytes]]:
    """The assets' bytes, to pin as kiln inputs while the task goes in."""
    book = book_of(request)
    return [
        (r.sha256, await book.content(r.sha256, r.size_bytes)) for r in resolved.records.values()
    ]


@router.post("/jobs", status_code=201, summary="Submit an API-format workflow")
async def submit_job(request: Request, principal: Caller, key: IdempotencyKey = None) -> Response:
    state = api_state(request)
    key = check_key(key)
    body = parse_body(await read_body(request, state.settings.max_body_bytes))
    resolved = await resolve(book_of(request), principal.tenant, check_graph(body.get("workflow")))
    params = {
        "workflow": resolved.graph,
        "extra_data": body.get("extra_data") or {},
        "assets": resolved.assets,
    }
    records = [record.input_record(name) for name, record in sorted(resolved.records.items())]
    asked = state.app.submission(
        KIND,
        params,
        tenant=principal.tenant,
        idempotency_key=key,
        inputs=records,
        metadata=_labels(body.get("metadata")),
        dedup=bool(body.get("dedup", False)),
    )
    await state.app.admit(asked)
    # The assets' bytes stay when the submission is refused: they are the tenant's assets.
    async with state.app.holding(asked, await _files(request, resolved), drop=False) as full:
        submitted = await submit(state, full)
    result = submitted.result
    answer = await job_answer(request, result.task)
    if result.deduplicated:
        answer["deduplicated"] = True
    headers = {"Location": f"{shapes.PREFIX}/jobs/{result.task.id}"}
    if result.replayed or result.deduplicated:
        headers[REPLAYED_HEADER] = "true" if result.replayed else "false"
    return JSONResponse(answer, status_code=201, headers=headers)


def _statuses(raw: str | None) -> set[str] | None:
    if raw is None or not raw.strip():
        return None
    wanted = {s.strip().lower() for s in raw.split(",") if s.strip()}
    unknown = sorted(wanted - set(shapes.STATUSES))
    if unknown:
        raise _bad(f"unknown status(es): {', '.join(unknown)}", allowed=list(shapes.STATUSES))
    return wanted


def _label_filter(request: Request) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name.startswith("metadata[") and name.endswith("]") and len(name) > 10:
            found[name[9:-1]] = value
    return found


def _wanted(task: Task, statuses: set[str] | None, labels: dict[str, str]) -> bool:
    if statuses is not None and shapes.status_of(task) not in statuses:
        return False
    return all(task.metadata.get(k) == v for k, v in labels.items())


@router.get("/jobs", summary="List jobs, newest first")
async def list_jobs(
    request: Request,
    principal: Caller,
    limit: Annotated[int, Query(ge=1, le=100)] = 50,
    cursor: str | None = None,
    status: str | None = None,
) -> Response:
    state = api_state(request)
    if cursor is not None and CURSOR_PATTERN.fullmatch(cursor) is None:
        raise _bad("the cursor is not one a page gave: pass next_cursor as is")
    statuses = _statuses(status)
    labels = _label_filter(request)
    one = shapes.ONE_STATUS.get(next(iter(statuses))) if statuses and len(statuses) == 1 else None
    jobs: list[Task] = []
    scanned, after, exhausted = 0, cursor, False
    while len(jobs) < limit and scanned < LIST_SCAN and not exhausted:
        page, following = await state.app.list_tasks(
            tenant=principal.scope, status=one, kind=KIND, limit=limit + 1, cursor=after
        )
        consumed = True
        for n, task in enumerate(page):
            scanned += 1
            after = task.id
            if _wanted(task, statuses, labels):
                jobs.append(task)
            if len(jobs) == limit:
                consumed = n == len(page) - 1
                break
        exhausted = following is None and consumed
    items = await asyncio.gather(*(job_answer(request, task) for task in jobs))
    body: JSON = {"jobs": list(items)}
    if not exhausted and after is not None:
        body["next_cursor"] = after
    return JSONResponse(body)


@router.get("/jobs/{job_id}", summary="Get a job")
async def get_job(job_id: str, request: Request, principal: Caller) -> Response:
    task = await job_task(api_state(request), job_id, principal)
    return JSONResponse(await job_answer(request, task))


@router.post("/jobs/{job_id}/cancel", summary="Cancel a job (idempotent)")
async def cancel_job(job_id: str, request: Request, principal: Caller) -> Response:
    state = api_state(request)
    task = await job_task(state, job_id, principal)
    if not task.final:
        try:
            task = await state.app.cancel(task.id, principal.scope)
        except AlreadyFinal:
            task = await state.app.get(task.id, principal.scope)
    return JSONResponse(await job_answer(request, task))


@router.get("/jobs/{job_id}/workflow", summary="The workflow behind a job")
async def get_workflow(job_id: str, request: Request, principal: Caller) -> Response:
    task = await job_task(api_state(request), job_id, principal)
    graph = await restore(book_of(request), task.tenant, task.params.get("workflow", {}))
    return JSONResponse({"workflow": graph, "format": "api"})
