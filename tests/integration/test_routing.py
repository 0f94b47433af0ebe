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
            await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=120)
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
        await wait_for_status(app.engine.store, first, Status.SUCCESS, timeout_s=60)
        # When a task of model b comes, followed by a steady flood of model a, faster
        # than the worker runs them, for longer than the affinity wait
        for _ in range(20):  # busy: a backlog of a tasks ahead of it
            await app.submit("image.generate", params("a"))
        lone = (await app.submit("image.generate", params("b"))).task
        flood: list[str] = []
        until = time.monotonic() + WAIT_S + 2.0
        while time.monotonic() < until:
            for _ in range(2):
                flood.append((await app.submit("image.generate", params("a"))).task.id)
            await asyncio.sleep(0.05)
        # Then the b task was passed only by a tasks that came within the affinity wait
        # after it: once those are done it runs, while the later flood still waits
        done = await wait_for_status(app.engine.store, lone.id, Status.SUCCESS, timeout_s=60)
        claimed_at = {}
        for task_id in [lone.id, *flood]:
            events = await app.engine.store.events(task_id=task_id)
            claims = [e.at for e in events if e.event is Event.CLAIM]
            if claims:
                claimed_at[task_id] = claims[0]
        created = {t: (await app.get(t)).created_at for t in flood}
    assert done.attempt == 1
    passed = [t for t in flood if claimed_at.get(t, float("inf")) < claimed_at[lone.id]]
    print(f"a tasks that came after the b task and went ahead of it: {len(passed)}")
    assert passed, "no a task went ahead: the worker did not prefer its warm model"
    assert all(created[t] < lone.created_at + WAIT_S + 0.05 for t in passed)
    later = [t for t in flood if created[t] >= lone.created_at + WAIT_S + 0.05]
    assert later, "the flood stopped within the affinity wait"
