"""Warm-model routing with real `kiln worker` processes on SQLite and PostgreSQL: two
workers that can each hold one model, a stream of tasks for two models, and the loads it
costs with routing and without; and a task of another model is not starved by a flood of
the model a worker holds (docs/scheduling.md)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.states import Event, Status

from .cli_workers import CliWorkers
from .conftest import wait_for_status

pytestmark = pytest.mark.slow

#: A demo model "loads" this long; a worker holds one (KILN_MODEL_MEMORY_GB = one model).
LOAD_S = 0.3
WAIT_S = 5.0
MakeWorkers = Callable[..., CliWorkers]


def model_workers(make: MakeWorkers, root: Path, database_url: str, wait_s: float) -> CliWorkers:
    return make(root, database_url, KILN_DEMO_MODEL_LOAD_S=str(LOAD_S),
                KILN_MODEL_MEMORY_GB="2",  # one demo model (2 GiB) at a time
                KILN_AFFINITY_WAIT_S=str(wait_s))  # fmt: skip


def params(model: str, **extra: Any) -> dict[str, Any]:
    return {"prompt": f"a lighthouse {uuid.uuid4().hex[:8]}", "width": 64, "height": 64,
            "steps": 2, "simulate": {"step_ms": 10}, "model": model, **extra}  # fmt: skip


async def run_stream(workers: CliWorkers) -> int:
    """40 tasks of models a and b in a seeded random order, run by two workers that hold
    one model each at most; the model loads that cost."""
    async with workers.app() as app:
        rng = random.Random(7)
        ids = [(await app.submit("image.generate", params(rng.choice("ab")))).task.id
               for _ in range(40)]  # fmt: skip
        workers.start("--concurrency", "1", "--gpus", "1")
        workers.start("--concurrency", "1", "--gpus", "1")
        for task_id in ids:
            await wait_for_status(app.store, task_id, Status.SUCCESS, timeout_s=120)
        done = [await app.get(task_id) for task_id in ids]
    workers.stop()
    assert all(t.status is Status.SUCCESS and t.attempt == 1 for t in done)
    return sum(workers.count("model_loaded"))


async def test_routing_keeps_each_model_on_the_worker_that_holds_it(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: MakeWorkers
) -> None:
    # Given two workers that can each hold one model, and a mixed stream of two models
    # When the stream runs with warm-model routing, then again without (a fresh database)
    routed = await run_stream(model_workers(cli_workers, tmp_path / "r", new_database(), WAIT_S))
    plain = await run_stream(model_workers(cli_workers, tmp_path / "p", new_database(), 0.0))
    print(f"model loads, 40 tasks of 2 models on 2 workers: routed {routed}, plain {plain}")
    # Then routing loaded each model about once per worker; without it, many times more
    assert routed <= 6, routed
    assert plain >= routed + 6, (routed, plain)


async def test_a_task_of_another_model_is_not_starved_by_a_flood(
    tmp_path: Path, new_database: Callable[[], str], cli_workers: MakeWorkers
) -> None:
    workers = model_workers(cli_workers, tmp_path, new_database(), WAIT_S)
    async with workers.app() as app:
        # Given one worker holding model a
        workers.start("--concurrency", "1", "--gpus", "1")
        first = (await app.submit("image.generate", params("a"))).task.id
        await wait_for_status(app.store, first, Status.SUCCESS, timeout_s=60)
        # When a task of model b comes, followed by a steady flood of model a, faster
        # than the worker runs them
        lone = (await app.submit("image.generate", params("b"))).task
        flood: list[str] = []
        deadline = time.monotonic() + WAIT_S * 3
        while time.monotonic() < deadline:
            if (await app.get(lone.id)).status is Status.SUCCESS:
                break
            for _ in range(4):
                flood.append((await app.submit("image.generate", params("a"))).task.id)
            await asyncio.sleep(0.05)
        # Then the b task was claimed once it had waited the affinity wait, while the
        # flood went on
        done = await wait_for_status(app.store, lone.id, Status.SUCCESS, timeout_s=30)
        events = await app.store.events(task_id=lone.id)
        left = [t for t in flood if (await app.get(t)).status is Status.PENDING]
    claimed = next(e.at for e in events if e.event is Event.CLAIM)
    assert done.attempt == 1
    assert claimed - lone.created_at <= WAIT_S + 3.0, claimed - lone.created_at
    assert left, "the flood was over before the b task ran"
