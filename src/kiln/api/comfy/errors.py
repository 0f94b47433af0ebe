"""Comfy API v2 errors: ``{"error": {"code", "message", "details"}}`` with ``details`` an
object or null (v2's shape), and kiln's codes translated to v2's where they differ.

Every route of the v2 router uses :class:`V2Route`, which answers a kiln error (auth,
validation, not found, the store down) raised anywhere in the route, its dependencies
included, in this envelope; the rest of kiln keeps API.md's. What the application answers
outside a route (no such path under ``/api/v2/``, a method a path does not take, a crash)
is in this envelope too on ``/api/v2`` paths (:func:`install`).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.api.errors import status_of, validation_details
from kiln.errors import KilnError, RateLimited, Unauthorized

log = logging.getLogger("kiln.api")

#: The paths of the v2 face.
PREFIX = "/api/v2"

#: kiln code → (v2 code, HTTP status), where the two differ.
V2_CODES: dict[str, tuple[str, int]] = {
    "idempotency_key_reused": ("idempotency_key_reuse", 422),
    "rate_limited": ("queue_full", 429),
    "invalid_cursor": ("invalid_request", 400),
    "unknown_kind": ("unavailable", 503),
    "store_unavailable": ("unavailable", 503),
    "storage_error": ("unavailable", 503),
}
#: v2 codes whose HTTP status is not kiln's.
V2_STATUS: dict[str, int] = {
    "invalid_workflow": 422,
    "workflow_format_ui": 422,
    "missing_asset": 422,
    "hash_mismatch": 409,
    "blob_not_found": 404,
    "output_unavailable": 404,
    "range_not_satisfiable": 416,
    "bad_request": 400,
}


class V2Error(KilnError):
    """An error the v2 contract names: its own code, HTTP status and details object."""

    def __init__(
        self,
        code: str,
        message: str,
        status: int | None = None,
        details: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.status = status or V2_STATUS.get(code) or status_of(self)
        self.object = dict(details) if details else None
        self.headers = dict(headers or {})


def v2_response(
    code: str,
    message: str,
    status: int,
    details: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "details": dict(details or {}) or None}}
    return JSONResponse(body, status_code=status, headers=dict(headers) if headers else None)


def _listed(details: list[Any]) -> dict[str, Any] | None:
    """kiln's list of details as v2's object (``{"errors": [...]}``), or None."""
    return {"errors": details} if details else None


def error_of(exc: KilnError) -> JSONResponse:
    """The v2 answer to a kiln error."""
    if isinstance(exc, V2Error):
        return v2_response(exc.code, exc.message, exc.status, exc.object, exc.headers)
    code, status = V2_CODES.get(exc.code, (exc.code, status_of(exc)))
    headers: dict[str, str] = {}
    message = exc.message
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    elif status == 408:  # the rest of a slow body is never read: the connection must end
        headers["Connection"] = "close"
    elif status == 503:
        headers["Retry-After"] = "1"
        if exc.code != "unknown_kind":
            message = "the store or the storage does not answer; try again shortly"
    elif status >= 500:
        log.error("request_failed", extra={"code": exc.code}, exc_info=exc)
        code, message = "internal_error", "the server failed to answer this request"
    return v2_response(code, message, status, _listed(exc.details), headers)


class V2Route(APIRoute):
    """A route answering kiln's errors and request validation in the v2 envelope."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except KilnError as exc:
                return error_of(exc)
            except RequestValidationError as exc:
                details = validation_details(list(exc.errors()))
                message = "the request is not valid"
                return v2_response("invalid_request", message, 400, _listed(details))

        return answer


Handler = Callable[[Request, Any], Response | Awaitable[Response]]


def is_v2(request: Request) -> bool:
    path = request.url.path
    return path == PREFIX or path.startswith(PREFIX + "/")


def _in_v2_shape(answer: Response) -> Response:
    """kiln's envelope (``details`` a list) as v2's (an object or null), headers kept."""
    if not isinstance(answer, JSONResponse):
        return answer
    error = json.loads(bytes(answer.body))["error"]
    headers = {
        k: v for k, v in answer.headers.items() if k not in ("content-length", "content-type")
    }
    details = error.get("details") or []
    return v2_response(
        error["code"],
        error["message"],
        answer.status_code,
        _listed(details) if isinstance(details, list) else details,
        headers,
    )


def _answering_v2_paths(v1: Handler) -> Handler:
    async def answer(request: Request, exc: Exception) -> Response:
        if is_v2(request) and isinstance(exc, KilnError):
            return error_of(exc)
        answered = v1(request, exc)
        if inspect.isawaitable(answered):
            answered = await answered
        return _in_v2_shape(answered) if is_v2(request) else answered

    return answer


def install(api: FastAPI) -> None:
    """Answer in the v2 envelope, on ``/api/v2`` paths, what kiln's application-wide
    handlers (:func:`kiln.api.errors.install`, called first) answer outside a v2 route:
    the router's 404 and 405, a kiln error raised by a middleware, a crash (500). Other
    paths keep API.md's envelope. (The HTTP server's own refusals, written before a
    request is routed, keep it: see docs/comfy.md.)"""
    for kind in (KilnError, HTTPException, Exception):
        api.add_exception_handler(kind, _answering_v2_paths(api.exception_handlers[kind]))
