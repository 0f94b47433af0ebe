"""Warm-model routing with real `kiln worker` processes on SQLite and PostgreSQL: two
workers that can each hold one model, a stream of tasks for two models, and the loads it
costs with routing and without; and a task of another model is not starved by a flood of
the model a worker holds (docs/scheduling.md)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kiln
from kiln import backends
from kiln.config import Settings
from kiln.states import Status

from .conftest import wait_for_status, wait_until

pytestmark = pytest.mark.slow

#: A demo model "loads" this long; a worker holds one (KILN_MODEL_MEMORY_GB = one model).
LOAD_S = 0.3
WAIT_S = 5.0


@pytest.fixture(params=["sqlite", "postgres"])
def new_database(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """Makes a fresh database on the backend under test, each call."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return lambda: str(server.new_database())
    return lambda: f"sqlite:///{tmp_path / uuid.uuid4().hex[:8]}.db"


class Workers:
    """`kiln worker` processes on one database; their logs say what they loaded."""

    def __init__(self, root: Path, database_url: str, affinity_wait_s: float) -> None:
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        self.env.update(
            KILN_DATABASE_URL=database_url,
            KILN_STORAGE_URL=(root / "results").as_uri(),
            KILN_DEMO_MODEL_LOAD_S=str(LOAD_S),
            KILN_MODEL_MEMORY_GB="2",  # one demo model (2 GiB) at a time
            KILN_AFFINITY_WAIT_S=str(affinity_wait_s),
            KILN_LEASE_TTL_S="3",
            KILN_LOG_FORMAT="json",
        )
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self) -> None:
        log = self.root / f"worker-{len(self.procs)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", "worker", "--concurrency", "1", "--gpus", "1"],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
            )  # fmt: skip
        self.procs.append((proc, log))

    def loads(self) -> list[int]:
        """Model loads per worker, from their `model_loaded` log lines."""
        return [log.read_text(errors="replace").count('"model_loaded"') for _, log in self.procs]

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def workers_factory(tmp_path: Path) -> Iterator[list[Workers]]:
    made: list[Workers] = []
    yield made
    for workers in made:
        workers.stop()
        for _, log in workers.procs:
            sys.stderr.write(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}\n")


async def submitter(root: Path, database_url: str) -> kiln.App:
    settings = Settings(data_dir=root, database_url=database_url,
                        storage_url=(root / "results").as_uri())  # fmt: skip
    app = kiln.App(settings=settings)
    backends.register(app)  # image.generate on the demo backend: tasks name their model
    return app


def params(model: str, **extra: Any) -> dict[str, Any]:
    return {"prompt": f"a lighthouse {uuid.uuid4().hex[:8]}", "width": 64, "height": 64,
            "steps": 2, "simulate": {"step_ms": 10}, "model": model, **extra}  # fmt: skip


async def run_stream(root: Path, database_url: str, wait_s: float, made: list[Workers]) -> int:
    """40 tasks of models a and b in a seeded random order, run by two workers that hold
    one model each at most; the model loads that cost."""
    root.mkdir()
    workers = Workers(root, database_url, wait_s)
    made.append(workers)
    async with await submitter(root, database_url) as app:
        rng = random.Random(7)
        ids = [(await app.submit("image.generate", params(rng.choice("ab")))).task.id
               for _ in range(40)]  # fmt: skip
        workers.start()
        workers.start()
        for task_id in ids:
            await wait_for_status(app.store, task_id, Status.SUCCESS, timeout_s=120)
        done = [await app.get(task_id) for task_id in ids]
    workers.stop()
    assert all(t.status is Status.SUCCESS and t.attempt == 1 for t in done)
    return sum(workers.loads())


async def test_routing_keeps_each_model_on_the_worker_that_holds_it(
    tmp_path: Path, new_database: Callable[[], str], workers_factory: list[Workers]
) -> None:
    # Given two workers that can each hold one model, and a mixed stream of two models
    # When the stream runs with warm-model routing, then again without (a fresh database)
    routed = await run_stream(tmp_path / "routed", new_database(), WAIT_S, workers_factory)
    plain = await run_stream(tmp_path / "plain", new_database(), 0.0, workers_factory)
    print(f"model loads, 40 tasks of 2 models on 2 workers: routed {routed}, plain {plain}")
    # Then routing loaded each model about once per worker; without it, many times more
    assert routed <= 6, routed
    assert plain >= routed + 6, (routed, plain)


async def test_a_task_of_another_model_is_not_starved_by_a_flood(
    tmp_path: Path, new_database: Callable[[], str], workers_factory: list[Workers]
) -> None:
    database_url = new_database()
    workers = Workers(tmp_path, database_url, WAIT_S)
    workers_factory.append(workers)
    async with await submitter(tmp_path, database_url) as app:
        # Given one worker holding model a
        workers.start()
        first = (await app.submit("image.generate", params("a"))).task.id
        await wait_for_status(app.store, first, Status.SUCCESS, timeout_s=60)
        # When a task of model b comes, followed by a steady flood of model a
        lone = (await app.submit("image.generate", params("b"))).task
        flood: list[str] = []
        deadline = time.monotonic() + WAIT_S * 3
        while time.monotonic() < deadline and (await app.get(lone.id)).status is not Status.SUCCESS:
            for _ in range(4):
                flood.append((await app.submit("image.generate", params("a"))).task.id)
            await asyncio.sleep(0.05)
        # Then the b task ran once it had waited the affinity wait, while the flood went on
        await wait_until(lambda: _done(app, lone.id), timeout_s=30, what="the b task done")
        events = await app.store.events(task_id=lone.id)
    claimed = next(e.at for e in events if str(e.event) == "claim")
    assert claimed - lone.created_at <= WAIT_S + 3.0, claimed - lone.created_at
    assert len(flood) > 20


async def _done(app: kiln.App, task_id: str) -> bool:
    return (await app.get(task_id)).status is Status.SUCCESS
