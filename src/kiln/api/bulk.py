"""Bulk routes: many submissions in one request (``POST /v1/tasks/batch``), and a task
run again with changes (``POST /v1/tasks/{id}/rerun``).

Each item is a submission as ``POST /v1/tasks`` takes it and is answered on its own: a
refused item stores nothing and does not stop the others. The body is parsed and checked,
and the answer rendered, in a thread; the accepted items are submitted concurrently, a
window of them at a time, so the store commits them together (the SQLite writer thread
and PostgreSQL's batcher each take the writes waiting at once into one transaction) while
the loop stays free for other requests.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from kiln import limits, wire
from kiln.api import tasks
from kiln.api.auth import Principal
from kiln.api.errors import envelope, error_responses, status_of, validation_details
from kiln.api.schemas import BatchItemIn, BatchOut, BatchRequest, RerunRequest, TaskOut
from kiln.api.state import ApiState, api_state
from kiln.api.strict_json import RenderedJSON, parse_json
from kiln.errors import InvalidRequest, KilnError, RateLimited, UnsupportedMediaType
from kiln.models import JSON
from kiln.submission import Submission
from kiln.wire import task_json

router = APIRouter(prefix="/v1")


def refused(index: int, error: KilnError) -> JSON:
    """A refused item: nothing stored, the error object of the envelope."""
    if status_of(error) >= 500:  # an outage is the whole request's answer, not an item's
        raise error
    body = envelope(error.code, error.message, error.details)["error"]
    return {"index": index, "status": "refused", "task": None, "error": body}


def checked(state: ApiState, principal: Principal, index: int, raw: Any) -> Submission:
    """Item ``index`` as a submission, refused (InvalidRequest, UnknownKind) as
    ``POST /v1/tasks`` would refuse it."""
    try:
        item = BatchItemIn.model_validate(raw)
    except pydantic.ValidationError as exc:
        where = ("body", "tasks", index)
        details = validation_details([{**e, "loc": (*where, *e["loc"])} for e in exc.errors()])
        raise InvalidRequest(f"item {index} is not a valid submission", details=details) from None
    return tasks.submission(state, principal, item, item.idempotency_key)


def checked_items(
    state: ApiState, principal: Principal, items: list[JSON]
) -> tuple[dict[int, JSON], dict[int, Submission]]:
    """Each item checked as a submission: the refused items' answers and the valid items
    (each knows the tasks it creates: a pipeline, itself and every copy of its steps).
    Once the valid items pass KILN_MAX_TASKS_PER_REQUEST the batch is refused whole
    (TooManyTasks, 413), before the rest are checked: the count given adds the tasks the
    rest ask for."""
    most = state.settings.max_tasks_per_request
    answers: dict[int, JSON] = {}
    accepted: dict[int, Submission] = {}
    total = 0
    for index, raw in enumerate(items):
        try:
            accepted[index] = item = checked(state, principal, index, raw)
        except KilnError as exc:
            answers[index] = refused(index, exc)
            continue
        total += item.tasks
        if total > most:
            rest = items[index + 1 :]
            asked = sum(limits.tasks_in(str(r.get("kind")), r.get("params")) for r in rest)
            limits.check_tasks_per_request(total + asked, most)
    return answers, accepted


async def submitted(state: ApiState, index: int, item: Submission) -> JSON:
    try:
        if item.references:
            done = await tasks.submit_with_inputs(state, item, rate=False)
        else:
            done = await tasks.submit(state, item)
    except KilnError as exc:
        return refused(index, exc)
    result = done.result
    status = "created" if result.created else "replayed" if result.replayed else "deduplicated"
    found = done.standing
    task = task_json(
        found.task,
        queue_position=found.queue_position,
        deduplicated=result.deduplicated,
        resource_wait=found.resource_wait,
    )
    return {"index": index, "status": status, "task": task, "error": None}


@router.post(
    "/tasks/batch",
    summary="Submit up to 1,000 tasks; each item is answered on its own",
    response_model=BatchOut,
    responses=error_responses(401, 413, 415, 422),
    openapi_extra=tasks._body_doc(BatchRequest),
)
async def submit_batch(request: Request, principal: tasks.Caller) -> Response:
    state = api_state(request)
    if wire.IDEMPOTENCY_HEADER in request.headers:  # not a parameter: items take keys
        raise InvalidRequest(
            "a batch takes no Idempotency-Key header: give each item its own "
            "idempotency_key (each item is replayed on its own)",
            details=[
                {
                    "loc": ["header", wire.IDEMPOTENCY_HEADER],
                    "msg": "use each item's idempotency_key",
                    "type": "value_error",
                }
            ],
        )
    raw = await tasks.json_bytes(request, state.settings.max_body_bytes)
    # The CPU a batch takes (parsing and checking up to 1,000 items, rendering the answer)
    # runs in a thread, so that the loop serves other requests meanwhile.
    answers, accepted = await asyncio.to_thread(check_batch, state, principal, raw)
    allowed = await state.app.admit_all(accepted)
    for index in accepted.keys() - set(allowed):
        answers[index] = refused(index, rate_limited(state, principal.tenant))
    done = await submit_windowed(state, accepted, allowed)
    answers.update((answer["index"], answer) for answer in done)
    items = [answers[i] for i in range(len(answers))]
    return await asyncio.to_thread(RenderedJSON, {"items": items})


def check_batch(
    state: ApiState, principal: Principal, raw: bytes
) -> tuple[dict[int, JSON], dict[int, Submission]]:
    """The batch body's items checked (:func:`checked_items`)."""
    body = tasks.validated(BatchRequest, parse_json(raw))
    return checked_items(state, principal, body.tasks)


