"""The two figures of ``benchmarks/http_bench.py`` that wrk cannot give: the burst of identical
submissions and the SSE fan-out.

- :func:`burst`: N identical ``POST /v1/tasks`` sent at once, each on a warm keep-alive
  connection of its own (opened just before and used once by a ``/healthz`` call), written
  and read on raw asyncio streams so the client costs little. Each request's latency runs
  from the moment all of them were fired to its answer, so it includes the client's own
  work for the N requests (on the same CPUs as the server).
- :func:`sse_fanout`: N subscribers of the tenant feed ``GET /v1/events`` on raw sockets
  (a minimal SSE reader, so the client costs little), while tasks are submitted at a
  steady rate and run on the server's in-process workers. A status event carries ``at``,
  the moment the engine made the transition (before its commit; milliseconds). Latency =
  the client's wall clock when the event's bytes were read minus ``at``: the commit, the
  event tail, the fan-out, the server's writes and the client's read, on one machine and
  one clock. Progress events carry no time and are only counted.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


# The burst ------------------------------------------------------------------------------


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 answer with a Content-Length body: (status, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def burst(url: str, key: str, count: int, prompt: str) -> dict[str, Any]:
    """``count`` identical submissions at once: how many tasks, answers and latencies.

    Each request goes on a warm keep-alive connection of its own (opened just before, and
    used once for ``/healthz``), written and read with asyncio streams and a request made
    once: a full HTTP client costs about a millisecond of CPU per request, on the CPUs
    the server needs, which would be measured as the server's latency.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps({"kind": "image.generate", "params": {"prompt": prompt}}).encode()
    request = (
        f"POST /v1/tasks HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    warm = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    streams = [await asyncio.open_connection(host, port) for _ in range(count)]
    try:
        for _, writer in streams:
            writer.write(warm)
        await asyncio.gather(*(_answer(reader) for reader, _ in streams))
        fired = time.perf_counter()

        async def one(reader: asyncio.StreamReader) -> tuple[int, str, float]:
            status, answer = await _answer(reader)
            task_id = json.loads(answer).get("id", "") if status < 300 else ""
            return status, task_id, time.perf_counter() - fired

        for _, writer in streams:
            writer.write(request)
        answers = await asyncio.gather(*(one(reader) for reader, _ in streams))
    finally:
        for _, writer in streams:
            writer.close()
    latencies_ms = [a[2] * 1000 for a in answers]
    statuses = [a[0] for a in answers]
    ids = {a[1] for a in answers}
    return {
        "requests": count,
        "task_ids": len(ids),
        "created_201": statuses.count(201),
        "answered_200": statuses.count(200),
        "other": len(statuses) - statuses.count(200) - statuses.count(201),
        "p50_ms": round(percentile(latencies_ms, 0.5), 1),
        "p99_ms": round(percentile(latencies_ms, 0.99), 1),
        "max_ms": round(max(latencies_ms), 1),
        "one_task": len(ids) == 1 and "" not in ids and statuses.count(201) == 1,
    }


# The SSE fan-out ------------------------------------------------------------------------


def _at(text: bytes) -> float:
    """``at`` of a status event's data line, as a UNIX time."""
    event = json.loads(text)
    moment = dt.datetime.fromisoformat(event["at"].replace("Z", "+00:00"))
    return moment.timestamp()


@dataclass
class Subscriber(asyncio.Protocol):
    """One ``GET /v1/events`` on a raw socket: notes each status event's latency."""

    request: bytes
    latencies_ms: list[float]
    opened: asyncio.Future[None]
    progress: int = 0
    statuses: int = 0
    _head: bool = False
    _buffer: bytes = b""
    transport: asyncio.Transport | None = field(default=None, repr=False)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self._buffer += data
        if not self._head:
            head, found, rest = self._buffer.partition(b"\r\n\r\n")
            if not found:
                return
            if not self.opened.done():
                if head.startswith(b"HTTP/1.1 200"):
                    self.opened.set_result(None)
                else:
                    self.opened.set_exception(RuntimeError(head.decode(errors="replace")))
            self._head, self._buffer = True, rest
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.startswith(b'data: {"seq"'):
                self.statuses += 1
                self.latencies_ms.append((now - _at(line[6:])) * 1000)
            elif line.startswith(b'data: {"type":"progress"'):
                self.progress += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_exception(RuntimeError(f"closed before the head: {exc}"))


async def _subscribe(host: str, port: int, key: str, count: int) -> list[Subscriber]:
    loop = asyncio.get_running_loop()
    request = (
        f"GET /v1/events HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    subscribers = [Subscriber(request, latencies, loop.create_future()) for _ in range(count)]
    for start in range(0, count, 100):  # the listen backlog is large, but be gentle
        chunk = subscribers[start : start + 100]
        await asyncio.gather(*(loop.create_connection(lambda s=s: s, host, port) for s in chunk))
    await asyncio.wait_for(asyncio.gather(*(s.opened for s in subscribers)), 60)
    return subscribers


async def _submit_steadily(
    url: str, key: str, per_s: float, seconds: float, steps: int, step_ms: int
) -> list[str]:
    ids: list[str] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as client:
        start = time.perf_counter()
        for n in range(round(per_s * seconds)):
            await asyncio.sleep(max(0.0, start + n / per_s - time.perf_counter()))
            params = {"prompt": f"fan-out {n}", "width": 64, "height": 64, "steps": steps,
                      "simulate": {"step_ms": step_ms}}  # fmt: skip
            body = {"kind": "image.generate", "params": params, "dedup": False}
            answer = await client.post("/v1/tasks", json=body)
            answer.raise_for_status()
            ids.append(answer.json()["id"])
        deadline = time.monotonic() + 60
        for task_id in ids:  # every task ends (SUCCESS) before the figure is read
            while time.monotonic() < deadline:
                task = (await client.get(f"/v1/tasks/{task_id}")).json()
                if task["final"]:
                    break
                await asyncio.sleep(0.2)
    return ids


async def sse_fanout(
    url: str, key: str, subscribers: int, per_s: float, seconds: float, steps: int, step_ms: int
) -> dict[str, Any]:
    """``subscribers`` feeds open while tasks run: per-event latency from ``at`` to read."""
    host, port = url.removeprefix("http://").split(":")
    readers = await _subscribe(host, int(port), key, subscribers)
    await asyncio.sleep(1.0)
    ids = await _submit_steadily(url, key, per_s, seconds, steps, step_ms)
    await asyncio.sleep(2.0)  # the last events reach every reader
    for reader in readers:
        if reader.transport is not None:
            reader.transport.close()
    latencies = readers[0].latencies_ms
    per_reader = [r.statuses for r in readers]
    return {
        "subscribers": subscribers,
        "tasks": len(ids),
        "tasks_per_s": per_s,
        "status_events_per_subscriber": statistics.median(per_reader),
        "fewest_status_events": min(per_reader),
        "progress_events_per_subscriber": statistics.median(r.progress for r in readers),
        "deliveries": len(latencies),
        "p50_ms": round(percentile(latencies, 0.5), 1),
        "p99_ms": round(percentile(latencies, 0.99), 1),
        "max_ms": round(max(latencies, default=0.0), 1),
    }
