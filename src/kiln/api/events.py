"""Event streams: server-sent events and a WebSocket over :meth:`kiln.App.watch`.

A task stream replays the task's status events from the log (after ``Last-Event-ID`` or
``?after=``), then follows live, status events with ``id: <seq>`` and progress events
without one, and ends once the task is final. The tenant feed starts live. Comments keep
idle streams alive.

When the server shuts down, open streams end with a reconnect hint: an SSE stream's last
block is a ``retry:`` field (browsers' EventSource reconnects after it, with
``Last-Event-ID``), a WebSocket closes with code 1012 "service restart". The lifespan
gives the app a "closing" event (:func:`reset_closing`); the server's shutdown sets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Generic, TypeVar

import anyio
from fastapi import APIRouter, Depends, Header, Query, WebSocket
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import HTTPConnection
from starlette.types import Message as ASGIMessage
from starlette.types import Send
from starlette.websockets import WebSocketDisconnect, WebSocketState

from kiln.api.auth import Principal, authenticate, bearer_key, require_stream_principal
from kiln.api.errors import error_responses
from kiln.api.schemas import MAX_SEQ
from kiln.api.state import ApiState, api_state
from kiln.bus import Message
from kiln.errors import InvalidRequest, NotFound, Unauthorized

log = logging.getLogger("kiln.api")

router = APIRouter()

#: WebSocket close codes: a policy refusal mirrors the HTTP status it stands for.
WS_UNAUTHORIZED = 4401
WS_NOT_FOUND = 4404
WS_INVALID = 4422
#: How long a stream may take to end by itself once the server is shutting down.
SHUTDOWN_GRACE_S = 2.0
#: The reconnect hint of a stream closed by a shutdown: reconnect after this long (SSE
#: ``retry:``, milliseconds), and the WebSocket close code "service restart".
RECONNECT_MS = 1000
WS_SERVICE_RESTART = 1012
#: The attribute of the app's state that holds its "closing" event.
_CLOSING = "kiln_closing"

_SSE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "A stream of `status` and `progress` events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}

After = Annotated[
    int | None,
    Query(ge=0, le=MAX_SEQ, description="Send only events with a larger seq (like Last-Event-ID)"),
]
LastEventId = Annotated[
    str | None,
    Header(alias="Last-Event-ID", description="Resume after this event id"),
]


def resume_point(after: int | None, last_event_id: str | None) -> int | None:
    """Where a stream resumes: the later of ``?after=`` and ``Last-Event-ID``."""
    points = [] if after is None else [after]
    if last_event_id is not None and last_event_id.strip():
        try:
            header = int(last_event_id.strip())
        except ValueError:
            raise InvalidRequest("Last-Event-ID must be an event id (an integer)") from None
        if not 0 <= header <= MAX_SEQ:
            raise InvalidRequest(f"Last-Event-ID must be an event id, 0 to {MAX_SEQ}")
        points.append(header)
    return max(points) if points else None


def reset_closing(app: Starlette) -> asyncio.Event:
    """A fresh "closing" event for ``app``'s streams (the lifespan makes one per run): set
    it to end every open stream with a reconnect hint."""
    event = asyncio.Event()
    setattr(app.state, _CLOSING, event)
    return event


def _closing(connection: HTTPConnection) -> asyncio.Event | None:
    event = getattr(connection.app.state, _CLOSING, None)
    return event if isinstance(event, asyncio.Event) else None


def reconnect_hint() -> ServerSentEvent:
    """The last block of a stream the server closes to shut down."""
    return ServerSentEvent(comment="kiln is shutting down: reconnect", retry=RECONNECT_MS)


class _Ended:
    """What a stream's reader hands over when ``messages`` ended or failed."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


#: The most messages a stream hands over at once: what piled up while it was sending.
BATCH = 64
#: What a stream carries: kiln's messages, or a face's own beside them.
M = TypeVar("M")


