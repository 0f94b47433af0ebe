"""The HTTP server's own limits: request head size, open connections, and the time a
client may take to send a request's head and its body.

A client that sends a 40 MB header, opens thousands of connections or trickles a request
in one byte at a time must not hold the server's memory or sockets. ``kiln serve`` runs
uvicorn with :func:`uvicorn_options`: its HTTP/1.1 protocol is :class:`GuardedH11`, which

- refuses a connection past ``KILN_MAX_CONNECTIONS`` at once (503 ``server_busy``);
- refuses a request head (request line and headers) over ``KILN_MAX_HEADER_BYTES``
  as soon as that many bytes are buffered (431 ``headers_too_large``);
- closes a connection whose request head is not complete ``KILN_HEADER_TIMEOUT_S`` after
  it began (408 ``request_timeout`` when part of it came);
- answers a request it cannot parse with 400 ``invalid_request``.

Each of those answers is the API's error envelope, written by the protocol itself with
``Connection: close``. :class:`BodyDeadline` (an ASGI middleware, in every app) gives the
body ``KILN_BODY_TIMEOUT_S`` from the end of the head: a body still arriving then is
refused with 408 ``request_timeout``. Every message names the setting that allows more.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.config import Settings
from kiln.errors import KilnError

log = logging.getLogger("kiln.api")


class RequestTimeout(KilnError):
    """The client took too long to send its request (408 ``request_timeout``)."""

    code = "request_timeout"


def envelope_bytes(status: int, code: str, message: str, headers: dict[str, str]) -> bytes:
    """A complete HTTP/1.1 response carrying the error envelope, ending the connection."""
    body = json.dumps(
        {"error": {"code": code, "message": message, "details": []}}, separators=(",", ":")
    ).encode()
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# The protocol ---------------------------------------------------------------------------


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a connection cap, a head size limit and a head
    deadline, refusing in the error envelope. :func:`guarded_protocol` sets the limits."""

    max_connections = 1000
    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("connection_refused", extra={"limit": self.max_connections})
            self._refuse(
                503,
                "server_busy",
                f"the server holds {self.max_connections} connections, its most "
                "(KILN_MAX_CONNECTIONS allows more); try again shortly",
                {"retry-after": "1"},
            )
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm_head_timer()
        elif self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # a head began (or will): it has its deadline
        else:
            self._disarm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        buffered, _ = self.conn.trailing_data
        if len(buffered) > self.max_header_bytes:
            log.warning("request_head_too_large", extra={"limit": self.max_header_bytes})
            self._refuse(
                431,
                "headers_too_large",
                f"the request line and headers are larger than {self.max_header_bytes} "
                "bytes (KILN_MAX_HEADER_BYTES allows more)",
            )
            return
        self._refuse(400, "invalid_request", "the request is not valid HTTP/1.1")

    # the head's deadline

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        buffered, _ = self.conn.trailing_data
        if not buffered:  # nothing sent: an idle connection just goes
            self.transport.close()
            return
        log.warning("request_head_timeout", extra={"timeout_s": self.header_timeout_s})
        self._refuse(
            408,
            "request_timeout",
            f"the request head did not arrive within {self.header_timeout_s:g} s "
            "(KILN_HEADER_TIMEOUT_S allows more)",
        )

    def _refuse(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(envelope_bytes(status, code, message, headers or {}))
            self.transport.close()


def guarded_protocol(settings: Settings) -> type[GuardedH11]:
    """:class:`GuardedH11` with the limits of ``settings``."""
    limits = {
        "max_connections": settings.max_connections,
        "max_header_bytes": settings.max_header_bytes,
        "header_timeout_s": settings.header_timeout_s,
    }
    return type("GuardedH11", (GuardedH11,), limits)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that apply the server limits of ``settings``."""
    return {
        "http": guarded_protocol(settings),
        "h11_max_incomplete_event_size": settings.max_header_bytes,
    }


# The body's deadline --------------------------------------------------------------------


class BodyDeadline:
    """ASGI middleware: an HTTP request's body must arrive within ``timeout_s`` of its
    head. Past that, the ``receive`` the app awaits raises :class:`RequestTimeout`
    (answered 408 in the envelope). Once the body is complete (a stream listening for the
    client's disconnect), ``receive`` is left alone."""

    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                # asyncio.timeout, not wait_for: no task per receive on the hot path.
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                log.warning("request_body_timeout", extra={"timeout_s": self.timeout_s})
                raise RequestTimeout(
                    f"the request body did not arrive within {self.timeout_s:g} s "
                    "(KILN_BODY_TIMEOUT_S allows more)"
                ) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, receive_in_time, send)
