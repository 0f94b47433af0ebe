"""The task routes: submit, read, list, cancel, retry, review, outputs, stats.

Handlers stay thin: they read and check the request, call the engine (:class:`kiln.App`,
which holds the policy), and shape the answer. A rejected request stores nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar
from urllib.parse import quote

import pydantic
from fastapi import APIRouter, Depends, Header, Query
from pydantic import BeforeValidator
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response

from kiln import pipelines, wire
from kiln.api.auth import Principal, require_principal, require_reviewer
from kiln.api.errors import error_responses, validation_details
from kiln.api.schemas import ReviewRequest, StatsOut, SubmitRequest, TaskList, TaskOut
from kiln.api.state import ApiState, Standing, Submitted, api_state
from kiln.api.strict_json import RenderedJSON, parse_json
from kiln.api.uploads import UploadedFile, read_upload
from kiln.app import CURSOR_PATTERN
from kiln.breakers import breakers_json
from kiln.errors import InvalidRequest, NotFound, PayloadTooLarge, UnsupportedMediaType
from kiln.models import JSON, StoredOutput, SubmitResult, Task, Timeouts
from kiln.states import Status
from kiln.submission import Submission
from kiln.wire import task_json

log = logging.getLogger("kiln.api")

router = APIRouter(prefix="/v1")

Model = TypeVar("Model", bound=pydantic.BaseModel)
Caller = Annotated[Principal, Depends(require_principal)]

IDEMPOTENCY_KEY_PATTERN = r"^[\x20-\x7e]+$"
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias=wire.IDEMPOTENCY_HEADER,
        min_length=1,
        max_length=255,
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="1-255 printable ASCII characters; a retried request with the same key "
        "and body returns the original task",
    ),
]


def _blank_to_none(value: Any) -> Any:
    return None if value == "" else value


def _status_of(value: Any) -> Any:
    """A status filter in any case (``success``, ``Success``): statuses are upper case."""
    if isinstance(value, str):
        value = value.strip().upper()
    return _blank_to_none(value)


# Request bodies -------------------------------------------------------------------------


def media_type(request: Request) -> str | None:
    raw = request.headers.get("content-type")
    if raw is None:
        return None
    return raw.split(";", 1)[0].strip().lower() or None


def _is_json(kind: str | None) -> bool:
    return kind == "application/json" or (
        kind is not None and kind.startswith("application/") and kind.endswith("+json")
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes.

    The declared Content-Length is checked first, and the stream is counted as it is read,
    so a missing or lying Content-Length cannot get more than ``limit`` bytes in.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is larger than {limit} bytes (KILN_MAX_BODY_BYTES allows more)"
    )


async def json_bytes(request: Request, limit: int) -> bytes:
    """A JSON request's body as sent (UnsupportedMediaType for another media type)."""
    if not _is_json(media_type(request)):
        raise UnsupportedMediaType("send the body as JSON, with Content-Type: application/json")
    return await read_body(request, limit)


async def json_body(request: Request, limit: int) -> Any:
    return parse_json(await json_bytes(request, limit))


def validated(model: type[Model], data: Any, where: str = "body") -> Model:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        details = validation_details([{**err, "loc": (where, *err["loc"])} for err in exc.errors()])
        what = "the request body" if where == "body" else f"the {where!r} part"
        raise InvalidRequest(f"{what} is not valid", details=details) from None


