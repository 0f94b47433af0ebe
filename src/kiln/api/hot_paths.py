"""The two busiest requests answered before the router: ``GET /v1/tasks/{id}`` and a JSON
``POST /v1/tasks``.

FastAPI's way to a handler (the exception middlewares, matching the path against every
route, solving the dependencies, wrapping ``send`` per layer) costs more CPU than kiln's
own work for a task read. :class:`HotPaths` sits outside that stack and does exactly what
the routes do (``kiln.api.tasks``: the same functions) for the plain case: the key from
``Authorization: Bearer``, the body within ``KILN_MAX_BODY_BYTES`` and
``KILN_BODY_TIMEOUT_S``, kiln's errors in the envelope, the request counted in
``kiln_api_requests`` under its route template. Anything else goes to the full stack
before a byte of the body was read: a missing or unknown key (its 401 is the router's),
another media type (multipart, a wrong one), an ``Idempotency-Key`` the header's rules
refuse, an unknown task (the router's 404). With tracing on, every request goes through
the stack (its span wraps the rest).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from prometheus_client import Counter
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln import wire
from kiln.api import tasks
from kiln.api.auth import Principal, authenticate, bearer_key
from kiln.api.errors import error_response, kiln_error_response
from kiln.api.server_limits import timed_receive
from kiln.api.state import ApiState
from kiln.errors import KilnError, NotFound

log = logging.getLogger("kiln.api")

TASK_ROUTE = "/v1/tasks/{task_id}"
SUBMIT_ROUTE = "/v1/tasks"
_KEY = re.compile(tasks.IDEMPOTENCY_KEY_PATTERN)
_IDEMPOTENCY_HEADER = wire.IDEMPOTENCY_HEADER.lower().encode("latin-1")
Headers = dict[bytes, bytes]
Handler = Callable[[Scope, Receive, Principal, Headers], Awaitable[Response]]


class _Fallback(Exception):
    """Leave this request to the full stack (nothing of it was read or answered)."""


class _Gone(Exception):
    """The client went away before its body arrived: nobody to answer."""


class HotPaths:
    """ASGI middleware outside FastAPI's stack (see the module docstring)."""

    def __init__(self, app: ASGIApp, state: ApiState) -> None:
        self.app = app
        self.state = state
        self._counters: dict[tuple[str, str, int], Counter] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, handler = self._match(scope)
        if handler is None:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        try:
            principal = self._principal(headers)
            response = await handler(scope, receive, principal, headers)
        except _Fallback:
            await self.app(scope, receive, send)
            return
        except _Gone:
            return
        await response(scope, receive, send)
        self._count(scope["method"], route, response.status_code)

    def _match(self, scope: Scope) -> tuple[str, Handler | None]:
        if scope["type"] != "http":
            return "", None
        path, method = scope["path"], scope["method"]
        if method == "GET" and path.startswith("/v1/tasks/"):
            task_id = path[len("/v1/tasks/") :]
            if task_id and "/" not in task_id:
                return TASK_ROUTE, self._get
        if method == "POST" and path == SUBMIT_ROUTE:
            return SUBMIT_ROUTE, self._submit
        return "", None

    def _principal(self, headers: Headers) -> Principal:
        raw = headers.get(b"authorization")
        key = bearer_key(raw.decode("latin-1")) if raw is not None else None
        if key is None:
            raise _Fallback
        try:
            return authenticate(self.state.settings, key)
        except KilnError:
            raise _Fallback from None

    async def _get(self, scope: Scope, _: Receive, principal: Principal, __: Headers) -> Response:
        task_id = scope["path"][len("/v1/tasks/") :]
        state = self.state
        try:
            task, position = await state.app.standing(task_id, principal.scope)
            return tasks.standing_response(await tasks.standing(state, task, position))
        except NotFound:
            raise _Fallback from None
        except KilnError as exc:
            return kiln_error_response(exc)
        except Exception as exc:
            return _crashed(scope, exc)

    async def _submit(
        self, scope: Scope, receive: Receive, principal: Principal, headers: Headers
    ) -> Response:
        if not _is_json(headers.get(b"content-type")):
            raise _Fallback
        key = _idempotency_key(headers.get(_IDEMPOTENCY_HEADER))
        state = self.state
        try:
            raw = await _body(headers, timed_receive(receive, state.settings.body_timeout_s), state)
            return await tasks.submit_json(state, principal, raw, key)
        except KilnError as exc:
            return kiln_error_response(exc)
        except Exception as exc:
            return _crashed(scope, exc)

    def _count(self, method: str, route: str, status: int) -> None:
        key = (method, route, status)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.state.metrics.requests.labels(*key)
        counter.inc()


def _is_json(raw: bytes | None) -> bool:
    if raw is None:
        return False
    kind = raw.decode("latin-1").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def _idempotency_key(raw: bytes | None) -> str | None:
    """The header's key when its rules (1-255 printable ASCII) take it; else the full
    stack answers (its 422 names the header)."""
    if raw is None:
        return None
    key = raw.decode("latin-1")
    if not 1 <= len(key) <= 255 or _KEY.match(key) is None:
        raise _Fallback
    return key


async def _body(headers: Headers, receive: Receive, state: ApiState) -> bytes:
    """The body as :func:`kiln.api.tasks.read_body` reads it (413 past the limit)."""
    limit = state.settings.max_body_bytes
    declared = headers.get(b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise tasks.body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _Gone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise tasks.body_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _crashed(scope: Scope, exc: Exception) -> Response:
    log.error(
        "request_crashed", extra={"method": scope["method"], "path": scope["path"]}, exc_info=exc
    )
    return error_response("internal_error", "the server failed to answer this request")
