"""``GET /api/v2/jobs/{id}/events``: a job's events as v2 server-sent events.

The stream is kiln's task stream (:meth:`kiln.App.watch`: the status history from the
event log, then live, until the final event) told in v2's words, from ``Last-Event-ID`` on:
``status``, ``progress``, ``preview``, ``output`` (each output, before ``succeeded``) and
``log`` (the failure, before ``failed``/``expired``). A status change's ``id`` is its event
seq; an event derived from one is ``<seq>.<n>``, ``<seq>`` being the status change before
it, so ``Last-Event-ID`` of either resumes after that status change; the events derived
from it go on from ``<n>`` + 1 (``41.3`` resumes with ``41.4``), so no id is sent twice.

A cancel asked of a running job changes no status in kiln's log (only
``cancel_requested``), so the stream learns of it beside the log (:func:`with_cancel_asks`)
and says ``canceling`` as an event derived from the status change before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import Depends, Header
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

from kiln.api.auth import Principal, require_stream_principal
from kiln.api.comfy import shapes
from kiln.api.comfy.common import base_of, book_of, job_task
from kiln.api.comfy.errors import V2Error
from kiln.api.comfy.jobs import router
from kiln.api.events import SHUTDOWN_GRACE_S, EventStream, reconnect_hint, until_stopped
from kiln.api.schemas import MAX_SEQ
from kiln.api.state import ApiState, api_state
from kiln.bus import Message, ProgressEvent
from kiln.models import JSON, TaskEvent
from kiln.states import RUNNING

log = logging.getLogger("kiln.api")

PREVIEW_PREFIX = "data:"
#: How often a stream of a running job reads whether its cancel was asked on another API
#: node (a cancel asked of this node's is heard at once).
CANCEL_POLL_S = 1.0


def resume_after(last_event_id: str | None) -> tuple[int, int] | None:
    """Where a stream resumes: the status change and the last event derived from it the
    client has. ``41`` says (41, 0), ``41.3`` says (41, 3)."""
    if last_event_id is None or not last_event_id.strip():
        return None
    head, dot, tail = last_event_id.strip().partition(".")
    parts = (head, tail) if dot else (head,)
    if not all(p.isdigit() and int(p) <= MAX_SEQ for p in parts):
        raise V2Error("invalid_request", "Last-Event-ID must be an id this stream sent", 400)
    return int(head), int(tail) if dot else 0


def _event(kind: str, event_id: str, data: JSON) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data, separators=(",", ":")), event=kind, id=event_id)


def preview_of(data_url: str, node_id: str | None) -> JSON | None:
    """A ``data:<type>;base64,<data>`` preview as v2's preview event, or None."""
    if not data_url.startswith(PREVIEW_PREFIX):
        return None
    head, comma, data = data_url.removeprefix(PREVIEW_PREFIX).partition(",")
    content_type, _, encoding = head.partition(";")
    if not comma or encoding != "base64" or not content_type:
        return None
    return {"node_id": node_id or "", "content_type": content_type, "data_base64": data}


class JobEvents:
    """One connection's translation of kiln messages into v2 events."""

    def __init__(
        self, request: Request, state: ApiState, nodes: int, after: tuple[int, int] | None
    ):
        self.request = request
        self.state = state
        self.nodes = nodes
        self.after, self.after_n = after or (0, 0)
        self.seq = 0
        self.n = 0
        self.status: str | None = None
        self.running = False  # the last status change seen is a running kiln status
        self.asked = False  # the job's cancel was asked

    def _derived_id(self) -> str:
        self.n += 1
        return f"{self.seq}.{self.n}"

    async def of(self, message: Message | CancelAsked) -> list[ServerSentEvent]:
        if isinstance(message, CancelAsked):
            return self._cancel_asked()
        if isinstance(message, TaskEvent):
            return await self._status(message)
        return self._progress(message)

    def _cancel_asked(self) -> list[ServerSentEvent]:
        """``canceling``, once, when the job runs; a later running status says it then."""
        self.asked = True
        if not self.running or self.status == "canceling":
            return []
        self.status = "canceling"
        return [_event("status", self._derived_id(), {"status": "canceling"})]

    async def _status(self, event: TaskEvent) -> list[ServerSentEvent]:
        status = shapes.job_status(event.status, self.asked)
        self.running = event.status in RUNNING
        if event.seq <= self.after:  # the client has it: only where the job stood
            # and the events derived from it the client has: the next one goes on after them
            self.n = self.after_n if event.seq == self.after else 0
            self.seq, self.status = event.seq, status
            return []
        found: list[ServerSentEvent] = []
        if status == "succeeded":
            found += await self._outputs(event.task_id)
        elif status in ("failed", "expired") and event.final and event.error:
            message = str(event.error.get("message") or event.error.get("code") or status)
            found.append(_event("log", self._derived_id(), {"level": "error", "message": message}))
        self.seq, self.n = event.seq, 0
        if status != self.status or event.final:
            found.append(_event("status", str(event.seq), {"status": status}))
        self.status = status
        return found

    async def _outputs(self, task_id: str) -> list[ServerSentEvent]:
        task = await self.state.app.get(task_id)
        book = book_of(self.request)
        base = base_of(self.request)
        found = []
        for output in shapes.outputs_of(task):
            blake3 = await book.blake3_of_object(output.key, output.sha256, output.size)
            body = shapes.output_json(task, output, base, blake3)
            found.append(_event("output", self._derived_id(), body))
        return found

    def _progress(self, message: ProgressEvent) -> list[ServerSentEvent]:
        raw: Any = message.progress or {}
        step, total = raw.get("step"), raw.get("total")
        found = []
        body = shapes.progress_json(message.stage, step, total, self.nodes, False)
        if body is not None:
            found.append(_event("progress", self._derived_id(), body))
        if message.preview is not None:
            preview = preview_of(message.preview, shapes.node_at(message.stage).node_id)
            if preview is not None:
                found.append(_event("preview", self._derived_id(), preview))
        return found


