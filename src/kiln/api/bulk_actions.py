"""Bulk cancel and bulk retry by filter: ``POST /v1/tasks/cancel`` and ``/v1/tasks/retry``.

A tenant's key acts on its own tasks only (a ``tenant`` in the filter must be its own);
the admin key acts across tenants and may narrow to one with ``tenant``. Each request is
one page, one transaction (see :mod:`kiln.bulk_actions`); the answer's ``cursor`` asks for
the next page. Bad input is answered with the error envelope and changes nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln import bulk_actions
from kiln.api import tasks
from kiln.api.auth import Principal
from kiln.api.errors import error_responses
from kiln.api.schemas import _integral
from kiln.api.state import api_state
from kiln.errors import Forbidden

router = APIRouter(prefix="/v1")

_Names = Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=100)]
#: The newest moment the filter's times are documented up to (9999-12-31T23:59:59Z).
LAST_S = 253402300799


def _moment_schema(schema: dict[str, Any]) -> None:
    schema.clear()
    schema.update(
        {
            "anyOf": [
                {"type": "number", "minimum": 0, "maximum": LAST_S},
                {"type": "string", "pattern": r"^[0-9]{1,9}(\.[0-9]{1,6})?(s|m|h|d|w)$"},
                {"type": "string", "format": "date-time"},
                {"type": "null"},
            ],
            "description": "unix seconds, a duration before now (90s, 15m, 1h, 2d, 1w), or an "
            "RFC 3339 time with its offset (2026-01-01T09:00:00Z)",
        }
    )


_Moment = Annotated[float | str | None, Field(json_schema_extra=_moment_schema)]
CancelStatus = Literal[
    "PENDING", "WAITING_FOR_RESOURCE", "GENERATING", "UPLOADING", "NEEDS_REVIEW", "RETRYING"
]
RetryStatus = Literal["FAILED", "TIMEOUT", "CANCELLED"]
_STATUS_HELP = "default: every status the action applies to"


def _narrow_or_all(schema: dict[str, Any]) -> None:
    """The request's schema: a filter that names something, or ``all`` true. Whether a
    time leaves any task out (``created_after: 0`` does not, nor a ``created_before``
    after now) depends on the moment of the request: the server checks it (422 with
    ``loc`` ``["body", "filter"]``, docs/pipelines.md), so the document takes any time."""
    named: list[dict[str, Any]] = [
        {"required": [name], "properties": {name: {"minItems": 1}}}
        for name in ("status", "kind", "code")
    ]
    named += [
        {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
        for name in ("created_after", "created_before")
    ]
    schema["anyOf"] = [
        {"required": ["all"], "properties": {"all": {"const": True}}},
        {"required": ["filter"], "properties": {"filter": {"anyOf": named}}},
    ]


class _FilterIn(BaseModel):
    """Which tasks: every field given narrows; lists match any of their values."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    kind: _Names = []
    code: Annotated[_Names, Field(description="the latest failure's error.code")] = []
    tenant: Annotated[
        str | None, Field(max_length=200, description="admin key: one tenant's tasks only")
    ] = None
    created_after: _Moment = None
    created_before: _Moment = None


class CancelFilterIn(_FilterIn):
    status: Annotated[list[CancelStatus], Field(max_length=10, description=_STATUS_HELP)] = []


class RetryFilterIn(_FilterIn):
    status: Annotated[list[RetryStatus], Field(max_length=10, description=_STATUS_HELP)] = []


#: The cursor as a page gives it: the id of its last task. Any such text is a place to
#: resume after.
CURSOR_PATTERN = f"^{bulk_actions.CURSOR_TEXT}$"


class _ActionRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=_narrow_or_all
    )

    all: Annotated[bool, Field(description="required to act with an empty filter")] = False
    dry_run: Annotated[bool, Field(description="only count the matching tasks")] = False
    limit: Annotated[int, Field(ge=1, le=bulk_actions.MAX_LIMIT), BeforeValidator(_integral)] = (
        bulk_actions.DEFAULT_LIMIT
    )
    cursor: Annotated[
        str | None,
        Field(
            max_length=400,
            json_schema_extra={"pattern": CURSOR_PATTERN},
            description="the previous page's cursor: resume after it",
        ),
    ] = None


class CancelRequest(_ActionRequest):
    """``POST /v1/tasks/cancel``: one page of a bulk cancel."""

    filter: CancelFilterIn = Field(default_factory=CancelFilterIn)


class RetryRequest(_ActionRequest):
    """``POST /v1/tasks/retry``: one page of a bulk retry."""

    filter: RetryFilterIn = Field(default_factory=RetryFilterIn)


REQUESTS: dict[str, type[CancelRequest] | type[RetryRequest]] = {
    "cancel": CancelRequest,
    "retry": RetryRequest,
}


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
    filter: Annotated[
        dict[str, Any],
        Field(description="the filter with its times as unix seconds: send it for the next page"),
    ]


async def _act(action: str, request: Request, principal: Principal) -> Response:
    state = api_state(request)
    body = tasks.validated(
        REQUESTS[action], await tasks.json_body(request, state.settings.max_body_bytes)
    )
    wanted = body.filter.tenant
    if principal.scope is not None and wanted is not None and wanted != principal.scope:
        raise Forbidden(f"this key acts on tenant {principal.scope!r}'s tasks only")
    raw = bulk_actions.FilterIn(**body.filter.model_dump())
    found = bulk_actions.filter_of(
        action, raw, scope=principal.scope, everything=body.all, now=state.app.now()
    )
    answer = await state.app.bulk_action(
        action, found, dry_run=body.dry_run, limit=body.limit, cursor=body.cursor
    )
    resolved = body.filter.model_dump(exclude_defaults=True)
    for field in ("created_after", "created_before"):
        if field in resolved:  # a relative time, fixed: every page names the same tasks
            resolved[field] = getattr(found, field)
    answer["filter"] = resolved
    return JSONResponse(answer)


@router.post(
    "/tasks/cancel",
    summary="Cancel the tasks a filter names, a page at a time (dry_run: count them)",
    response_model=BulkActionOut,
    responses=error_responses(401, 403, 413, 415, 422),
    openapi_extra=tasks._body_doc(CancelRequest),
)
async def cancel_tasks(request: Request, principal: tasks.Caller) -> Response:
    return await _act("cancel", request, principal)


@router.post(
    "/tasks/retry",
    summary="Retry the final tasks a filter names, a page at a time (dry_run: count them)",
    response_model=BulkActionOut,
    responses=error_responses(401, 403, 413, 415, 422),
    openapi_extra=tasks._body_doc(RetryRequest),
)
async def retry_tasks(request: Request, principal: tasks.Caller) -> Response:
    return await _act("retry", request, principal)
