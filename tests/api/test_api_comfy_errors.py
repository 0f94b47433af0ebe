"""What kiln answers outside the v2 routes, on ``/api/v2`` paths: the router's own 404
and 405, a crash, a body that arrives too slowly. Each answer must be v2's envelope (the
client's own ``ErrorEnvelope`` model: ``details`` an object or null), while ``/v1`` keeps
API.md's (``details`` a list)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from api_support import ALICE_KEY, ApiUnderTest
from comfy_low.models import ErrorEnvelope
from comfy_support import comfy_server
from fastapi import FastAPI

from kiln.api import comfy, errors
from kiln.config import Settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def server(settings: Settings) -> AsyncIterator[tuple[str, ApiUnderTest]]:
    """kiln serving /api/v2, no worker (no ComfyUI); a body must arrive within half a second."""
    async with comfy_server(settings.with_(body_timeout_s=0.5)) as found:
        yield found


def v2_error(response: httpx.Response, status: int, code: str) -> ErrorEnvelope:
    assert response.status_code == status, response.text
    envelope = ErrorEnvelope.model_validate(response.json())
    assert envelope.error.code == code and envelope.error.message
    assert response.json()["error"]["details"] is None
    return envelope


async def test_the_routers_own_refusals_on_v2_paths_are_v2_errors(
    server: tuple[str, ApiUnderTest],
) -> None:
    _, api = server
    # Given a path under /api/v2 that kiln does not serve, and methods a path does not take
    v2_error(await api.client.get("/api/v2/nope"), 404, "not_found")
    v2_error(await api.client.get("/api/v2"), 404, "not_found")
    refused = await api.client.delete("/api/v2/jobs")
    v2_error(refused, 405, "method_not_allowed")
    # Then the 405 keeps the router's Allow header
    assert "POST" in refused.headers["allow"]
    # And /v1 keeps its own envelope
    v1 = await api.client.get("/v1/nope")
    assert v1.status_code == 404 and v1.json()["error"]["details"] == []


async def test_a_slow_body_on_a_v2_path_is_408_in_the_v2_envelope_and_ends_the_connection(
    server: tuple[str, ApiUnderTest],
) -> None:
    # Given a client that sends a submission's head and only part of its body
    base, _ = server
    host, _, port = base.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        "POST /api/v2/jobs HTTP/1.1\r\nHost: kiln\r\n"
        f"Authorization: Bearer {ALICE_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    writer.write(head.encode() + b'{"workflow":')
    await writer.drain()
    # When the body deadline passes, Then the answer is v2's 408, and the server hangs up
    answer = await reader.read()  # to the end: the server closes the connection
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    assert b"connection: close" in headers.lower().split(b"\r\n")
    envelope = ErrorEnvelope.model_validate_json(body)
    assert envelope.error.code == "request_timeout" and envelope.error.details is None


async def test_a_crash_on_a_v2_path_is_500_in_the_v2_envelope() -> None:
    # Given kiln's error handlers and the v2 ones, and routes that crash on each face
    api = FastAPI()
    errors.install(api)
    comfy.install_errors(api)

    @api.get("/api/v2/crash")
    @api.get("/v1/crash")
    async def crash() -> None:
        raise RuntimeError("a bug")

    transport = httpx.ASGITransport(app=api, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
        # Then the v2 path answers v2's envelope, and /v1 its own
        v2_error(await client.get("/api/v2/crash"), 500, "internal_error")
        v1 = await client.get("/v1/crash")
    assert v1.status_code == 500 and v1.json()["error"]["details"] == []
