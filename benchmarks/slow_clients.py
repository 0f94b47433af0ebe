"""Slow clients against a real ``kiln serve``: how long until a new client is served again.

Starts ``kiln serve --no-workers`` on a free loopback port with ``KILN_MAX_CONNECTIONS``
and an API key, then opens that many connections, each sending a request head with a large
``Content-Length`` whose body the server does not read (an unauthorised ``POST
/v1/tasks``, answered 401; a ``GET /healthz`` with a body), and trickling one byte of the
body every ``--trickle-s``. Meanwhile a probe opens a fresh connection every 0.2 s and asks
``GET /healthz``. It prints, as one JSON line, how many probes were refused 503
``server_busy``, and the seconds from the last slow connection's 401/200 until the first
probe answered 200, and until the server had closed every slow connection (``null``
when that did not happen within ``--limit-s``)::

    python benchmarks/slow_clients.py                       # 50 connections, default timeouts
    python benchmarks/slow_clients.py --body-timeout-s 2    # KILN_BODY_TIMEOUT_S=2

Everything is on 127.0.0.1 and ends within ``--limit-s`` (plus the server's start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KEY = "bench-key"
HEADS = (
    b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000000\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ask_healthz(port: int) -> int:
    """The status a fresh connection gets for ``GET /healthz`` (0: no answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.settimeout(2)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            line = sock.recv(64).split(b"\r\n", 1)[0]
            return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
    except (OSError, ValueError, IndexError):
        return 0


def start_server(root: Path, port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env |= {"KILN_MAX_CONNECTIONS": str(args.connections), "KILN_API_KEYS": f"bench:{KEY}"}
    if args.body_timeout_s is not None:
        env["KILN_BODY_TIMEOUT_S"] = str(args.body_timeout_s)
    command = [sys.executable, "-m", "kiln", "serve", "--no-workers", "--port", str(port)]
    command += ["--data-dir", str(root / "data")]
    log = (root / "serve.log").open("wb")
    popen = subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while ask_healthz(port) != 200:
        if popen.poll() is not None or time.monotonic() > deadline:
            popen.kill()
            sys.exit(f"kiln serve did not start:\n{(root / 'serve.log').read_text()}")
        time.sleep(0.1)
    return popen


def open_slow(port: int, count: int) -> list[socket.socket]:
    """``count`` connections, each answered without its body being read."""
    held = []
    for n in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(HEADS[n % 2] + b"{")
        answer = sock.recv(65536)
        if not answer.startswith((b"HTTP/1.1 401", b"HTTP/1.1 200")):
            sys.exit(f"slow connection {n} was answered {answer[:60]!r}")
        sock.setblocking(False)  # trickling never waits on one connection
        held.append(sock)
    return held


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def trickle(held: list[socket.socket], period_s: float, stop: threading.Event) -> float | None:
    """One body byte per connection every ``period_s`` until ``stop``; the seconds until
    the server had closed them all (None if it had not)."""
    started = time.monotonic()
    open_ = set(range(len(held)))
    while open_ and not stop.wait(period_s):
        for n in list(open_):
            if closed_by_server(held[n]):
                open_.discard(n)
                continue
            with contextlib.suppress(OSError):
                held[n].sendall(b" ")
    return None if open_ else round(time.monotonic() - started, 2)


def measure(port: int, args: argparse.Namespace) -> dict[str, object]:
    held = open_slow(port, args.connections)
    started = time.monotonic()
    stop = threading.Event()
    closed: list[float | None] = []
    thread = threading.Thread(target=lambda: closed.append(trickle(held, args.trickle_s, stop)))
    thread.start()
    refused, served_after = 0, None
    try:
        while time.monotonic() - started < args.limit_s:
            status = ask_healthz(port)
            if status == 200:
                served_after = round(time.monotonic() - started, 2)
                break
            refused += status == 503
            time.sleep(0.2)
        while thread.is_alive() and time.monotonic() - started < args.limit_s:
            time.sleep(0.2)  # until the server closed every slow connection, or the limit
    finally:
        stop.set()
        thread.join()
        for sock in held:
            sock.close()
    return {
        "connections": args.connections,
        "body_timeout_s": args.body_timeout_s,
        "limit_s": args.limit_s,
        "probes_503": refused,
        "served_after_s": served_after,
        "all_slow_closed_after_s": closed[0] if closed else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--body-timeout-s", type=float, default=None)
    parser.add_argument("--trickle-s", type=float, default=0.5)
    parser.add_argument("--limit-s", type=float, default=100.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-slow-") as tmp:
        port = free_port()
        popen = start_server(Path(tmp), port, args)
        try:
            print(json.dumps(measure(port, args)))
        finally:
            popen.terminate()
            popen.wait(timeout=15)


if __name__ == "__main__":
    main()
