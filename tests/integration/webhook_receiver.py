"""A real HTTP receiver for the webhook tests: a threaded server on 127.0.0.1.

It records every POST (headers, body), answers with the scripted status codes in turn
(then ``default``), and, while ``hold()`` is on, keeps each request waiting without an
answer until ``release()``. Tests wait for requests with ``wait_for`` (a condition with a
deadline), never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    receiver: Receiver


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        headers = {name.lower(): value for name, value in self.headers.items()}
        status, held = self.server.receiver.take(Received(headers, body))
        if held is not None:
            held.wait(timeout=60)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Receiver:
    def __init__(self, *answers: int, default: int = 200) -> None:
        self.answers = list(answers)
        self.default = default
        self.received: list[Received] = []
        self._changed = threading.Condition()
        self._held: threading.Event | None = None
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.receiver = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/kiln"

    def take(self, request: Received) -> tuple[int, threading.Event | None]:
        with self._changed:
            self.received.append(request)
            status = self.answers.pop(0) if self.answers else self.default
            self._changed.notify_all()
            return status, self._held

    def hold(self) -> None:
        """From now on, requests wait without an answer until ``release``."""
        self._held = threading.Event()

    def release(self) -> None:
        if self._held is not None:
            self._held.set()
            self._held = None

    def _wait(self, count: int, timeout_s: float) -> list[Received]:
        with self._changed:
            if not self._changed.wait_for(lambda: len(self.received) >= count, timeout_s):
                raise AssertionError(
                    f"the receiver got {len(self.received)} requests, not {count}, "
                    f"within {timeout_s}s"
                )
            return list(self.received)

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> list[Received]:
        """Every request so far, once there are at least ``count``."""
        return await asyncio.to_thread(self._wait, count, timeout_s)

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@contextmanager
def receiving(*answers: int, default: int = 200) -> Iterator[Receiver]:
    receiver = Receiver(*answers, default=default)
    try:
        yield receiver
    finally:
        receiver.close()