class _Handover(Generic[M]):
    """Between a stream and its messages: one task reads them into a bounded queue, and
    one per event waits for it and then ends the queue. A message costs a put and a get
    (no task per message), and a slow client still holds the subscription back."""

    def __init__(
        self, messages: AsyncIterator[M], events: list[anyio.Event | asyncio.Event]
    ) -> None:
        self.queue: asyncio.Queue[M | _Ended] = asyncio.Queue(maxsize=BATCH)
        self.ended: _Ended | None = None
        self.reader = asyncio.ensure_future(self._read(messages))
        self.waiters = [asyncio.ensure_future(self._end_on(event)) for event in events]

    async def _read(self, messages: AsyncIterator[M]) -> None:
        try:
            async for message in messages:
                await self.queue.put(message)
        except Exception as exc:  # handed to the stream, which raises it
            await self.queue.put(_Ended(exc))
            return
        await self.queue.put(_Ended())

    async def _end_on(self, event: anyio.Event | asyncio.Event) -> None:
        await event.wait()
        self.reader.cancel()
        await self.queue.put(_Ended())

    async def next_batch(self) -> list[M] | _Ended:
        """The next message and every one already waiting behind it; or how it ended."""
        item = self.ended or await self.queue.get()
        if isinstance(item, _Ended):
            return item
        batch = [item]
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, _Ended):
                self.ended = item  # after this batch
                break
            batch.append(item)
        return batch

    def close(self) -> None:
        for job in (self.reader, *self.waiters):
            job.cancel()


async def until_stopped(
    messages: AsyncIterator[M], stop: anyio.Event, closing: asyncio.Event | None = None
) -> AsyncIterator[list[M]]:
    """The messages in batches, until ``stop`` or ``closing`` is set (the server is
    shutting down). A batch is what arrived while the previous one was being sent (one
    message when the client keeps up), so a stream that falls behind sends fewer, larger
    chunks instead of falling further behind.

    Whichever way this ends (the stream's end, shutdown, the client going away), the
    reader of ``messages`` is cancelled, so the subscription behind it is released.
    """
    handover = _Handover(messages, [stop] if closing is None else [stop, closing])
    try:
        while not isinstance(batch := await handover.next_batch(), _Ended):
            if stop.is_set() or (closing is not None and closing.is_set()):
                return
            yield batch
        if batch.error is not None:
            raise batch.error
    finally:
        handover.close()


async def _sse(
    state: ApiState,
    messages: AsyncIterator[Message],
    stop: anyio.Event,
    closing: asyncio.Event | None,
) -> AsyncIterator[ServerSentEvent | bytes]:
    gauge = state.metrics.streams.labels("sse")
    gauge.inc()
    try:
        async for batch in until_stopped(messages, stop, closing):
            yield b"".join(state.encoded_events(message) for message in batch)
        if stop.is_set() or (closing is not None and closing.is_set()):
            yield reconnect_hint()
    finally:
        gauge.dec()
        with contextlib.suppress(Exception):
            await messages.aclose()  # type: ignore[attr-defined]


class EventStream(EventSourceResponse):
    """sse-starlette's response, without a cancel scope around each send when no send
    timeout is set (there is none here): with a thousand streams, entering and leaving
    one per event and stream was a third of the server's time."""

    async def _send_with_timeout(self, send: Send, message: ASGIMessage) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def _response(
    connection: HTTPConnection, state: ApiState, messages: AsyncIterator[Message]
) -> EventSourceResponse:
    stop = anyio.Event()
    return EventStream(
        _sse(state, messages, stop, _closing(connection)),
        ping=state.ping_interval_s,
        ping_message_factory=lambda: ServerSentEvent(comment="ping"),
        sep="\n",
        shutdown_event=stop,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
    )


@router.get(
    "/v1/tasks/{task_id}/events",
    summary="Follow a task: its history, then live events, until it is final",
    response_class=EventSourceResponse,
    responses={**_SSE_RESPONSES, **error_responses(401, 404, 422)},
)
async def task_events(
    task_id: str,
    connection: HTTPConnection,
    principal: Annotated[Principal, Depends(require_stream_principal)],
    after: After = None,
    last_event_id: LastEventId = None,
) -> EventSourceResponse:
    state = api_state(connection)
    start = resume_point(after, last_event_id)
    await state.app.get(task_id, principal.scope)
    return _response(connection, state, state.app.watch(task_id, after=start))


