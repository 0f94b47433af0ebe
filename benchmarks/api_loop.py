"""Two costs a busy queue puts on the API's event loop, on a real ``kiln serve``.

``kiln serve --no-workers --no-supervisor`` runs as a real process on 127.0.0.1 (a free
port, a temporary SQLite data dir). The queue is filled with ``--queued`` PENDING tasks of
``image.generate`` through ``POST /v1/tasks/batch`` (1,000 a request, a new prompt each),
then:

- ``list``: ``GET /v1/tasks?limit=200`` (every row a queued task with its
  ``queue_position``), ``--repeat`` times in a row; the median and the slowest;
- ``healthz``: ``GET /healthz`` started every 10 ms (on connections of their own, not
  waiting for each other) for ``--seconds`` on an idle server (the baseline), then again
  while ``POST /v1/tasks/batch`` requests of 1,000 new tasks are answered one after
  another (at least one); p50, p99 and the slowest of each.

The last stdout line is one JSON object with every figure.

    .venv/bin/python benchmarks/api_loop.py                       # 55,000 queued
    .venv/bin/python benchmarks/api_loop.py --queued 5000 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

BATCH = 1000
PROBE_EVERY_S = 0.01


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def items(start: int, count: int) -> list[dict[str, Any]]:
    return [
        {"kind": "image.generate", "params": {"prompt": f"bench {start + i}", "seed": 1}}
        for i in range(count)
    ]


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "p50_ms": round(at(0.5) * 1000, 1),
        "p99_ms": round(at(0.99) * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


async def fill(client: httpx.AsyncClient, queued: int) -> None:
    for start in range(0, queued, BATCH):
        answer = await client.post(
            "/v1/tasks/batch", json={"tasks": items(start, min(BATCH, queued - start))}
        )
        answer.raise_for_status()


async def listing(client: httpx.AsyncClient, repeat: int) -> dict[str, float]:
    took = []
    for _ in range(repeat):
        began = time.perf_counter()
        answer = await client.get("/v1/tasks", params={"limit": 200})
        took.append(time.perf_counter() - began)
        answer.raise_for_status()
        assert all(t["queue_position"] for t in answer.json()["items"])
    median, slowest = statistics.median(took), max(took)
    return {"median_ms": round(median * 1000, 1), "max_ms": round(slowest * 1000, 1)}


async def probe(client: httpx.AsyncClient, until: asyncio.Event) -> list[float]:
    """A ``GET /healthz`` started every PROBE_EVERY_S whatever the others do (so a stall
    of the loop is seen by every request that arrives during it), until ``until``."""
    took: list[float] = []

    async def one() -> None:
        began = time.perf_counter()
        (await client.get("/healthz")).raise_for_status()
        took.append(time.perf_counter() - began)

    running = set()
    while not until.is_set():
        started = asyncio.create_task(one())
        running.add(started)
        started.add_done_callback(running.discard)
        await asyncio.sleep(PROBE_EVERY_S)
    await asyncio.gather(*running)
    return took


async def healthz(url: str, seconds: float, queued: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as probe_client:
        idle = asyncio.Event()
        idle_task = asyncio.create_task(probe(probe_client, idle))
        await asyncio.sleep(seconds)
        idle.set()
        baseline = await idle_task
        done = asyncio.Event()
        busy_task = asyncio.create_task(probe(probe_client, done))
        batches: list[float] = []
        async with httpx.AsyncClient(base_url=url, timeout=120) as batch_client:
            began = time.perf_counter()
            while time.perf_counter() - began < seconds:
                sent = time.perf_counter()
                await fill_one(batch_client, queued + len(batches) * BATCH)
                batches.append(round((time.perf_counter() - sent) * 1000))
        done.set()
        busy = await busy_task
    return {"idle": quantiles(baseline), "during_batch": quantiles(busy), "batch_ms": batches}


async def fill_one(client: httpx.AsyncClient, start: int) -> None:
    (await client.post("/v1/tasks/batch", json={"tasks": items(start, BATCH)})).raise_for_status()


def serve(data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    command = ["serve", "--no-workers", "--no-supervisor", "--port", str(port)]
    return subprocess.Popen(
        [sys.executable, "-m", "kiln", *command, "--data-dir", str(data_dir)],
        env={**env, "KILN_LOG_LEVEL": "WARNING"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        server = serve(Path(folder), port)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if (await client.get("/healthz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        if time.monotonic() > deadline:
                            raise
                    await asyncio.sleep(0.1)
                await fill(client, args.queued)
                listed = await listing(client, args.repeat)
            loop = await healthz(url, args.seconds, args.queued)
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {"queued": args.queued, "list_200": listed, "healthz": loop}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=55_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    figures = asyncio.run(main(parser.parse_args()))
    print(json.dumps(figures))
