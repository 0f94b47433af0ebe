"""`kiln worker` with KILN_BACKEND set: it serves the kind on that backend and reports the
upstream histogram and breaker gauge on --metrics-port."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from backend_support import TASK_TIMEOUT_S, kiln_settings
from upstream_fakes import FakeOpenAI

import kiln
from kiln import backends
from kiln.states import Status


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def worker_env(openai_fake: FakeOpenAI, tmp_path: Path) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("KILN_")},
        "KILN_DATA_DIR": str(tmp_path / "kiln"),
        "KILN_BACKEND": "openai-images",
        "KILN_OPENAI_BASE_URL": f"{openai_fake.base_url}/v1",
        "KILN_OPENAI_MODEL": "dall-e-3",
    }


@pytest.fixture
def worker_process(worker_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A `kiln worker` process with its metrics port; stopped by its PID."""
    port, log = free_port(), tmp_path / "worker.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln", "worker", "--concurrency", "1",
             "--metrics-port", str(port)],
            env=worker_env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield port, log
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


async def scrape(port: int, wanted: str) -> str:
    """The worker's metrics once they contain ``wanted`` (it starts serving in a moment)."""
    async with httpx.AsyncClient() as http, asyncio.timeout(TASK_TIMEOUT_S):
        while True:
            try:
                text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                if wanted in text:
                    return text
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)  # polling a server that is starting, not a sync point


@pytest.mark.slow
async def test_kiln_worker_runs_the_configured_backend_and_reports_it(
    openai_fake: FakeOpenAI, worker_process: tuple[int, Path], tmp_path: Path
) -> None:
    port, log = worker_process
    # Given a kiln worker process started with KILN_BACKEND=openai-images
    app = kiln.App(settings=kiln_settings(tmp_path, {}))
    backends.register(app)  # this process only submits and watches
    async with app:
        # When a task is submitted
        submitted = await app.submit("image.generate", {"prompt": "a red fox in snow"})
        done = await app.wait(submitted.task.id, timeout_s=TASK_TIMEOUT_S)

    # Then the worker made it through the fake upstream
    assert done.status is Status.SUCCESS, (done.error, log.read_text())
    assert openai_fake.calls == 1
    # And its metrics port reports the call and the breaker
    text = await scrape(port, "kiln_upstream_request_seconds_count")
    assert 'kiln_upstream_request_seconds_count{backend="openai-images",outcome="ok"} 1.0' in text
    assert 'kiln_upstream_breaker_open{backend="openai-images"} 0.0' in text
    assert "kiln_worker_attempts_completed_total 1.0" in text