@dataclass(frozen=True, slots=True)
class CancelAsked:
    """The job's cancel was asked while it ran (kiln logs no event for that)."""

    task_id: str


class _Poke:
    """Wakes the reader of a stream's queue when a cancel ask comes while nothing else does."""


class _End:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class _CancelAsks:
    """A job's messages in one queue, and whether its cancel was asked."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.queue: asyncio.Queue[Message | _Poke | _End] = asyncio.Queue(maxsize=64)
        self.asked = False

    def hear(self, task_id: str) -> None:
        """A cancel listener of this process's engine: called as the cancel is asked."""
        if task_id == self.task_id:
            self.ask()

    def ask(self) -> None:
        if not self.asked:
            self.asked = True
            with contextlib.suppress(asyncio.QueueFull):  # a full queue wakes its reader
                self.queue.put_nowait(_Poke())

    async def pump(self, messages: AsyncIterator[Message]) -> None:
        try:
            async for message in messages:
                await self.queue.put(message)
        except Exception as exc:  # handed to the stream, which raises it
            await self.queue.put(_End(exc))
            return
        finally:  # cancelled or not: the subscription behind ``messages`` is released
            with contextlib.suppress(Exception):
                await messages.aclose()  # type: ignore[attr-defined]
        await self.queue.put(_End())

    async def poll(self, state: ApiState, running: Callable[[], bool]) -> None:
        """Read the job while it runs: a cancel asked through another API node."""
        while not self.asked:
            await asyncio.sleep(CANCEL_POLL_S)
            if not running():
                continue
            try:
                task = await state.app.get(self.task_id)
            except Exception:  # one read: the next one may answer
                log.warning("comfy_cancel_poll_failed", extra={"task_id": self.task_id})
                continue
            if task.cancel_requested and task.status in RUNNING:
                self.ask()


async def with_cancel_asks(
    state: ApiState, task_id: str, messages: AsyncIterator[Message], running: Callable[[], bool]
) -> AsyncIterator[Message | CancelAsked]:
    """``messages``, with :class:`CancelAsked` before the first message that follows the
    ask (the ``canceled`` status included), or alone when none follows yet. The ask is
    heard at once from this process's engine, else read every :data:`CANCEL_POLL_S`."""
    asks = _CancelAsks(task_id)
    listeners = state.app.cancel_listeners
    listeners.append(asks.hear)
    jobs = [
        asyncio.ensure_future(asks.pump(messages)),
        asyncio.ensure_future(asks.poll(state, running)),
    ]
    told = False
    try:
        while True:
            item = await asks.queue.get()
            if asks.asked and not told:
                told = True
                yield CancelAsked(task_id)
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            if not isinstance(item, _Poke):
                yield item
    finally:
        listeners.remove(asks.hear)
        for job in jobs:
            job.cancel()


async def _stream(
    request: Request,
    events: JobEvents,
    messages: AsyncIterator[Message | CancelAsked],
    stop: anyio.Event,
) -> AsyncIterator[ServerSentEvent]:
    state = events.state
    closing = getattr(request.app.state, "kiln_closing", None)
    closing = closing if isinstance(closing, asyncio.Event) else None
    gauge = state.metrics.streams.labels("sse")
    gauge.inc()
    try:
        async for batch in until_stopped(messages, stop, closing):
            for message in batch:
                for event in await events.of(message):
                    yield event
        if stop.is_set() or (closing is not None and closing.is_set()):
            yield reconnect_hint()
    finally:
        gauge.dec()
        with contextlib.suppress(Exception):
            await messages.aclose()  # type: ignore[attr-defined]


@router.get(
    "/jobs/{job_id}/events",
    summary="A job's events (server-sent events): its history, then live, until terminal",
    response_class=EventSourceResponse,
)
async def job_events(
    job_id: str,
    request: Request,
    principal: Annotated[Principal, Depends(require_stream_principal)],
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventSourceResponse:
    state = api_state(request)
    after = resume_after(last_event_id)
    task = await job_task(state, job_id, principal)
    graph = task.params.get("workflow")
    events = JobEvents(request, state, len(graph) if isinstance(graph, dict) else 0, after)
    stop = anyio.Event()
    messages = with_cancel_asks(state, task.id, state.app.watch(task.id), lambda: events.running)
    return EventStream(
        _stream(request, events, messages, stop),
        ping=state.ping_interval_s,
        ping_message_factory=lambda: ServerSentEvent(comment="ping"),
        sep="\n",
        shutdown_event=stop,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
    )
