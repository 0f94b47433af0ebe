"""``GET /v1/workers``: the live worker processes (the worker registry), for the admin."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.api.errors import error_responses
from kiln.api.schemas import WorkersOut
from kiln.api.state import api_state
from kiln.api.tasks import Caller
from kiln.errors import Forbidden

router = APIRouter(prefix="/v1")


@router.get(
    "/workers",
    summary="The live worker processes: kinds, slots, attempts, models (admin key only)",
    response_model=WorkersOut,
    responses=error_responses(401, 403),
)
async def list_workers(request: Request, principal: Caller) -> Response:
    if not principal.may_review:  # the admin, or anyone when auth is off
        raise Forbidden("only the admin key may list the workers")
    found = await api_state(request).app.operations.workers()
    return JSONResponse({"workers": [worker.to_json() for worker in found]})