#: Submissions in flight at once: the store commits those waiting together, and no more
#: than these resume on the loop at once when a commit returns.
IN_FLIGHT = 50


async def submit_windowed(
    state: ApiState, accepted: dict[int, Submission], allowed: list[int]
) -> list[JSON]:
    """Every allowed item submitted, IN_FLIGHT at a time: what a submission takes on the
    loop before and after its write (validation, fingerprints, its answer) then comes in
    small turns, never for the whole batch at once, and other requests are served between
    them."""
    window = asyncio.Semaphore(IN_FLIGHT)

    async def one(index: int) -> JSON:
        async with window:
            return await submitted(state, index, accepted[index])

    return list(await asyncio.gather(*(one(i) for i in allowed)))


def rate_limited(state: ApiState, tenant: str) -> RateLimited:
    rate = state.app.settings.tenant_limit(tenant).rate
    per_s = rate.per_s if rate is not None else 0
    return RateLimited(
        f"tenant {tenant!r} may submit {per_s:g} tasks a second; this item was not "
        "submitted (KILN_TENANT_LIMITS or KILN_TENANT_RATE_PER_S allows more)",
        retry_after_s=1 / per_s if per_s else 1,
    )


def _optional_body(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    doc = tasks._body_doc(model)
    doc["requestBody"]["required"] = False
    return doc


@router.post(
    "/tasks/{task_id}/rerun",
    summary="Run a task again as a new task (same kind), with params changed",
    status_code=201,
    response_model=TaskOut,
    responses={
        201: {
            "description": "The new task; its `rerun_of` is the original's id",
            "headers": tasks._SUBMIT_HEADERS,
        },
        200: {
            "model": TaskOut,
            "description": "With dedup (the default): an identical live or successful "
            "task, `deduplicated: true`; or a replay of the Idempotency-Key",
            "headers": tasks._REPLAY_HEADERS,
        },
        **error_responses(401, 404, 413, 415, 422, 429),
    },
    openapi_extra=_optional_body(RerunRequest),
)
async def rerun_task(
    task_id: str,
    request: Request,
    principal: tasks.Caller,
    idempotency_key: tasks.IdempotencyKey = None,
) -> Response:
    state = api_state(request)
    raw = await tasks.read_body(request, state.settings.max_body_bytes)
    body = RerunRequest()  # no body: the same params
    if raw.strip():
        if not tasks._is_json(tasks.media_type(request)):
            raise UnsupportedMediaType("send the body as JSON, with Content-Type: application/json")
        body = tasks.validated(RerunRequest, parse_json(raw))
    result = await state.app.rerun(
        task_id,
        tenant=principal.scope,
        params=body.params,
        priority=body.priority,
        dedup=body.dedup,
        idempotency_key=idempotency_key,
    )
    status_code, headers = tasks._submit_answer(result)
    return tasks.standing_response(
        await tasks.standing(state, result.task),
        status_code=status_code,
        deduplicated=result.deduplicated,
        headers=headers,
    )
