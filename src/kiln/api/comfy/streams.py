"""``GET /api/v2/jobs/{id}/events``: a job's events as v2 server-sent events.

The stream is kiln's task stream (:meth:`kiln.App.watch`: the status history from the
event log, then live, until the final event) told in v2's words, from ``Last-Event-ID`` on:
``status``, ``progress``, ``preview``, ``output`` (each output, before ``succeeded``) and
``log`` (the failure, before ``failed``/``expired``). A status change's ``id`` is its event
seq; an event derived from one is ``<seq>.<n>``, ``<seq>`` being the status change before
it, so ``Last-Event-ID`` of either resumes after that status change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
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

PREVIEW_PREFIX = "data:"


def resume_after(last_event_id: str | None) -> int | None:
    """The status change a stream resumes after: ``41`` and ``41.3`` both say 41."""
    if last_event_id is None or not last_event_id.strip():
        return None
    head = last_event_id.strip().split(".", 1)[0]
    if not head.isdigit() or int(head) > MAX_SEQ:
        raise V2Error("invalid_request", "Last-Event-ID must be an id this stream sent", 400)
    return int(head)


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

    def __init__(self, request: Request, state: ApiState, nodes: int, after: int | None):
        self.request = request
        self.state = state
        self.nodes = nodes
        self.after = after or 0
        self.seq = 0
        self.n = 0
        self.status: str | None = None

    def _derived_id(self) -> str:
        self.n += 1
        return f"{self.seq}.{self.n}"

    async def of(self, message: Message) -> list[ServerSentEvent]:
        if isinstance(message, TaskEvent):
            return await self._status(message)
        return self._progress(message)

    async def _status(self, event: TaskEvent) -> list[ServerSentEvent]:
        status = shapes.job_status(event.status)
        if event.seq <= self.after:  # the client has it: only where the job stood
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


async def _stream(
    request: Request, events: JobEvents, messages: AsyncIterator[Message], stop: anyio.Event
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
    return EventStream(
        _stream(request, events, state.app.watch(task.id), stop),
        ping=state.ping_interval_s,
        ping_message_factory=lambda: ServerSentEvent(comment="ping"),
        sep="\n",
        shutdown_event=stop,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
    )
