"""The HTTP server's own limits: request head size, open connections, and the time a
client may take to send a request's head and its body.

A client that sends a 40 MB header, opens thousands of connections or trickles a request
in one byte at a time must not hold the server's memory or sockets. ``kiln serve`` runs
uvicorn with :func:`uvicorn_options`: its HTTP/1.1 protocol is :class:`GuardedHttpTools`
(uvicorn's httptools protocol, the C parser llhttp), which

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

import httptools
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
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

#: Where a request head ends: at its first empty line.
_HEAD_END = re.compile(rb"\n\r?\n")


#: The versions served: llhttp parses a request line of "HTTP/2.0" too.
_VERSIONS = frozenset({"1.0", "1.1"})


class HeadTooLarge(Exception):
    """Raised from a parser callback: the head being parsed is over the limit."""


class OneWrite:
    """The connection as a response sees it: what the response writes in one turn of the
    event loop goes out in one write at the end of that turn. uvicorn writes a response's
    head and its body separately, and each write is a send to the socket at once; an
    answer written whole (its head, then its body, with no wait between) costs one send.
    A response that streams (its head, then parts as they come) sends each turn's writes
    as that turn ends, as before."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(data)

    def _flush(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(b"".join(held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap, a head size limit, a head
    deadline and a deadline for a body the app does not read, refusing in the error
    envelope. :func:`guarded_protocol` sets the limits.

    A request head is measured before it is parsed: the bytes up to its end (or all of
    them while it has not ended) count, however many reads bring them. A head that begins
    after another request in the same read is measured by its parsed parts as well."""

    max_connections = 1000
    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0
    body_timeout_s = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # of the head now coming, measured before parsing
        self._head_parsed = 0  # of the head being parsed, by its parts
        self._head_end_carry = b""  # the last bytes of the previous read, for _HEAD_END
        self._in_head = False  # a head is being parsed
        self._in_body = False  # a body is due (its head parsed, the message not complete)
        self._head_too_large = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_timed = False  # the body now due has its deadline
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
        if not self._in_body and not self._measure_head(data):
            self._head_too_large = True
            self.send_400_response("request head too large")
            return
        if self._draining():
            # Bytes of a body the app did not read are not activity: unlike uvicorn, leave
            # the keep-alive timer started at the response's end running.
            self._feed(data)
        else:
            super().data_received(data)
        if self._in_body and not self._body_timed and not self._upgraded:
            self._arm_body_timer()
        if self.transport.is_closing() or self._upgraded:
            self._disarm_head_timer()
        elif self._awaiting_head():
            self._arm_head_timer()  # a head began (or will): it has its deadline
        else:
            self._disarm_head_timer()

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.send_400_response("Invalid HTTP request received.")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True  # the connection is the WebSocket protocol's from now on
        self._disarm_head_timer()
        self._disarm_body_timer()
        super().handle_websocket_upgrade()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._body_overdue and self._draining() and not self.transport.is_closing():
            self._body_timeout()  # answered after the body's deadline, the body still due

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            log.warning("request_head_too_large", extra={"limit": self.max_header_bytes})
            self._refuse(
                431,
                "headers_too_large",
                f"the request line and headers are larger than {self.max_header_bytes} "
                "bytes (KILN_MAX_HEADER_BYTES allows more)",
            )
            return
        self._refuse(400, "invalid_request", "the request is not valid HTTP/1.1")

    # parser callbacks: where a head and a body begin and end

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_parsed = 12  # the method and " HTTP/1.1\r\n" around the target, at least

    def on_url(self, url: bytes) -> None:
        super().on_url(url)  # in pieces when the target came in pieces
        self._count_parsed(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_parsed(len(name) + len(value) + 3)  # with ":" and "\r\n", at least

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() not in _VERSIONS:
            raise httptools.HttpParserError("not HTTP/1.0 or HTTP/1.1")  # answered 400
        self._in_head = False
        self._in_body = True
        self._head_bytes = 0
        self._head_end_carry = b""
        self._disarm_head_timer()
        self._disarm_body_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.transport, OneWrite):
            cycle.transport = OneWrite(cycle.transport, self.loop)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm_body_timer()
        super().on_message_complete()

    # the head's size

    def _measure_head(self, data: bytes) -> bool:
        """Count ``data`` into the head now coming; False when that is over the limit."""
        carried = len(self._head_end_carry)
        end = _HEAD_END.search(self._head_end_carry + data)
        size = self._head_bytes + (end.end() - carried if end else len(data))
        if size > self.max_header_bytes:
            return False
        if not end:
            self._head_bytes = size
            self._head_end_carry = data[-3:]
        return True

    def _count_parsed(self, size: int) -> None:
        self._head_parsed += size
        if self._head_parsed > self.max_header_bytes:
            self._head_too_large = True
            raise HeadTooLarge  # httptools stops: HttpParserCallbackError, answered 431

    # the head's deadline

    def _awaiting_head(self) -> bool:
        """A head is coming, or may: no request is being read or answered."""
        if self._in_head:
            return True
        answered = self.cycle is None or self.cycle.response_complete
        return answered and not self._in_body and not self.pipeline

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        if not self._in_head and not self._head_bytes:  # nothing sent: an idle connection goes
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
        return self._in_body and self.cycle is not None and self.cycle.response_complete

    def _arm_body_timer(self) -> None:
        """Time the body of the current request from the end of its head."""
        self._body_timed = True
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body_timed = False
        self._body_overdue = False

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or not self._in_body:
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


def guarded_protocol(settings: Settings) -> type[GuardedHttpTools]:
    """:class:`GuardedHttpTools` with the limits of ``settings``."""
    limits = {
        "max_connections": settings.max_connections,
        "max_header_bytes": settings.max_header_bytes,
        "header_timeout_s": settings.header_timeout_s,
        "body_timeout_s": settings.body_timeout_s,
    }
    return type("GuardedHttpTools", (GuardedHttpTools,), limits)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that apply the server limits of ``settings``, and
    its access log (``KILN_ACCESS_LOG``; off by default)."""
    return {
        "http": guarded_protocol(settings),
        "ws": GuardedWebSockets,
        "access_log": settings.access_log,
    }


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
        await self.app(scope, timed_receive(receive, self.timeout_s), send)


def timed_receive(receive: Receive, timeout_s: float) -> Receive:
    """``receive`` whose body messages must all arrive within ``timeout_s`` from now
    (:class:`BodyDeadline`); past that it raises :class:`RequestTimeout`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
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
            log.warning("request_body_timeout", extra={"timeout_s": timeout_s})
            raise RequestTimeout(
                f"the request body did not arrive within {timeout_s:g} s "
                "(KILN_BODY_TIMEOUT_S allows more)"
            ) from None
        body_done = message["type"] != "http.request" or not message.get("more_body")
        return message

    return receive_in_time
