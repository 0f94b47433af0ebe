"""Bulk cancel and bulk retry by filter: ``POST /v1/tasks/cancel`` and ``/v1/tasks/retry``.

A tenant's key acts on its own tasks only (a ``tenant`` in the filter must be its own);
the admin key acts across tenants and may narrow to one with ``tenant``. Each request is
one page, one transaction (see :mod:`kiln.bulk_actions`); the answer's ``cursor`` asks for
the next page. Bad input is answered with the error envelope and changes nothing.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln import bulk_actions
from kiln.api import tasks
from kiln.api.auth import Principal
from kiln.api.errors import error_responses
from kiln.api.state import api_state
from kiln.errors import Forbidden

router = APIRouter(prefix="/v1")

_Names = Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=100)]
_Moment = Annotated[
    float | str | None,
    Field(description="unix seconds, an RFC 3339 time, or a duration before now: 90s, 15m, 1h, 2d"),
]


class BulkFilterIn(BaseModel):
    """Which tasks: every field given narrows; lists match any of their values."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    status: Annotated[_Names, Field(description="default: every status the action applies to")] = []
    kind: _Names = []
    code: Annotated[_Names, Field(description="the latest failure's error.code")] = []
    tenant: Annotated[
        str | None, Field(max_length=200, description="admin key: one tenant's tasks only")
    ] = None
    created_after: _Moment = None
    created_before: _Moment = None


class BulkActionRequest(BaseModel):
    """``POST /v1/tasks/cancel`` and ``/v1/tasks/retry``: one page of the action."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    filter: BulkFilterIn = Field(default_factory=BulkFilterIn)
    all: Annotated[bool, Field(description="required to act with an empty filter")] = False
    dry_run: Annotated[bool, Field(description="only count the matching tasks")] = False
    limit: Annotated[int, Field(ge=1, le=bulk_actions.MAX_LIMIT)] = bulk_actions.DEFAULT_LIMIT
    cursor: Annotated[str | None, Field(max_length=400)] = None


class BulkActionOut(BaseModel):
    """One page's answer (a dry run: ``matched`` is the count, ``cursor`` null)."""

    action: str
    dry_run: bool
    matched: int
    cancelled: int | None = None
    cancel_requested: int | None = None
    retried: int | None = None
    skipped: int
    cursor: str | None
    task_ids: list[str] | None = None


async def _act(action: str, request: Request, principal: Principal) -> Response:
    state = api_state(request)
    body = tasks.validated(
        BulkActionRequest, await tasks.json_body(request, state.settings.max_body_bytes)
    )
    wanted = body.filter.tenant
    if principal.scope is not None and wanted is not None and wanted != principal.scope:
        raise Forbidden(f"this key acts on tenant {principal.scope!r}'s tasks only")
    raw = bulk_actions.FilterIn(**body.filter.model_dump())
    found = bulk_actions.filter_of(
        action, raw, scope=principal.scope, everything=body.all, now=state.app.now()
    )
    answer = await bulk_actions.bulk_action(
        state.app.engine, action, found, dry_run=body.dry_run, limit=body.limit, cursor=body.cursor
    )
    return JSONResponse(answer)


@router.post(
    "/tasks/cancel",
    summary="Cancel the tasks a filter names, a page at a time (dry_run: count them)",
    response_model=BulkActionOut,
    responses=error_responses(401, 403, 413, 415, 422),
    openapi_extra=tasks._body_doc(BulkActionRequest),
)
async def cancel_tasks(request: Request, principal: tasks.Caller) -> Response:
    return await _act("cancel", request, principal)


@router.post(
    "/tasks/retry",
    summary="Retry the final tasks a filter names, a page at a time (dry_run: count them)",
    response_model=BulkActionOut,
    responses=error_responses(401, 403, 413, 415, 422),
    openapi_extra=tasks._body_doc(BulkActionRequest),
)
async def retry_tasks(request: Request, principal: tasks.Caller) -> Response:
    return await _act("retry", request, principal)
