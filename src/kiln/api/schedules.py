"""The schedule routes: recurring submissions on a cron expression in a time zone.

``POST /v1/schedules`` checks everything a tick's submission would need (the cron
expression, the zone, the kind, its params, the options) before it stores anything, so a
tick never fails on what could have been refused at once. Schedules belong to a tenant as
tasks do: another tenant's schedule is ``404 not_found``; the admin key sees them all. A
tenant holds at most KILN_MAX_SCHEDULES_PER_TENANT schedules (``409 too_many_schedules``;
the admin key is exempt). The leading supervisor fires the ticks (:mod:`kiln.scheduler`),
each counted against its tenant's rate.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln import canonical
from kiln.api.errors import error_responses
from kiln.api.schemas import JSONObject, SubmitRequest
from kiln.api.state import ApiState, api_state
from kiln.api.tasks import Caller, _blank_to_none, _body_doc, json_body, validated
from kiln.app_parts import ScheduleRecord
from kiln.errors import InvalidRequest
from kiln.timing import Cron

router = APIRouter(prefix="/v1")

SCHEDULES_PATH = "/v1/schedules"
#: A schedule's id, which is also a page's cursor.
SCHEDULE_ID = re.compile(r"sch_[0-9a-hjkmnp-tv-z]{26}")


class ScheduleRequest(BaseModel):
    """``POST /v1/schedules``: a cron expression, its time zone, and the task each tick
    submits (the body of ``POST /v1/tasks``, without ``run_at`` and ``delay_s``)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    cron: Annotated[
        str,
        Field(
            min_length=1,
            max_length=200,
            description="five fields (minute hour day month weekday), or six with seconds first",
            examples=["0 9 * * 1-5"],
        ),
    ]
    timezone: Annotated[
        str, Field(min_length=1, max_length=64, description="an IANA zone", examples=["UTC"])
    ] = "UTC"
    task: SubmitRequest
    overlap: Annotated[
        Literal["skip", "queue"],
        Field(description="skip: a tick is skipped while the last tick's task is not final"),
    ] = "skip"
    missed: Annotated[
        Literal["fire_once", "skip"],
        Field(description="ticks missed by more than a minute: fire the latest once, or skip"),
    ] = "fire_once"
    paused: bool = False


class ScheduleOut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    cron: str
    timezone: str
    kind: str
    task: JSONObject
    overlap: str
    missed: str
    paused: bool
    #: The next tick (null while paused).
    next_run_at: AwareDatetime | None
    last_task_id: str | None
    last_fired_at: AwareDatetime | None
    fired: int
    skipped: int
    created_at: AwareDatetime
    updated_at: AwareDatetime


class ScheduleList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ScheduleOut]
    next_cursor: str | None


def submission_of(state: ApiState, task: SubmitRequest) -> dict[str, Any]:
    """What each tick submits, checked as a submission is (422 for a bad kind, params,
    metadata or webhook), with its defaults filled in."""
    if task.run_at is not None or task.delay_s is not None:
        raise InvalidRequest(
            "a schedule's task runs at its ticks: give no run_at or delay_s",
            details=[{"loc": ["body", "task", "run_at"], "msg": "not here", "type": "value_error"}],
        )
    if task.inputs:
        raise InvalidRequest(
            "a schedule's task cannot name inputs by reference: its ticks submit no inputs",
            details=[{"loc": ["body", "task", "inputs"], "msg": "not here", "type": "value_error"}],
        )
    app = state.app
    given = task.timeouts
    timeouts = app.timeouts_of(
        task.kind,
        waiting_s=None if given is None else given.waiting_s,
        generating_s=None if given is None else given.generating_s,
        uploading_s=None if given is None else given.uploading_s,
    )
    checked = app.submission(
        task.kind,
        task.params,
        metadata=task.metadata,
        webhook_url=task.webhook_url,
        webhook_events=task.webhook_events,
        timeouts=timeouts,
    )
    return {
        "kind": task.kind,
        "params": checked.params,
        "priority": task.priority,
        "max_attempts": task.max_attempts,
        "deadline_s": task.deadline_s,
        "timeouts": {
            "waiting_s": timeouts.waiting_s,
            "generating_s": timeouts.generating_s,
            "uploading_s": timeouts.uploading_s,
        },
        "metadata": task.metadata,
        "webhook": checked.webhook,
    }


