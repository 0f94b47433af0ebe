"""The HTTP server's own limits, against a real `kiln serve` on 127.0.0.1 over raw sockets:
request head size, open connections, the time to send a head and a body (read by the app
or not), WebSocket handshakes. Each refusal is the error envelope and names its setting;
the server keeps serving.

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
from websockets.sync.client import connect as ws_connect

pytestmark = pytest.mark.slow

#: A socket waits this long at most for the server (every limit below is far shorter).
SOCKET_TIMEOUT_S = 15.0
HEADER_LIMIT = 4096
CONNECTION_LIMIT = 6
#: A client that trickles a body gets this long to see the server close its connection.
CLOSE_DEADLINE_S = 15.0
KEY = "slow-clients-key"


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


# Bodies the app does not read ------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """An API key (so a request without it is 401 before its body is read), the default
    head limit, a short body deadline, few connections."""
    with kiln_serve(
        tmp_path_factory.mktemp("keyed"),
        KILN_API_KEYS=f"acme:{KEY}",
        KILN_BODY_TIMEOUT_S="1",
        KILN_MAX_CONNECTIONS=str(CONNECTION_LIMIT),
    ) as served:
        yield served


#: Requests answered without their body being read, each announcing a 100 kB body.
UNREAD_BODIES = {
    "401": b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
    "healthz": b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
    "get_with_body": (
        f"GET /v1/tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
    ),
}
UNREAD_STATUS = {"401": 401, "healthz": 200, "get_with_body": 200}


def read_response(sock: socket.socket) -> int:
    """One response with a Content-Length, read whole; its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers, _ = parse(head + b"\r\n\r\n")
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of a response"
        body += chunk
    return status


def send_unread_body(port: int, name: str) -> socket.socket:
    """A connection whose request was answered (read here) while its body is still due."""
    sock = connect(port)
    sock.sendall(UNREAD_BODIES[name] + b'Content-Length: 100000\r\n\r\n{"kind": ')
    assert read_response(sock) == UNREAD_STATUS[name]
    return sock


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server ended the connection (what it sent is not looked at)."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(65536) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def trickle_until_closed(socks: list[socket.socket], deadline_s: float = CLOSE_DEADLINE_S) -> bool:
    """Send one more body byte on each connection every 0.1 s until the server closed them
    all (True) or the deadline passed (False)."""
    deadline = time.monotonic() + deadline_s
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        for sock in list(open_):
            try:
                sock.sendall(b" ")
            except ConnectionError:
                open_.remove(sock)
                continue
            if closed_by_server(sock, 0.1 / len(socks)):
                open_.remove(sock)
    return not open_


@pytest.mark.parametrize("name", list(UNREAD_BODIES))
def test_an_unread_body_that_trickles_is_closed_at_the_body_timeout(
    keyed: tuple[str, int], name: str
) -> None:
    url, port = keyed
    with send_unread_body(port, name) as sock:
        assert trickle_until_closed([sock])
    still_serving(url)


def test_trickled_unread_bodies_do_not_keep_the_server_busy(keyed: tuple[str, int]) -> None:
    url, port = keyed
    names = list(UNREAD_BODIES)
    held = [send_unread_body(port, names[n % len(names)]) for n in range(CONNECTION_LIMIT)]
    try:
        with connect(port) as extra:  # every connection is held: the server is busy
            assert_envelope(read_all(extra), 503, "server_busy")
        assert trickle_until_closed(held)
    finally:
        for sock in held:
            sock.close()
    # Every slot came back: as many new clients as the limit are served at once
    fresh = [connect(port) for _ in range(CONNECTION_LIMIT)]
    try:
        for sock in fresh:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock) == 200
    finally:
        for sock in fresh:
            sock.close()
    still_serving(url)


def test_an_unread_body_sent_in_time_keeps_the_connection(keyed: tuple[str, int]) -> None:
    _, port = keyed
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        assert read_response(sock) == 200
        sock.sendall(b"hello")  # drained by the server
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock) == 200


def test_unread_body_bytes_do_not_restart_the_keep_alive_timer(tmp_path: Path) -> None:
    # The default body deadline (60 s) is far longer than the keep-alive timeout (5 s)
    with kiln_serve(tmp_path) as (url, port), send_unread_body(port, "healthz") as sock:
        assert trickle_until_closed([sock])
        still_serving(url)


# Head size in one read, WebSocket handshakes ---------------------------------------------


def head_of(size: int) -> bytes:
    """A ``GET /healthz`` request head of exactly ``size`` bytes, blank line included."""
    start = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


@pytest.mark.parametrize("size", [32 * 1024 + 1, 40 * 1024, 120 * 1024])
def test_a_head_over_the_limit_in_one_send_is_431(keyed: tuple[str, int], size: int) -> None:
    url, port = keyed
    with connect(port) as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(head_of(size))
        answer = read_all(sock)
    assert "KILN_MAX_HEADER_BYTES" in assert_envelope(answer, 431, "headers_too_large")
    still_serving(url)


def test_a_head_at_the_limit_in_one_send_is_served(keyed: tuple[str, int]) -> None:
    _, port = keyed
    with connect(port) as sock:
        sock.sendall(head_of(32 * 1024))
        assert parse(read_all(sock))[0] == 200


UPGRADE = (
    b"GET /v1/tasks/tsk_x/ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
)
WS_KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
BAD_HANDSHAKES = {
    "no_key": (UPGRADE + b"Sec-WebSocket-Version: 13\r\n\r\n", 400, "invalid_request"),
    "bad_version": (
        UPGRADE + b"Sec-WebSocket-Version: 12\r\nSec-WebSocket-Key: " + WS_KEY + b"\r\n\r\n",
        400,
        "invalid_request",
    ),
    "not_a_get": (
        UPGRADE.replace(b"GET", b"POST") + b"Sec-WebSocket-Version: 13\r\n\r\n",
        405,
        "method_not_allowed",
    ),
    # within KILN_MAX_HEADER_BYTES, past the 8 KiB line of the WebSocket library
    "long_header_line": (
        UPGRADE + b"Sec-WebSocket-Version: 13\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n",
        431,
        "headers_too_large",
    ),
}


@pytest.mark.parametrize("name", list(BAD_HANDSHAKES))
def test_a_malformed_websocket_handshake_gets_the_envelope(
    keyed: tuple[str, int], name: str
) -> None:
    url, port = keyed
    raw, status, code = BAD_HANDSHAKES[name]
    with connect(port) as sock:
        sock.sendall(raw)
        answer = read_all(sock)
    assert_envelope(answer, status, code)
    still_serving(url)


def test_streams_still_work_through_the_server_limits(keyed: tuple[str, int]) -> None:
    url, port = keyed
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"kind": "image.generate", "params": {"prompt": "a fox in the snow"}}
    created = httpx.post(f"{url}/v1/tasks", json=body, headers=auth, timeout=5)
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    # Server-sent events: the first event is the task as it is
    with httpx.stream("GET", f"{url}/v1/tasks/{task_id}/events", headers=auth, timeout=10) as sse:
        assert sse.status_code == 200
        data = next(line for line in sse.iter_lines() if line.startswith("data:"))
    assert json.loads(data.removeprefix("data:"))["task_id"] == task_id
    # WebSocket: the same first message
    ws_url = f"ws://127.0.0.1:{port}/v1/tasks/{task_id}/ws?access_token={KEY}"
    with ws_connect(ws_url, open_timeout=10) as ws:
        message = json.loads(ws.recv(timeout=10))
    assert message["task_id"] == task_id
