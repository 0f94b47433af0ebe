"""A task's event stream: :class:`SSEDecoder` parses server-sent event lines, and
:class:`Follow` keeps one stream's place (its last event id, its deadline, its failures)
across reconnections, for both clients."""

from __future__ import annotations

import json
import time

import httpx

from kiln import wire
from kiln.client.calls import Call
from kiln.client.responses import JSON, ConnectionFailed, connection_failed

#: A silent event stream is dropped and resumed after this long (servers ping more often).
STREAM_READ_S = 60.0
#: With a deadline, the sync client re-checks it at least this often on a silent stream.
DEADLINE_TICK_S = 2.0
#: Consecutive failed reconnections of an event stream before giving up.
STREAM_RETRIES = 10


class SSEDecoder:
    """Server-sent event lines in, parsed messages out (dicts with a ``type``).

    ``last_id`` is the stream's last event id, the value to resume from.
    """

    def __init__(self) -> None:
        self.last_id: str | None = None
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, line: str) -> JSON | None:
        """Take one line (without its end of line); a message when a blank line ends one."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None

    def _dispatch(self) -> JSON | None:
        event, data = self._event, self._data
        self._event, self._data = None, []
        if not data:
            return None
        text = "\n".join(data)
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        message: JSON = parsed if isinstance(parsed, dict) else {"data": parsed}
        message.setdefault("type", event or "message")
        return message


class Follow:
    """The state of one task's event stream across reconnections."""

    def __init__(self, task_id: str, after: int | None, deadline: float | None = None) -> None:
        self.task_id = task_id
        self.last_id = None if after is None else str(after)
        self.deadline = deadline
        self.ended = False
        self.opened = False
        self.failures = 0
        self.decoder = SSEDecoder()

    def call(self) -> Call:
        headers = {"Accept": "text/event-stream"}
        if self.last_id is not None:
            headers["Last-Event-ID"] = self.last_id
        return Call("GET", wire.task_path(self.task_id, "events"), headers=headers)

    def read_timeout_s(self) -> float:
        if self.deadline is None:
            return STREAM_READ_S
        return max(min(self.remaining_s(), DEADLINE_TICK_S), 0.001)

    def remaining_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def check_deadline(self) -> None:
        if self.remaining_s() <= 0:
            raise TimeoutError(f"task {self.task_id} did not finish in time")

    def connected(self) -> None:
        self.opened = True
        self.decoder = SSEDecoder()
        self.decoder.last_id = self.last_id

    def feed(self, line: str) -> JSON | None:
        message = self.decoder.feed(line)
        self.last_id = self.decoder.last_id
        if message is not None:
            self.failures = 0
            if message.get("type") == "status":
                self.ended = bool(message.get("final"))
        return message

    def dropped(self, server: str, exc: httpx.TransportError) -> float:
        """The pause before reconnecting; raises once reconnecting keeps failing."""
        self.check_deadline()
        if isinstance(exc, httpx.ReadTimeout) and self.deadline is not None:
            return 0.0  # a deadline tick, not a failure
        self.failures += 1
        if self.failures > STREAM_RETRIES or not self.opened:
            raise connection_failed(server, exc) from exc
        return min(0.1 * 2.0 ** (self.failures - 1), 2.0)

    def closed_early(self, server: str) -> float:
        """The server closed the stream before a final event: pause, then resume."""
        self.failures += 1
        if self.failures > STREAM_RETRIES:
            raise ConnectionFailed(f"the event stream of {self.task_id} on {server} keeps closing")
        return min(0.1 * 2.0 ** (self.failures - 1), 2.0)