def _answer(schedule: ScheduleRecord, status_code: int = 200) -> Response:
    headers = {"Location": f"{SCHEDULES_PATH}/{schedule.id}"} if status_code == 201 else None
    return JSONResponse(schedule.to_json(), status_code=status_code, headers=headers)


@router.post(
    "/schedules",
    summary="Create a recurring schedule",
    status_code=201,
    response_model=ScheduleOut,
    responses=error_responses(401, 409, 413, 415, 422),
    openapi_extra=_body_doc(ScheduleRequest),
)
async def create_schedule(request: Request, principal: Caller) -> Response:
    state = api_state(request)
    body = validated(ScheduleRequest, await json_body(request, state.settings.max_body_bytes))
    now = state.app.now()
    cron = Cron.parse(body.cron, body.timezone, now=now)
    submission = submission_of(state, body.task)  # each tick is one request
    record = ScheduleRecord(
        id=canonical.new_id("sch_"),
        tenant=principal.tenant,
        cron=cron.expression,
        timezone=cron.timezone,
        submission=submission,
        overlap=body.overlap,
        missed=body.missed,
        paused=body.paused,
        next_at=cron.next_after(now),
    )
    most = None if principal.admin else state.settings.max_schedules_per_tenant
    return _answer(await state.app.schedules.create(record, most=most), 201)


@router.get(
    "/schedules",
    summary="List schedules, oldest first",
    response_model=ScheduleList,
    responses=error_responses(401, 422),
)
async def list_schedules(
    request: Request,
    principal: Caller,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[
        str | None,
        BeforeValidator(_blank_to_none),
        Query(
            description="next_cursor of the previous page",
            json_schema_extra={"pattern": f"^{SCHEDULE_ID.pattern}$"},
        ),
    ] = None,
) -> Response:
    if cursor is not None and SCHEDULE_ID.fullmatch(cursor) is None:
        raise InvalidRequest(
            "the cursor is not one a page gave: pass next_cursor of the previous page as is",
            details=[{"loc": ["query", "cursor"], "msg": "malformed cursor", "type": "cursor"}],
        )
    schedules = api_state(request).app.schedules
    found = await schedules.list(scope=principal.scope, limit=limit + 1, after=cursor)
    page = found[:limit]
    next_cursor = page[-1].id if len(found) > limit else None
    return JSONResponse({"items": [s.to_json() for s in page], "next_cursor": next_cursor})


@router.get(
    "/schedules/{schedule_id}",
    summary="Get a schedule",
    response_model=ScheduleOut,
    responses=error_responses(401, 404),
)
async def get_schedule(schedule_id: str, request: Request, principal: Caller) -> Response:
    return _answer(await api_state(request).app.schedules.get(schedule_id, principal.scope))


@router.post(
    "/schedules/{schedule_id}/pause",
    summary="Pause a schedule: no tick fires until it is resumed",
    response_model=ScheduleOut,
    responses=error_responses(401, 404),
)
async def pause_schedule(schedule_id: str, request: Request, principal: Caller) -> Response:
    return await _set_paused(request, principal.scope, schedule_id, paused=True)


@router.post(
    "/schedules/{schedule_id}/resume",
    summary="Resume a schedule from its next tick after now (paused ticks are not fired)",
    response_model=ScheduleOut,
    responses=error_responses(401, 404),
)
async def resume_schedule(schedule_id: str, request: Request, principal: Caller) -> Response:
    return await _set_paused(request, principal.scope, schedule_id, paused=False)


async def _set_paused(
    request: Request, scope: str | None, schedule_id: str, *, paused: bool
) -> Response:
    schedules = api_state(request).app.schedules
    return _answer(await schedules.set_paused(schedule_id, paused=paused, scope=scope))


class Deleted(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    deleted: Literal[True]


@router.delete(
    "/schedules/{schedule_id}",
    summary="Delete a schedule (the tasks it made stay)",
    response_model=Deleted,
    responses=error_responses(401, 404),
)
async def delete_schedule(schedule_id: str, request: Request, principal: Caller) -> Response:
    await api_state(request).app.schedules.delete(schedule_id, principal.scope)
    return JSONResponse({"id": schedule_id, "deleted": True})
