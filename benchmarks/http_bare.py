"""The reference of ``benchmarks/http_bench.py``: a bare FastAPI app answering constant JSON.

It serves the routes the benchmark drives (``GET /healthz``, ``GET /v1/tasks/{task_id}``,
``POST /v1/tasks``) on the uvicorn settings of ``kiln serve`` (``kiln.cli.processes``):
the same event loop (uvloop when installed), uvicorn's httptools protocol (``--http h11``:
uvicorn's h11 protocol, with the same head limit), the same graceful-shutdown timeout,
uvicorn's access log off as ``kiln serve`` has it by default (``--access-log``: on, as
``KILN_ACCESS_LOG=1`` has it). It reads nothing of the request: no auth, no body parsing,
no store::

    python benchmarks/http_bare.py --port 8001
    python benchmarks/http_bare.py --port 8001 --http h11 --access-log
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn
from fastapi import FastAPI

#: A task as ``kiln serve`` answers it (API.md's shape), always the same.
TASK: dict[str, Any] = {
    "id": "tsk_01m8t05mhdaq8z8d5k1a127pv4", "kind": "image.generate", "status": "PENDING",
    "final": False, "stage": None, "progress": None, "queue_position": 1,
    "resource_wait": None, "attempt": 0, "max_attempts": 3, "priority": 0,
    "params": {"format": "png", "height": 512, "prompt": "a red fox in snow 1",
               "seed": 2098074635, "steps": 30, "width": 512},
    "metadata": {}, "inputs": [], "idempotency_key": None, "deduplicated": False,
    "cancel_requested": False, "next_retry_at": None, "error": None, "result": None,
    "created_at": "2026-12-01T23:48:49.837Z", "updated_at": "2026-12-01T23:48:49.837Z",
    "started_at": None, "finished_at": None, "webhook": None,
}  # fmt: skip

app = FastAPI()


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/v1/tasks/{task_id}")
async def get_task(task_id: str) -> dict[str, Any]:
    return TASK


@app.post("/v1/tasks", status_code=201)
async def submit_task() -> dict[str, Any]:
    return TASK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-header-bytes", type=int, default=32 * 1024)
    parser.add_argument("--http", choices=("httptools", "h11"), default="httptools")
    parser.add_argument("--access-log", action="store_true", help="uvicorn's access log on")
    args = parser.parse_args()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=5,
        http=args.http,
        h11_max_incomplete_event_size=args.max_header_bytes,
        access_log=args.access_log,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