def _body_doc(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# Answers --------------------------------------------------------------------------------


class Unread:
    """A queue position not read yet."""


UNREAD = Unread()


async def standing(state: ApiState, task: Task, position: int | Unread | None = UNREAD) -> Standing:
    """Where the task stands; ``position`` when it was read with the task."""
    if isinstance(position, Unread):
        position = await state.app.queue_position(task)
    steps = await state.app.pipeline_steps(task) if task.kind == pipelines.KIND else None
    return Standing(task, position, await state.app.pool_wait(task), steps)


def standing_response(
    found: Standing,
    *,
    status_code: int = 200,
    deduplicated: bool = False,
    headers: dict[str, str] | None = None,
) -> Response:
    """The task where it stands as JSON; rendered once per :class:`Standing` and flag."""
    rendered = found.rendered.get(deduplicated)
    if rendered is not None:
        return Response(rendered, status_code, headers, media_type=RenderedJSON.media_type)
    body = task_json(
        found.task,
        queue_position=found.queue_position,
        deduplicated=deduplicated,
        resource_wait=found.resource_wait,
        steps=found.steps,
    )
    response = RenderedJSON(body, status_code=status_code, headers=headers)
    if isinstance(response.body, bytes):
        found.rendered[deduplicated] = response.body
    return response


async def task_response(state: ApiState, task: Task) -> Response:
    return standing_response(await standing(state, task))


def _submit_answer(result: SubmitResult) -> tuple[int, dict[str, str]]:
    if result.created:
        return 201, {"Location": wire.task_path(result.task.id)}
    if result.replayed:
        return 200, {wire.REPLAYED_HEADER: "true"}
    return 200, {}


# Submission -----------------------------------------------------------------------------


def _timeouts(state: ApiState, request: SubmitRequest) -> Timeouts | None:
    if request.timeouts is None:
        return None
    given = request.timeouts
    return state.app.timeouts_of(
        request.kind,
        waiting_s=given.waiting_s,
        generating_s=given.generating_s,
        uploading_s=given.uploading_s,
    )


def submission(
    state: ApiState,
    principal: Principal,
    request: SubmitRequest,
    key: str | None,
    files: Sequence[UploadedFile] = (),
) -> Submission:
    """The request as one checked :class:`Submission` (its params validated here, once),
    refused before anything is stored."""
    return state.app.submission(
        request.kind,
        request.params,
        tenant=principal.tenant,
        idempotency_key=key,
        dedup=request.dedup,
        priority=request.priority,
        max_attempts=request.max_attempts,
        deadline_s=request.deadline_s,
        timeouts=_timeouts(state, request),
        metadata=request.metadata,
        inputs=[f.record() for f in files],
        references=request.inputs,
        webhook_url=request.webhook_url,
        webhook_events=request.webhook_events,
        run_at=request.run_at,
        delay_s=request.delay_s,
    )


async def submit(state: ApiState, submission: Submission) -> Submitted:
    """Store a submission; identical concurrent requests share one round trip, and the
    reading of where the task stands. Those are identical that the store would answer
    alike: the same Idempotency-Key and fingerprint, or (without a key) the same content,
    each digested once. Content seen lately is read first (a likely hit: one read, no
    write); other content goes straight to the store's insert-or-get, which answers a
    hit too (:mod:`kiln.api.recent`)."""
    app = state.app
    key = submission.idempotency_key
    content = submission.content_key() if key is None else None  # None: no content dedup
    new = app.task_row(submission) if key is not None else None
    recent = state.recent_content

    async def call() -> Submitted:
        if content is not None and recent.seen(submission.tenant, content):
            hit = await app.dedup_hit(submission, content)  # one read, no insert
            if hit is not None:
                return Submitted(hit[0], await standing(state, hit[0].task, hit[1]))
        row = new if new is not None else app.task_row(submission, content)
        result = await app.enter(submission, row, place=True)  # its position read with it
        if content is not None:
            recent.add(submission.tenant, content)
        position = result.queue_position if result.placed else UNREAD
        return Submitted(result, await standing(state, result.task, position))

    if key is None and content is None:  # no key, no content dedup: nothing to share
        return await call()
    flight = (submission.tenant, key, new.fingerprint if new is not None else content)
    first, led = await state.submissions.run(flight, call)
    if led:
        return first
    # The store would have answered this copy the same way: a replay of the key, or the
    # content-dedup hit on the task the first copy made, which stands where it was read.
    state.metrics.coalesced.inc()
    result = await app.coalesced(first.result, replayed=key is not None)
    return Submitted(result, first.standing)


async def submit_upload(
    request: Request, state: ApiState, principal: Principal, key: str | None
) -> Submitted:
    """``multipart/form-data`` submissions: the ``request`` part plus the input files (and
    inputs named by reference in the ``request`` part's ``inputs``)."""
    upload = await read_upload(request, state.settings)
    body = validated(SubmitRequest, parse_json(upload.request, "request"), "request")
    checked = submission(state, principal, body, key, upload.files)
    return await submit_with_inputs(state, checked, upload.files)


async def submit_with_inputs(
    state: ApiState,
    checked: Submission,
    files: Sequence[UploadedFile] = (),
    *,
    rate: bool = True,
) -> Submitted:
    """A submission with inputs: uploaded files and inputs named by reference.

    Everything was checked before anything is stored (limits, types, the JSON, the kind,
    its params against the uploaded inputs); the App then finds the references among
    the tenant's uploads and outputs, keeps each file once by sha256, and the task is
    submitted as a JSON one would be (:meth:`kiln.App.holding`). When the submission is
    still refused (an Idempotency-Key reused with other content, an outage), the inputs
    this request wrote are removed again, so a refused request leaves nothing behind.
    ``rate``: count the submission against the tenant's rate limit (a batch took its
    tokens already).
    """
    if rate:
        await state.app.admit(checked)
    async with state.app.holding(checked, [(f.sha256, f.data) for f in files]) as full:
        return await submit(state, full)


_SUBMIT_HEADERS = {
    "Location": {"description": "/v1/tasks/<id>", "schema": {"type": "string"}},
}
_REPLAY_HEADERS = {
    "Idempotent-Replayed": {
        "description": "`true` when this answers an earlier request with the same key",
        "schema": {"type": "string"},
    },
}


@router.post(
    "/tasks",
    summary="Submit a task",
    status_code=201,
    response_model=TaskOut,
    responses={
        201: {"description": "A new task", "headers": _SUBMIT_HEADERS},
        200: {
            "model": TaskOut,
            "description": "The task an earlier identical request made (a replay of the "
            "Idempotency-Key, or a content-dedup hit with `deduplicated: true`)",
            "headers": _REPLAY_HEADERS,
        },
        **error_responses(401, 413, 415, 422, 429),
    },
    openapi_extra=_body_doc(SubmitRequest),
)
async def submit_task(
    request: Request, principal: Caller, idempotency_key: IdempotencyKey = None
) -> Response:
    state = api_state(request)
    if media_type(request) == "multipart/form-data":
        submitted = await submit_upload(request, state, principal, idempotency_key)
        return submitted_response(submitted)
    raw = await json_bytes(request, state.settings.max_body_bytes)
    return await submit_json(state, principal, raw, idempotency_key)


async def submit_json(
    state: ApiState, principal: Principal, raw: bytes, idempotency_key: str | None
) -> Response:
    """A JSON submission's body (as sent) checked, stored and answered: the route's work,
    also done by :mod:`kiln.api.hot_paths` without the router."""
    body = validated(SubmitRequest, parse_json(raw))
    checked = submission(state, principal, body, idempotency_key)
    if checked.references:  # inputs named by reference (docs/uploads.md)
        submitted = await submit_with_inputs(state, checked)
    else:
        await state.app.admit(checked)
        submitted = await submit(state, checked)
    return submitted_response(submitted)


def submitted_response(submitted: Submitted) -> Response:
    status_code, headers = _submit_answer(submitted.result)
    return standing_response(
        submitted.standing,
        status_code=status_code,
        deduplicated=submitted.result.deduplicated,
        headers=headers,
    )


# Reads ----------------------------------------------------------------------------------


@router.get(
    "/tasks/{task_id}",
    summary="Get a task",
    response_model=TaskOut,
    responses=error_responses(401, 404, 422),
)
async def get_task(task_id: str, request: Request, principal: Caller) -> Response:
    state = api_state(request)
    task, position = await state.app.standing(task_id, principal.scope)  # one store read
    return standing_response(await standing(state, task, position))


@router.get(
    "/tasks",
    summary="List tasks, newest first",
    response_model=TaskList,
    responses=error_responses(401, 422),
)
async def list_tasks(
    request: Request,
    principal: Caller,
    status: Annotated[
        Status | None,
        BeforeValidator(_status_of),
        Query(description="a status, in any case"),
    ] = None,
    kind: Annotated[str | None, BeforeValidator(_blank_to_none), Query()] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[
        str | None,
        BeforeValidator(_blank_to_none),
        Query(
            description="`next_cursor` of the previous page (anything else: 422 `invalid_cursor`)",
            json_schema_extra={"pattern": f"^{CURSOR_PATTERN.pattern}$"},
        ),
    ] = None,
) -> Response:
    state = api_state(request)
    tasks, next_cursor = await state.app.list_tasks(
        tenant=principal.scope, status=status, kind=kind, limit=limit, cursor=cursor
    )
    positions = await state.app.queue_positions(tasks)  # one count per level, not per row
    waits = await asyncio.gather(*(state.app.pool_wait(t) for t in tasks))
    items = [
        task_json(t, queue_position=positions.get(t.id), resource_wait=w)
        for t, w in zip(tasks, waits, strict=True)
    ]
    return RenderedJSON({"items": items, "next_cursor": next_cursor})


@router.get(
    "/stats",
    summary="Counts, dwell times, failures and ghosts of the tenant's tasks",
    response_model=StatsOut,
    responses=error_responses(401, 422),
)
async def stats(request: Request, principal: Caller) -> Response:
    app = api_state(request).app
    found = await app.stats(principal.scope)
    pools = await app.pools()
    body: JSON = {
        "counts": found.counts,
        "dwell_seconds": found.dwell_seconds,
        "failures": found.failures,
        "failures_last_hour": found.failures_last_hour,
        "ghosts": found.ghosts,
        "pools": {p.name: p.to_json() for p in pools},
        "breakers": breakers_json(await app.shared_breakers(), app.now()),
    }
    if principal.may_review:  # the admin (or anyone, auth off): GET /v1/workers's list too
        workers = await app.operations.workers()
        body["workers"] = [worker.to_json() for worker in workers]
        load = await app.operations.autoscaling(workers=workers, pools=pools)
        body["autoscaling"] = load.to_json()
    return JSONResponse(body)


# Actions --------------------------------------------------------------------------------


@router.post(
    "/tasks/{task_id}/cancel",
    summary="Cancel a task (a running one is asked to stop: cancel_requested)",
    response_model=TaskOut,
    responses=error_responses(401, 404, 409, 422),
)
async def cancel_task(task_id: str, request: Request, principal: Caller) -> Response:
    state = api_state(request)
    return await task_response(state, await state.app.cancel(task_id, principal.scope))


@router.post(
    "/tasks/{task_id}/retry",
    summary="Retry a final FAILED, TIMEOUT or CANCELLED task now",
    response_model=TaskOut,
    responses=error_responses(401, 404, 409, 422),
)
async def retry_task(task_id: str, request: Request, principal: Caller) -> Response:
    state = api_state(request)
    return await task_response(state, await state.app.retry(task_id, principal.scope))


@router.post(
    "/tasks/{task_id}/review",
    summary="Approve or reject a task in NEEDS_REVIEW (admin key only)",
    response_model=TaskOut,
    responses=error_responses(401, 403, 404, 409, 413, 415, 422),
    openapi_extra=_body_doc(ReviewRequest),
)
async def review_task(task_id: str, request: Request, principal: Caller) -> Response:
    require_reviewer(principal)
    state = api_state(request)
    body = validated(ReviewRequest, await json_body(request, state.settings.max_body_bytes))
    await state.app.get(task_id, principal.scope)
    task = await state.app.review(task_id, body.decision, body.reason)
    return await task_response(state, task)


# Outputs --------------------------------------------------------------------------------


def find_output(task: Task, name: str) -> StoredOutput:
    """The recorded output ``name`` of a SUCCESS task; NotFound otherwise."""
    missing = NotFound(f"task {task.id} has no output {name!r}")
    if task.status is not Status.SUCCESS or task.result is None:
        raise NotFound(f"task {task.id} has no outputs until it is SUCCESS")
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise missing
    for raw in task.result.get("outputs", []):
        output = StoredOutput.from_json(raw)
        if output.name == name and output.key.startswith(f"tasks/{task.id}/"):
            return output
    raise missing


def etag_matches(if_none_match: str | None, sha256: str) -> bool:
    if if_none_match is None:
        return False
    for tag in if_none_match.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/") == f'"{sha256}"':
            return True
    return False


@router.get(
    "/tasks/{task_id}/outputs/{name}",
    summary="Download an output of a SUCCESS task",
    response_class=Response,
    responses={
        200: {
            "description": "The output's bytes; `ETag` is the sha256 in quotes",
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        },
        304: {"description": "Not modified (If-None-Match matched the ETag)"},
        307: {
            "description": "With KILN_OUTPUT_URLS=presigned and a storage that can presign: "
            "`Location` is a URL that serves the bytes for KILN_PRESIGN_TTL_S seconds"
        },
        **error_responses(401, 404, 422),
    },
)
async def get_output(
    task_id: str,
    name: str,
    request: Request,
    principal: Caller,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
) -> Response:
    state = api_state(request)
    output = find_output(await state.app.get(task_id, principal.scope), name)
    etag = f'"{output.sha256}"'
    headers = {"ETag": etag, "Cache-Control": "private, no-cache"}
    if etag_matches(if_none_match, output.sha256):
        return Response(status_code=304, headers=headers)
    if state.settings.output_urls == "presigned":
        url = await state.app.storage.presign(output.key, state.settings.presign_ttl_s)
        if url is not None:  # the signed URL expires: a cache must not keep the redirect
            return RedirectResponse(url, 307, headers={"ETag": etag, "Cache-Control": "no-store"})
    headers["Content-Disposition"] = f"inline; filename*=UTF-8''{quote(output.name, safe='')}"
    headers["X-Content-Type-Options"] = "nosniff"
    path = state.app.storage.local_path(output.key)
    if path is not None and await asyncio.to_thread(path.is_file):
        return FileResponse(path, media_type=output.content_type, headers=headers)
    try:
        data = await state.app.storage.get(output.key)
    except FileNotFoundError:
        log.error("output_missing", extra={"task_id": task_id, "output": name})
        raise NotFound(f"output {name!r} of task {task_id} is missing from storage") from None
    return Response(data, media_type=output.content_type, headers=headers)
