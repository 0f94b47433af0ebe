"""``GET /v1/usage``: the GPU-second ledger summed over a window, by the keys asked for.

A tenant's key sees its own attempts only, and never which worker ran them (``group_by``
``worker`` is 403 ``forbidden`` for it: worker ids name the deployment's hosts); the admin
sees every tenant's, or one tenant's with ``tenant=``. Times are RFC 3339 (a bare date is
that day's midnight UTC); the window holds the attempts that ended at or after ``from``
and before ``to`` (none when ``from`` is not before ``to``).
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.api.errors import error_responses
from kiln.api.schemas import UsageOut
from kiln.api.state import api_state
from kiln.api.tasks import Caller
from kiln.app_parts import MAX_USAGE_GROUPS as MAX_GROUPS
from kiln.app_parts import USAGE_GROUPS as GROUPS
from kiln.errors import Forbidden, InvalidRequest
from kiln.models import iso

router = APIRouter(prefix="/v1")

_GROUP = "(" + "|".join(GROUPS) + ")"
#: What ``group_by`` may be (the OpenAPI schema says it too).
GROUP_BY_PATTERN = f"^({_GROUP}(,{_GROUP})*)?$"
#: The window when ``from`` is not given: this long before ``to`` (from 1970 at the earliest).
DEFAULT_WINDOW_S = 30 * 86400.0
#: The last second RFC 3339 can write (9999-12-31T23:59:59Z): later times are read as it.
LAST_S = 253402300799.0


def parse_time(name: str, text: str) -> float:
    """An RFC 3339 time (or a bare date: its midnight UTC) as seconds since the epoch."""
    try:
        if len(text) == 10:
            day = date.fromisoformat(text)
            return datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()
        moment = datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise InvalidRequest(
            f"{name} must be an RFC 3339 time with its offset (2027-01-15T08:00:00Z) or a date",
            details=[
                {"loc": ["query", name], "msg": f"not a time: {text!r}", "type": "value_error"}
            ],
        )
    return min(max(moment.timestamp(), 0.0), LAST_S)  # the ledger holds nothing outside


def parse_groups(text: str | None) -> list[str]:
    """``tenant,kind,...`` as a list without repeats; an unknown key is refused."""
    names = [part.strip() for part in (text or "").split(",") if part.strip()]
    unknown = [name for name in names if name not in GROUPS]
    if unknown:
        raise InvalidRequest(
            f"group_by takes {', '.join(GROUPS)}; not {', '.join(unknown)}",
            details=[
                {"loc": ["query", "group_by"], "msg": f"unknown key {name!r}", "type": "enum"}
                for name in unknown
            ],
        )
    return list(dict.fromkeys(names))


@router.get(
    "/usage",
    summary="GPU-seconds and the time attempts spent waiting, loading and generating",
    response_model=UsageOut,
    responses=error_responses(401, 403, 422),
)
async def usage(
    request: Request,
    principal: Caller,
    since: Annotated[
        str | None,
        Query(
            alias="from",
            description="RFC 3339 (or a date: its midnight UTC); default 30 days before `to`",
            json_schema_extra={"format": "date-time"},
        ),
    ] = None,
    until: Annotated[
        str | None,
        Query(
            alias="to",
            description="RFC 3339 (or a date); default now",
            json_schema_extra={"format": "date-time"},
        ),
    ] = None,
    group_by: Annotated[
        str | None,
        Query(
            description=f"comma-separated, any of {', '.join(GROUPS)} (`worker`: the admin "
            "key only)",
            json_schema_extra={"pattern": GROUP_BY_PATTERN},
        ),
    ] = None,
    tenant: Annotated[str | None, Query(description="one tenant's (the admin key only)")] = None,
) -> Response:
    app = api_state(request).app
    end = app.now() if until is None else parse_time("to", until)
    start = max(end - DEFAULT_WINDOW_S, 0.0) if since is None else parse_time("from", since)
    groups = parse_groups(group_by)
    if "worker" in groups and not principal.may_review:  # the admin, or anyone (auth off)
        raise Forbidden("only the admin key may group usage by worker")
    scope = principal.scope
    if tenant:
        if scope is not None and tenant != scope:
            raise Forbidden("a tenant's key sees its own usage only")
        scope = tenant
    found = await app.operations.usage(since=start, until=end, group_by=groups, tenant=scope)
    body = {
        "from": iso(start),
        "to": iso(end),
        "group_by": groups,
        "items": [item.to_json() for item in found],
        "truncated": len(found) >= MAX_GROUPS,
    }
    return JSONResponse(body)
