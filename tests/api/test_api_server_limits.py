"""The HTTP server's own limits, against a real `kiln serve` on 127.0.0.1 over raw sockets:
request head size, open connections, the time to send a head and a body. Each refusal is
the error envelope and names its setting; the server keeps serving.

Every socket has a timeout and every loop a bound, so nothing here can hang: a server that
held a connection too long fails the test by the socket's timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

#: A socket waits this long at most for the server (every limit below is far shorter).
SOCKET_TIMEOUT_S = 15.0
HEADER_LIMIT = 4096
CONNECTION_LIMIT = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _healthy(url: str, popen: subprocess.Popen[bytes], log: Path) -> bool:
    if popen.poll() is not None:
        pytest.fail(f"kiln serve exited with {popen.returncode}:\n{log.read_text()}")
    try:
        return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def kiln_serve(root: Path, **env: str) -> Iterator[tuple[str, int]]:
    """`kiln serve --no-workers` with ``env``; yields (url, port); stops it by its pid."""
    port = _free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")} | env
    log = root / f"serve-{port}.log"
    args = ["serve", "--no-workers", "--port", str(port), "--data-dir", str(root / "data")]
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "kiln", *args], stdout=out, stderr=subprocess.STDOUT,
            env=full_env, cwd=root,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _healthy(url, popen, log):
            assert time.monotonic() < deadline, f"kiln serve did not start:\n{log.read_text()}"
            time.sleep(0.05)
        yield url, port
    finally:
        popen.terminate()
        try:
            popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=15)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """Small limits, short deadlines."""
    with kiln_serve(
        tmp_path_factory.mktemp("limits"),
        KILN_MAX_HEADER_BYTES=str(HEADER_LIMIT),
        KILN_HEADER_TIMEOUT_S="1",
        KILN_BODY_TIMEOUT_S="1",
    ) as served:
        yield served


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S)
    sock.settimeout(SOCKET_TIMEOUT_S)
    return sock


def read_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while len(data) < limit:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def parse(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return status, headers, json.loads(body) if body else None


def assert_envelope(raw: bytes, status: int, code: str) -> str:
    got, headers, body = parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"].startswith("application/json")
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    return message


def still_serving(url: str) -> None:
    assert httpx.get(f"{url}/healthz", timeout=5).json() == {"status": "ok"}


def test_a_huge_header_is_refused_with_431_before_it_is_read(server: tuple[str, int]) -> None:
    url, port = server
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        with contextlib.suppress(ConnectionError):  # the server may close while we send
            for _ in range(1000):  # up to 64 MB, far past the limit
                sock.sendall(b"a" * 65536)
                sent += 65536
        answer = read_all(sock)
    message = assert_envelope(answer, 431, "headers_too_large")
    assert "KILN_MAX_HEADER_BYTES" in message
    assert sent < 8 * 1024 * 1024  # refused long before the 64 MB were sent
    still_serving(url)


def test_a_request_head_that_never_ends_gets_408_and_is_closed(server: tuple[str, int]) -> None:
    url, port = server
    socks = [connect(port) for _ in range(20)]
    try:
        for sock in socks:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        answers = [read_all(sock) for sock in socks]  # the server ends each one
    finally:
        for sock in socks:
            sock.close()
    for answer in answers:
        assert "KILN_HEADER_TIMEOUT_S" in assert_envelope(answer, 408, "request_timeout")
    still_serving(url)


def test_an_idle_connection_is_closed(server: tuple[str, int]) -> None:
    _, port = server
    with connect(port) as sock:
        assert read_all(sock) == b""


def test_a_body_that_never_ends_gets_408(server: tuple[str, int]) -> None:
    url, port = server
    with connect(port) as sock:
        sock.sendall(
            b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"kind": '
        )
        answer = read_all(sock)
    assert "KILN_BODY_TIMEOUT_S" in assert_envelope(answer, 408, "request_timeout")
    page = httpx.get(f"{url}/v1/tasks", timeout=5).json()
    assert page["items"] == []
    still_serving(url)


def test_a_request_that_is_not_http_gets_400_in_the_envelope(server: tuple[str, int]) -> None:
    url, port = server
    with connect(port) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = read_all(sock)
    assert_envelope(answer, 400, "invalid_request")
    still_serving(url)


def test_a_trailing_slash_is_404_in_the_envelope_without_redirect(
    server: tuple[str, int],
) -> None:
    url, _ = server
    response = httpx.get(f"{url}/v1/tasks/", headers={"Host": "evil.example"}, timeout=5)
    assert response.status_code == 404
    assert "location" not in response.headers
    assert response.json()["error"]["code"] == "not_found"


def test_connections_past_the_limit_get_503_and_are_closed(tmp_path: Path) -> None:
    with kiln_serve(tmp_path, KILN_MAX_CONNECTIONS=str(CONNECTION_LIMIT)) as (url, port):
        held = [connect(port) for _ in range(CONNECTION_LIMIT)]
        try:
            # The server counted them all: each answers a request, and stays open
            for sock in held:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            with connect(port) as extra:
                answer = read_all(extra)
            message = assert_envelope(answer, 503, "server_busy")
            assert "KILN_MAX_CONNECTIONS" in message
            assert parse(answer)[1]["retry-after"] == "1"
        finally:
            for sock in held:
                sock.close()
        # Once they are gone, the server serves again
        deadline = time.monotonic() + 10
        while True:
            try:
                still_serving(url)
                break
            except (httpx.TransportError, json.JSONDecodeError, AssertionError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
