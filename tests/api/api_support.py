"""Helpers for the API tests: an app under test, a real uvicorn server, an SSE reader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

import kiln
from kiln import demo
from kiln.api import create_app
from kiln.api.server_limits import uvicorn_options
from kiln.config import Settings

ALICE_KEY = "key-alice-0123456789"
BOB_KEY = "key-bob-0123456789"
ADMIN_KEY = "key-admin-0123456789"

FAST_IMAGE: dict[str, Any] = {
    "prompt": "a red fox in snow",
    "width": 64,
    "height": 64,
    "steps": 4,
    "simulate": {"step_ms": 0},
}

TASK_FIELDS = {
    "id", "kind", "status", "final", "stage", "progress", "queue_position", "attempt",
    "max_attempts", "priority", "params", "metadata", "inputs", "idempotency_key",
    "deduplicated", "cancel_requested", "next_retry_at", "error", "result", "created_at",
    "updated_at", "started_at", "finished_at", "webhook", "resource_wait", "model",
    "scheduled_for", "rerun_of", "pipeline_id", "step", "steps",
}  # fmt: skip


def with_keys(settings: Settings) -> Settings:
    return settings.with_(api_keys={ALICE_KEY: "alice", BOB_KEY: "bob"}, admin_key=ADMIN_KEY)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def image_body(
    prompt: str = "a red fox in snow", *, params_model: str | None = None, **fields: Any
) -> dict[str, Any]:
    params = {**FAST_IMAGE, "prompt": prompt}
    if params_model is not None:
        params["model"] = params_model
    return {"kind": "image.generate", "params": params, **fields}


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The response is an error of this status and code, in the envelope shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["details"], list)
    return dict(error)


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = predicate()
        if not isinstance(outcome, bool):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


@dataclass
class ApiUnderTest:
    """A kiln App, its FastAPI app (lifespan running) and an in-process client."""

    kiln: kiln.App
    http: FastAPI
    client: httpx.AsyncClient
    key: str | None = None

    async def submit(
        self,
        body: dict[str, Any] | None = None,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        auth = bearer(key) if key else {}
        return await self.client.post(
            "/v1/tasks",
            json=image_body() if body is None else body,
            headers={**auth, **(headers or {})},
        )

    async def task_count(self) -> int:
        tasks, _ = await self.kiln.engine.store.list_tasks(tenant=None, limit=10_000)
        return len(tasks)


def make_kiln(settings: Settings) -> kiln.App:
    app = kiln.App(settings=settings)
    demo.register(app)
    return app


@contextlib.asynccontextmanager
async def running_api(
    settings: Settings,
    *,
    key: str | None = None,
    workers: int = 0,
    supervisor: bool = False,
    kiln_app: kiln.App | None = None,
) -> AsyncIterator[ApiUnderTest]:
    """The API app with its lifespan running, and an httpx client over ASGI."""
    app = kiln_app or make_kiln(settings)
    http = create_app(app, workers=workers, supervisor=supervisor)
    async with http.router.lifespan_context(http):
        transport = httpx.ASGITransport(app=http)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://kiln.test", headers=bearer(key) if key else None
        ) as client:
            yield ApiUnderTest(app, http, client, key)


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def uvicorn_server(http: FastAPI) -> uvicorn.Server:
    """uvicorn as `kiln serve` runs it: its protocols, the default server limits."""
    config = uvicorn.Config(
        http,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        **uvicorn_options(Settings()),
    )
    return uvicorn.Server(config)


@contextlib.asynccontextmanager
async def live_server(http: FastAPI) -> AsyncIterator[str]:
    """A real uvicorn server on a free 127.0.0.1 port, in this event loop."""
    sock = bound_socket()
    server = uvicorn_server(http)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started or serving.done(), 15)
        if serving.done():
            serving.result()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving
        sock.close()


@contextlib.contextmanager
def threaded_server(http: FastAPI) -> Iterator[str]:
    """A real uvicorn server on a free 127.0.0.1 port, in a thread of its own."""
    sock = bound_socket()
    server = uvicorn_server(http)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


@dataclass
class SseEvent:
    event: str | None = None
    id: str | None = None
    data: str = ""
    comments: list[str] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.data)
        return parsed


async def sse_events(response: httpx.Response) -> AsyncIterator[SseEvent]:
    """Parse a text/event-stream; comments are yielded as events with only comments."""
    current = SseEvent()
    async for line in response.aiter_lines():
        if line == "":
            if current.data or current.event or current.id or current.comments:
                yield current
            current = SseEvent()
            continue
        if line.startswith(":"):
            current.comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            current.data = f"{current.data}\n{value}" if current.data else value
        elif name == "event":
            current.event = value
        elif name == "id":
            current.id = value
    if current.data or current.event or current.comments:
        yield current


async def raw_request(
    http: FastAPI,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body_parts: list[bytes] | None = None,
) -> tuple[int, bytes]:
    """One request straight into the ASGI app: no client-side URL or header clean-up."""
    parts = list(body_parts or [])
    sent: list[dict[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        if parts:
            return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    raw_headers = [(b"host", b"kiln.test")]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("kiln.test", 80),
        "headers": raw_headers,
    }  # fmt: skip
    await http(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return int(start["status"]), body
