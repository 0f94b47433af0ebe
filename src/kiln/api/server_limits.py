"""The HTTP server's own limits: request head size, open connections, and the time a
client may take to send a request's head and its body.

A client that sends a 40 MB header, opens thousands of connections or trickles a request
in one byte at a time must not hold the server's memory or sockets. ``kiln serve`` runs
uvicorn with :func:`uvicorn_options`: its HTTP/1.1 protocol is :class:`GuardedH11`, which

- refuses a connection past ``KILN_MAX_CONNECTIONS`` at once (503 ``server_busy``);
- refuses a request head (request line and headers) over ``KILN_MAX_HEADER_BYTES``,
  whether it comes in one read or in many: as soon as more is buffered without the head's
  end, or once a complete head is measured (431 ``headers_too_large``);
- closes a connection whose request head is not complete ``KILN_HEADER_TIMEOUT_S`` after
  it began (408 ``request_timeout`` when part of it came);
- closes a connection whose request body is not complete ``KILN_BODY_TIMEOUT_S`` after
  its head once the response has started: the app answered without reading the body, and
  the server reads it only to discard it. Those bytes are not activity: the keep-alive
  timer started at the response's end runs on while they come;
- answers a request it cannot parse with 400 ``invalid_request``.

Each of those answers is the API's error envelope, written by the protocol itself with
``Connection: close``. :class:`BodyDeadline` (an ASGI middleware, in every app) gives the
body the same ``KILN_BODY_TIMEOUT_S`` while the app reads it: a body still arriving then is
refused with 408 ``request_timeout``. Every message names the setting that allows more.
:class:`GuardedWebSockets` answers a WebSocket handshake it refuses in the envelope too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from http import HTTPStatus
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.datastructures import Headers
from websockets.http11 import Response
from websockets.server import ServerProtocol
from websockets.typing import StatusLike

from kiln.config import Settings
from kiln.errors import KilnError

log = logging.getLogger("kiln.api")


class RequestTimeout(KilnError):
    """The client took too long to send its request (408 ``request_timeout``)."""

    code = "request_timeout"


def envelope_body(code: str, message: str) -> bytes:
    return json.dumps(
        {"error": {"code": code, "message": message, "details": []}}, separators=(",", ":")
    ).encode()


def envelope_bytes(status: int, code: str, message: str, headers: dict[str, str]) -> bytes:
    """A complete HTTP/1.1 response carrying the error envelope, ending the connection."""
    body = envelope_body(code, message)
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# The protocol ---------------------------------------------------------------------------

#: Where h11 ends a request head: at its first empty line.
_HEAD_END = re.compile(rb"\n\r?\n")


class HeadLimitedConnection(h11.Connection):
    """h11's server side, refusing a request head over ``max_head_bytes`` however it came.

    h11 itself limits only a head still incomplete (``max_incomplete_event_size``): a
    larger one that arrives whole in one read is parsed. Here the head is measured before
    h11 parses it, and one over the limit raises :class:`h11.RemoteProtocolError` with
    ``error_status_hint`` 431 (``head_too_large`` is then true)."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.head_too_large = False

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        if self.their_state is h11.IDLE:
            buffered, _ = self.trailing_data
            end = _HEAD_END.search(buffered)
            if (end.end() if end else len(buffered)) > self.max_head_bytes:
                self.head_too_large = True
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.head_too_large = exc.error_status_hint == 431
            raise


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a connection cap, a head size limit, a head deadline
    and a deadline for a body the app does not read, refusing in the error envelope.
    :func:`guarded_protocol` sets the limits."""

    max_connections = 1000
    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0
    body_timeout_s = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = self.limited = HeadLimitedConnection(self.max_header_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._timed_cycle: object = None  # the request whose body _body_timer times
        self._body_overdue = False
        self._upgraded = False

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
        if self._draining():
            # Bytes of a body the app did not read are not activity: unlike uvicorn, leave
            # the keep-alive timer started at the response's end running.
            self.conn.receive_data(data)
            self.handle_events()
        else:
            super().data_received(data)
        if self.transport.is_closing():
            self._disarm_head_timer()
        elif self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # a head began (or will): it has its deadline
        else:
            self._disarm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_body()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True  # the connection is the WebSocket protocol's from now on
        self._disarm_head_timer()
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._body_overdue and self._draining() and not self.transport.is_closing():
            self._body_timeout()  # answered after the body's deadline, the body still due

    def send_400_response(self, msg: str) -> None:
        if self.limited.head_too_large:
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

    # the deadline of a body the app did not read

    def _draining(self) -> bool:
        """The response is complete and the request's body is still coming."""
        complete = self.cycle is not None and self.cycle.response_complete
        return complete and self.conn.their_state is h11.SEND_BODY

    def _watch_body(self) -> None:
        """Time the body of the current request from the end of its head."""
        if self._upgraded or self.conn.their_state is not h11.SEND_BODY:
            self._disarm_body_timer()
        elif self._timed_cycle is not self.cycle:
            self._disarm_body_timer()
            self._timed_cycle = self.cycle
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._timed_cycle = None
        self._body_overdue = False

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        self._body_overdue = True
        if not self.cycle.response_started:
            # The app has not answered: BodyDeadline answers 408 if it reads the body, and
            # a response that completes without it ends the connection (on_response_complete).
            return
        log.warning("request_body_timeout", extra={"timeout_s": self.body_timeout_s})
        self.transport.close()  # after the response: nothing more can be answered

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
        "body_timeout_s": settings.body_timeout_s,
    }
    return type("GuardedH11", (GuardedH11,), limits)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that apply the server limits of ``settings``."""
    return {"http": guarded_protocol(settings), "ws": GuardedWebSockets}


# The WebSocket handshake ----------------------------------------------------------------

#: The code of a refused handshake by its status (any other is ``invalid_request``).
_HANDSHAKE_CODES = {
    403: "forbidden",
    405: "method_not_allowed",
    431: "headers_too_large",
    500: "internal_error",
}
_HANDSHAKE_MESSAGES = {
    "forbidden": "the WebSocket connection was refused",
    "internal_error": "the server failed to answer this request",
}


class EnvelopeHandshake(ServerProtocol):
    """websockets' server side, refusing a handshake in the error envelope, not in text."""

    def reject(self, status: StatusLike, text: str) -> Response:
        plain = super().reject(status, text)
        code = _HANDSHAKE_CODES.get(plain.status_code, "invalid_request")
        reason = text.strip().removeprefix("Failed to open a WebSocket connection: ")
        message = _HANDSHAKE_MESSAGES.get(code, f"the WebSocket handshake is not valid: {reason}")
        body = envelope_body(code, message.rstrip("."))
        headers = Headers(
            (name, value)
            for name, value in plain.headers.raw_items()
            if name.lower() not in {"content-type", "content-length"}
        )
        headers["Content-Type"] = "application/json"
        headers["Content-Length"] = str(len(body))
        return Response(plain.status_code, plain.reason_phrase, headers, body)


class GuardedWebSockets(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (for ``websockets``), refusing a handshake in the error
    envelope (:class:`EnvelopeHandshake`), and answering a request that websockets cannot
    read as a handshake at all (a header line over 8 KiB, more than 128 headers, not a
    GET) instead of leaving its connection open with no answer (uvicorn never sends the
    answer websockets prepares then)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = EnvelopeHandshake(
            extensions=self.conn.available_extensions,
            max_size=self.config.ws_max_size,
            logger=self.conn.logger,
        )

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.handshake_initiated or self.conn.handshake_exc is None:
            return
        if not self.transport.is_closing():
            answer = b"".join(self.conn.data_to_send()) or envelope_bytes(
                400, "invalid_request", "the WebSocket handshake is not a valid request", {}
            )
            self.transport.write(answer)
            self.transport.close()


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
