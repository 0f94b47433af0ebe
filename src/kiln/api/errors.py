"""The one mapping from errors to HTTP statuses and the error envelope.

Every error the API answers has the shape ``{"error": {"code", "message", "details"}}``:
kiln's own errors, request validation, the router's 404 and 405, and anything unexpected
(500 ``internal_error``, logged, no traceback to the client).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from kiln.api.schemas import ErrorEnvelope
from kiln.errors import KilnError, RateLimited, Unauthorized

log = logging.getLogger("kiln.api")

#: API code → HTTP status (API.md's table, plus the engine's own codes).
HTTP_STATUS: dict[str, int] = {
    "invalid_request": 422,
    "invalid_cursor": 422,
    "unknown_kind": 422,
    "idempotency_key_reused": 422,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "request_timeout": 408,
    "already_final": 409,
    "not_retryable": 409,
    "not_in_review": 409,
    "conflict": 409,
    "too_many_schedules": 409,
    "payload_too_large": 413,
    "too_many_tasks": 413,
    "unsupported_media_type": 415,
    "rate_limited": 429,
    "headers_too_large": 431,
    "internal_error": 500,
    "store_unavailable": 503,
    "storage_error": 503,
    "not_ready": 503,
    "server_busy": 503,
}

#: HTTP status → code, for errors raised by the framework rather than by kiln.
_FRAMEWORK_CODES: dict[int, str] = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "rate_limited",
}


def envelope(code: str, message: str, details: Sequence[Any] = ()) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": list(details)}}


def error_response(
    code: str,
    message: str,
    details: Sequence[Any] = (),
    *,
    status: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        envelope(code, message, details),
        status_code=status or HTTP_STATUS.get(code, 500),
        headers=dict(headers) if headers else None,
    )


def status_of(error: KilnError) -> int:
    """The HTTP status a kiln error is answered with (500 for engine-internal codes)."""
    return HTTP_STATUS.get(error.code, 500)


def kiln_error_response(error: KilnError) -> JSONResponse:
    status = status_of(error)
    if status == 503:  # the database or the bucket does not answer: try again shortly
        log.warning("request_unavailable", extra={"code": error.code, "error": error.message})
        return error_response(
            error.code,
            "the store or the storage does not answer; try again shortly",
            headers={"Retry-After": "1"},
        )
    if status >= 500:
        log.error("request_failed", extra={"code": error.code}, exc_info=error)
        return error_response("internal_error", "the server failed to answer this request")
    headers: dict[str, str] = {}
    message = error.message
    if isinstance(error, RateLimited):
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
        message += " (KILN_TENANT_LIMITS or KILN_TENANT_RATE_PER_S allows more)"
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if status == 408:  # the rest of a slow body is never read: the connection must end
        headers["Connection"] = "close"
    return error_response(error.code, message, error.details, headers=headers or None)


def validation_details(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Pydantic/FastAPI errors as plain JSON: where, what, and the error type."""
    return [
        {
            "loc": [str(part) for part in err.get("loc", ())],
            "msg": str(err.get("msg", "")),
            "type": str(err.get("type", "")),
        }
        for err in errors
    ]


async def _on_kiln_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KilnError)
    return kiln_error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    details = validation_details(exc.errors())
    return error_response("invalid_request", "the request is not valid", details)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _FRAMEWORK_CODES.get(exc.status_code, "internal_error")
    if exc.status_code >= 500:
        code = "internal_error"
    messages = {
        "not_found": "no such resource",
        "method_not_allowed": f"{request.method} is not allowed here",
    }
    message = messages.get(code) or str(exc.detail)
    return error_response(code, message, status=exc.status_code, headers=exc.headers)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.error(
        "request_crashed",
        extra={"method": request.method, "path": request.url.path},
        exc_info=exc,
    )
    return error_response("internal_error", "the server failed to answer this request")


def install(app: FastAPI) -> None:
    """Register the handlers that give every error response the envelope.

    A path with a stray trailing slash is 404 in the envelope, not a redirect: the
    router's redirect would copy the client's Host header into ``Location``."""
    app.router.redirect_slashes = False
    app.add_exception_handler(KilnError, _on_kiln_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)


_DESCRIPTIONS: dict[int, str] = {
    401: "No valid API key (`unauthorized`)",
    403: "The key may not do this (`forbidden`)",
    404: "No such task for this key (`not_found`)",
    409: "The task's status does not allow this (`already_final`, `not_retryable`, "
    "`not_in_review`), or the tenant holds its most schedules (`too_many_schedules`)",
    413: "The body is too large (`payload_too_large`), or would create more tasks than one "
    "request may (`too_many_tasks`)",
    415: "The body is not JSON (`unsupported_media_type`)",
    429: "Over the tenant's rate of tasks (`rate_limited`, with Retry-After)",
    422: "The request is not valid (`invalid_request`, `unknown_kind`, `idempotency_key_reused`)",
    503: "The store or the storage does not answer (`not_ready`)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the error answers a route may give."""
    return {
        status: {"model": ErrorEnvelope, "description": _DESCRIPTIONS.get(status, "Error")}
        for status in statuses
    }
