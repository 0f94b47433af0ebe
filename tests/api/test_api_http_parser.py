"""The HTTP/1.1 parser of `kiln serve` (httptools), against a real server over raw sockets:
what it refuses besides the server limits (a request that would be read two ways, a version
it does not serve), pipelined requests, and the head limit on a head that arrives behind
another request in the same read. Every refusal is the error envelope; the server keeps
serving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from test_api_server_limits import (
    assert_envelope,
    connect,
    kiln_serve,
    parse,
    read_all,
    read_response,
    still_serving,
)

pytestmark = pytest.mark.slow

HEADER_LIMIT = 4096


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    with kiln_serve(
        tmp_path_factory.mktemp("parser"), KILN_MAX_HEADER_BYTES=str(HEADER_LIMIT)
    ) as server:
        yield server


def answer_to(port: int, raw: bytes) -> bytes:
    with connect(port) as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(raw)
        return read_all(sock)


def test_a_body_framed_two_ways_is_refused(served: tuple[str, int]) -> None:
    # Content-Length and chunked together: a proxy in front may read the body the other
    # way, and take what follows it for another request (request smuggling)
    url, port = served
    raw = (
        b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    assert_envelope(answer_to(port, raw), 400, "invalid_request")
    still_serving(url)


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/3.1", b"HTTP/1.2"])
def test_a_request_line_of_another_http_version_is_refused(
    served: tuple[str, int], version: bytes
) -> None:
    url, port = served
    raw = b"GET /healthz " + version + b"\r\nHost: x\r\n\r\n"
    assert_envelope(answer_to(port, raw), 400, "invalid_request")
    still_serving(url)


def test_http_1_0_is_served_and_closed(served: tuple[str, int]) -> None:
    _, port = served
    status, headers, body = parse(answer_to(port, b"GET /healthz HTTP/1.0\r\n\r\n"))
    assert (status, body) == (200, {"status": "ok"})
    assert headers["connection"] == "close"


def test_pipelined_requests_are_answered_in_order(served: tuple[str, int]) -> None:
    _, port = served
    answer = answer_to(
        port,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    statuses = [int(line.split()[0]) for line in answer.split(b"HTTP/1.1 ")[1:]]
    assert statuses == [200, 404, 200]


def test_a_head_over_the_limit_behind_another_request_is_431(served: tuple[str, int]) -> None:
    url, port = served
    first = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    second = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 2 * HEADER_LIMIT + b"\r\n\r\n"
    answer = answer_to(port, first + second)
    # the connection ends with the refusal (the first request may be answered before it)
    last = answer[answer.rindex(b"HTTP/1.1 ") :]
    assert "KILN_MAX_HEADER_BYTES" in assert_envelope(last, 431, "headers_too_large")
    still_serving(url)


def test_a_head_over_the_limit_after_a_body_is_431(served: tuple[str, int]) -> None:
    # The body is unread (GET /healthz) and arrives with the next head in one read
    url, port = served
    first = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(first)
        assert read_response(sock) == 200
        with contextlib.suppress(ConnectionError):
            sock.sendall(b"abc" + b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * 2 * HEADER_LIMIT)
            sock.sendall(b"\r\n\r\n")
        answer = read_all(sock)
    assert "KILN_MAX_HEADER_BYTES" in assert_envelope(answer, 431, "headers_too_large")
    still_serving(url)


def head_of(size: int) -> bytes:
    """A ``GET /healthz`` request head of exactly ``size`` bytes, blank line included."""
    start = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


@pytest.mark.parametrize("piece", [1, 7])
@pytest.mark.parametrize(("size", "status"), [(HEADER_LIMIT, 200), (HEADER_LIMIT + 1, 431)])
def test_a_head_in_pieces_is_measured_to_the_byte(
    served: tuple[str, int], piece: int, size: int, status: int
) -> None:
    url, port = served
    head = head_of(size)
    with connect(port) as sock:
        with contextlib.suppress(ConnectionError):
            for start in range(0, len(head), piece):
                sock.sendall(head[start : start + piece])
        assert parse(read_all(sock))[0] == status
    still_serving(url)
