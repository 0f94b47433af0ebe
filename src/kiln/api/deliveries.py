"""A task's webhook deliveries: ``GET /v1/tasks/{id}/webhooks`` lists them with how their
attempts went; ``POST /v1/tasks/{id}/webhooks/{delivery_id}/redeliver`` (admin key only)
sends one again, with the same event id, so a receiver that keeps the ids drops a repeat.
See docs/webhooks.md."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.api.errors import error_responses
from kiln.api.schemas import DeliveriesOut, DeliveryOut
from kiln.api.state import api_state
from kiln.api.tasks import Caller
from kiln.errors import Forbidden
from kiln.webhooks import delivery_json

router = APIRouter(prefix="/v1")


@router.get(
    "/tasks/{task_id}/webhooks",
    summary="The task's webhook deliveries and how their attempts went",
    response_model=DeliveriesOut,
    responses=error_responses(401, 404, 422),
)
async def list_deliveries(task_id: str, request: Request, principal: Caller) -> Response:
    app = api_state(request).app
    task = await app.get(task_id, principal.scope)
    found = await app.webhook_deliveries(task.id, principal.scope)
    body = {"task_id": task.id, "webhook": task.webhook, "items": [delivery_json(d) for d in found]}
    return JSONResponse(body)


@router.post(
    "/tasks/{task_id}/webhooks/{delivery_id}/redeliver",
    summary="Send a webhook delivery again, now, with the same event id (admin key only)",
    response_model=DeliveryOut,
    responses=error_responses(401, 403, 404, 422),
)
async def redeliver(
    task_id: str, delivery_id: str, request: Request, principal: Caller
) -> Response:
    if not principal.may_review:  # the admin, or anyone when auth is off
        raise Forbidden("only the admin key may redeliver webhooks")
    found = await api_state(request).app.redeliver(task_id, delivery_id, principal.scope)
    return JSONResponse(delivery_json(found))
