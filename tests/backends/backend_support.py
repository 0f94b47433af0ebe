"""Helpers for the backend tests: a kiln App on a backend, and running one task on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kiln
from kiln import backends
from kiln.app import running
from kiln.bus import Message
from kiln.config import Settings
from kiln.models import Task, TaskEvent

#: How long a test waits for a task to end before it fails (the machine may be busy).
TASK_TIMEOUT_S = 60.0


def kiln_settings(tmp_path: Path, env: dict[str, str]) -> Settings:
    """Settings read from the environment, as `kiln worker` reads them, on fresh files."""
    return Settings.from_env(
        {
            "KILN_DATA_DIR": str(tmp_path / "kiln"),
            "KILN_LEASE_TTL_S": "5",
            "KILN_RETRY_BASE_S": "0.01",
            "KILN_RETRY_MAX_S": "0.05",
            **env,
        }
    )


@contextlib.asynccontextmanager
async def kiln_on(
    settings: Settings, **register: Any
) -> AsyncIterator[tuple[kiln.App, backends.ImageGenerate]]:
    """An opened App with `image.generate` on the configured (or given) backend."""
    app = kiln.App(settings=settings)
    handler = backends.register(app, **register)
    async with app:
        yield app, handler


async def run_task(
    app: kiln.App, params: dict[str, Any], *, max_attempts: int = 3
) -> tuple[Task, list[Message]]:
    """Submit, run one worker until the task is final; the task and every event and
    progress report published for it.

    It reads the event hub itself, subscribed before the task exists: a stream
    (``App.watch``) holds back progress that overtakes the GENERATING event.
    """
    seen: list[Message] = []
    async with app.hub.subscribe() as feed:
        submitted = await app.submit("image.generate", params, max_attempts=max_attempts)
        worker = app.worker(concurrency=1, resources={"gpu": 1})
        async with running(worker.run()), asyncio.timeout(TASK_TIMEOUT_S):
            while not (seen and isinstance(seen[-1], TaskEvent) and seen[-1].final):
                message = await feed.queue.get()
                if message.task_id == submitted.task.id:
                    seen.append(message)
    assert not feed.lagged
    return await app.get(submitted.task.id), seen
