"""The bytes of a server-sent event: a message's block, encoded once per fan-out."""

from __future__ import annotations

import json

from sse_starlette import ServerSentEvent

from kiln.bus import Message
from kiln.models import TaskEvent


def sse_event(message: Message) -> ServerSentEvent:
    data = json.dumps(message.to_json(), separators=(",", ":"))
    if isinstance(message, TaskEvent):
        return ServerSentEvent(data=data, id=str(message.seq), event="status")
    return ServerSentEvent(data=data, event="progress")


class EncodedEvents:
    """Each message's SSE bytes, encoded once for every stream that sends it.

    The hub hands the same message object to every subscriber, so a fan-out to N streams
    encodes it once, not N times. An entry holds the message itself, so its ``id`` cannot
    be reused while the entry lives; the oldest entries go first.
    """

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._found: dict[int, tuple[Message, bytes]] = {}

    def __call__(self, message: Message) -> bytes:
        found = self._found.get(id(message))
        if found is not None and found[0] is message:
            return found[1]
        encoded = sse_event(message).encode()
        if len(self._found) >= self.size:
            del self._found[next(iter(self._found))]
        self._found[id(message)] = (message, encoded)
        return encoded