@router.get(
    "/v1/events",
    summary="Follow every task of the tenant (all tenants with the admin key)",
    response_class=EventSourceResponse,
    responses={**_SSE_RESPONSES, **error_responses(401, 422)},
)
async def tenant_events(
    connection: HTTPConnection,
    principal: Annotated[Principal, Depends(require_stream_principal)],
    after: After = None,
    last_event_id: LastEventId = None,
) -> EventSourceResponse:
    state = api_state(connection)
    start = resume_point(after, last_event_id)
    messages = state.app.watch(None, tenant=principal.scope, after=start, replay=False)
    return _response(connection, state, messages)


# WebSocket ------------------------------------------------------------------------------


def _ws_after(websocket: WebSocket) -> int | None:
    raw = websocket.query_params.get("after")
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest("after must be a non-negative integer") from None
    if not 0 <= value <= MAX_SEQ:
        raise InvalidRequest(f"after must be an event id, 0 to {MAX_SEQ}")
    return value


async def _admit(websocket: WebSocket, state: ApiState, task_id: str) -> int | None:
    """Authenticate and resolve the task, or close the socket with the reason's code."""
    key = bearer_key(websocket.headers.get("authorization"))
    key = key or websocket.query_params.get("access_token")
    try:
        principal = authenticate(state.settings, key)
        after = _ws_after(websocket)
        await state.app.get(task_id, principal.scope)
    except Unauthorized as exc:
        await websocket.close(WS_UNAUTHORIZED, exc.code)
        raise
    except NotFound as exc:
        await websocket.close(WS_NOT_FOUND, exc.code)
        raise
    except InvalidRequest as exc:
        await websocket.close(WS_INVALID, exc.code)
        raise
    return after


async def _pump(websocket: WebSocket, messages: AsyncIterator[Message]) -> None:
    async for message in messages:
        await websocket.send_text(json.dumps(message.to_json(), separators=(",", ":")))
    await websocket.close(1000)


async def _until_disconnect(websocket: WebSocket) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return


@router.websocket("/v1/tasks/{task_id}/ws")
async def task_socket(websocket: WebSocket, task_id: str) -> None:
    """The task stream as WebSocket text messages (the same JSON objects)."""
    state = api_state(websocket)
    await websocket.accept()
    try:
        after = await _admit(websocket, state, task_id)
    except (Unauthorized, NotFound, InvalidRequest):
        return
    gauge = state.metrics.streams.labels("websocket")
    gauge.inc()
    pump = asyncio.create_task(_pump(websocket, state.app.watch(task_id, after=after)))
    listen = asyncio.create_task(_until_disconnect(websocket))
    jobs: set[asyncio.Task[Any]] = {pump, listen}
    closing = _closing(websocket)
    if closing is not None:
        jobs.add(asyncio.create_task(closing.wait()))
    try:
        await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gauge.dec()
        code = 1011 if closing is None or not closing.is_set() else WS_SERVICE_RESTART
        await _finish(websocket, task_id, *jobs, code=code)


async def _finish(
    websocket: WebSocket, task_id: str, *jobs: asyncio.Task[Any], code: int = 1011
) -> None:
    """End the socket's jobs, and close it with ``code`` unless it is closed: 1011 when a
    job failed, 1012 (service restart: reconnect) when the server shuts down."""
    for job in jobs:
        job.cancel()
    for job in jobs:
        try:
            await job
        except (asyncio.CancelledError, WebSocketDisconnect):
            pass
        except Exception:  # the stream's edge: log it and close the socket
            log.warning("websocket_stream_failed", extra={"task_id": task_id}, exc_info=True)
    connected = WebSocketState.CONNECTED
    if websocket.application_state is connected and websocket.client_state is connected:
        with contextlib.suppress(Exception):
            reason = "kiln is shutting down: reconnect" if code == WS_SERVICE_RESTART else None
            await websocket.close(code, reason)
