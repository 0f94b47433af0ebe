"""Circuit breaker policies against a failing upstream: `kiln worker` processes on one
database act together (pause), a fail_fast kind ends its tasks at once, and the storage
breaker trips on failing writes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from backend_support import TASK_TIMEOUT_S, kiln_settings
from prometheus_client import CollectorRegistry
from upstream_fakes import FakeOpenAI

import kiln
from kiln import backends, demo
from kiln.app import running
from kiln.errors import StorageError
from kiln.models import Task
from kiln.states import Status
from kiln.storage import StorageWrapper, open_storage
from kiln.store import BreakerRecord
from services.postgres import PostgresServer

PARAMS: dict[str, Any] = {"prompt": "a red fox in snow", "width": 1024, "height": 1024}
GENERATOR = "openai-images"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 60.0) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (found := await check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)
    return found


async def scrape(port: int) -> str:
    try:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0)).text
    except httpx.TransportError:
        return ""  # the process is still starting


async def final(app: kiln.App, ids: list[str]) -> list[Task]:
    async def all_final() -> list[Task] | None:
        tasks = [await app.get(task_id) for task_id in ids]
        return tasks if all(t.final for t in tasks) else None

    found: list[Task] = await until(all_final, f"{len(ids)} tasks to end")
    return found


async def submit(app: kiln.App, n: int, *, max_attempts: int, seed: int = 0) -> list[str]:
    ids = []
    for i in range(n):
        params = {**PARAMS, "seed": seed + i}
        ids.append((await app.submit("image.generate", params, max_attempts=max_attempts)).task.id)
    return ids


async def claimed_at(app: kiln.App, task_id: str) -> float:
    """When the task was first claimed (its first WAITING_FOR_RESOURCE event)."""
    events = await app.engine.store.events(task_id=task_id)
    return min(e.at for e in events if str(e.status) == "WAITING_FOR_RESOURCE")


# Processes sharing one database -----------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def database_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    if request.param == "sqlite":
        return {}  # the SQLite file under KILN_DATA_DIR
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return {"KILN_DATABASE_URL": server.new_database()}


@pytest.fixture
def breaker_env(
    openai_fake: FakeOpenAI, database_env: dict[str, str], tmp_path: Path
) -> dict[str, str]:
    return {
        "KILN_DATA_DIR": str(tmp_path / "kiln"),
        "KILN_BACKEND": GENERATOR,
        "KILN_OPENAI_BASE_URL": f"{openai_fake.base_url}/v1",
        "KILN_OPENAI_MODEL": "dall-e-3",
        "KILN_LEASE_TTL_S": "5",
        "KILN_RETRY_BASE_S": "0.01",
        "KILN_RETRY_MAX_S": "0.05",
        "KILN_BREAKER_MIN_CALLS": "2",
        "KILN_BREAKER_FAILURE_RATE": "0.5",
        "KILN_BREAKER_OPEN_S": "8",
        **database_env,
    }


@pytest.fixture
def worker_ports(breaker_env: dict[str, str], tmp_path: Path) -> Iterator[list[int]]:
    """Two `kiln worker` processes on the same database, each with its metrics port;
    stopped by their PIDs."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_")}, **breaker_env}
    started: list[subprocess.Popen[bytes]] = []
    ports = [free_port(), free_port()]
    try:
        for n, port in enumerate(ports):
            with (tmp_path / f"worker-{n}.log").open("wb") as out:
                started.append(subprocess.Popen(
                    [sys.executable, "-m", "kiln", "worker", "--concurrency", "1",
                     "--metrics-port", str(port)],
                    env=env, stdout=out, stderr=subprocess.STDOUT,
                ))  # fmt: skip
        yield ports
    finally:
        for process in started:
            process.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


def gauge(text: str, state: int) -> bool:
    return f'kiln_breaker_state{{breaker="{GENERATOR}"}} {state}.0' in text


@pytest.mark.slow
async def test_pause_holds_the_kind_on_every_worker_until_a_probe_closes_the_breaker(
    openai_fake: FakeOpenAI, breaker_env: dict[str, str], worker_ports: list[int], tmp_path: Path
) -> None:
    # Given two worker processes on one database, both up with the breaker closed, and an
    # upstream that fails its next four calls
    for port in worker_ports:
        await until(lambda port=port: _gauge_is(port, 0), f"worker on :{port} to start")  # type: ignore[misc]
    openai_fake.script = ["500"] * 4
    app = kiln.App(settings=kiln_settings(tmp_path, breaker_env))
    backends.register(app)  # this process only submits and watches
    async with app:
        # When four tasks fail on it
        tripping = await submit(app, 4, max_attempts=1)

        # Then the breaker opens in the store, and both workers hold it open
        async def stored_open() -> Any:
            rows = {r.name: r for r in await app.engine.store.limits.breakers()}
            row = rows.get(GENERATOR)
            return row if row is not None and row.state == "open" else None

        await until(stored_open, "the breaker to open in the store")
        for port in worker_ports:
            await until(lambda port=port: _gauge_is(port, 2), f"worker :{port} to pause")  # type: ignore[misc]

        async def trip_settled() -> bool:  # each ended, or never claimed
            tasks = [await app.get(t) for t in tripping]
            return all(t.final or t.status is Status.PENDING for t in tasks)

        await until(trip_settled, "the tripping tasks to end or wait")
        opened = await stored_open()
        assert opened is not None, "the breaker closed before its open period was over"
        openai_fake.script = []  # the upstream has recovered
        calls_when_open = openai_fake.calls
        assert 2 <= calls_when_open <= 4

        # When more tasks arrive while it is open
        waiting = await submit(app, 6, max_attempts=3, seed=100)
        assert {(await app.get(t)).status for t in waiting} == {Status.PENDING}

        # Then they wait, PENDING, until the open period is over; a probe goes out, closes
        # the breaker, and every task then succeeds on its first attempt
        done = await final(app, waiting)
        assert [(t.status, t.attempt) for t in done] == [(Status.SUCCESS, 1)] * 6
        for task_id in waiting:
            assert await claimed_at(app, task_id) >= opened.opened_until
        leftovers = [t for t in await final(app, tripping) if t.status is Status.SUCCESS]
        assert openai_fake.calls == calls_when_open + 6 + len(leftovers)
        counters = await app.engine.store.counters()
        assert counters[("breaker_transitions", f"{GENERATOR}>half_open")] == 1
        assert counters[("breaker_transitions", f"{GENERATOR}>closed")] == 1
        assert {r.name: r.state for r in await app.engine.store.limits.breakers()}[
            GENERATOR
        ] == "closed"
    for port in worker_ports:
        await until(lambda port=port: _gauge_is(port, 0), f"worker :{port} to close")  # type: ignore[misc]
    text = await scrape(worker_ports[0]) + await scrape(worker_ports[1])
    assert f'kiln_breaker_transitions_total{{breaker="{GENERATOR}",to="closed"}} 1.0' in text


async def _gauge_is(port: int, state: int) -> bool:
    return gauge(await scrape(port), state)


# fail_fast, in one process ---------------------------------------------------------------


@pytest.fixture
async def fail_fast_app(openai_fake: FakeOpenAI, tmp_path: Path) -> AsyncIterator[kiln.App]:
    env = {
        "KILN_BACKEND": GENERATOR,
        "KILN_OPENAI_BASE_URL": f"{openai_fake.base_url}/v1",
        "KILN_BREAKER_POLICY": "image.generate=fail_fast",
        "KILN_BREAKER_MIN_CALLS": "2",
        "KILN_BREAKER_OPEN_S": "600",
    }
    app = kiln.App(settings=kiln_settings(tmp_path, env))
    backends.register(app)
    async with app:
        yield app


async def test_fail_fast_ends_claimed_tasks_at_once_without_retries(
    openai_fake: FakeOpenAI, fail_fast_app: kiln.App
) -> None:
    app = fail_fast_app
    openai_fake.script = ["500", "500"]
    worker = app.worker(concurrency=1, resources={"gpu": 1})
    async with running(worker.run()), asyncio.timeout(TASK_TIMEOUT_S):
        # Given a breaker tripped by two failures of the upstream
        tripped = await final(app, await submit(app, 2, max_attempts=1))
        assert {t.error["code"] for t in tripped if t.error} == {"upstream_unavailable"}
        assert app.breakers.state(GENERATOR) == "open"
        # When tasks that could retry three times are claimed while it is open
        ended = await final(app, await submit(app, 5, max_attempts=3, seed=10))
    # Then each failed at once, for good, with upstream_unavailable, and none reached it
    for task in ended:
        assert (task.status, task.attempt, task.next_retry_at) == (Status.FAILED, 1, None)
        assert task.error is not None
        assert (task.error["code"], task.error["retryable"]) == ("upstream_unavailable", False)
        assert "circuit breaker 'openai-images' is open" in task.error["message"]
    assert openai_fake.calls == 2
    rows = {r.name: r.state for r in await app.engine.store.limits.breakers()}
    assert rows == {GENERATOR: "open"}


# the storage breaker ---------------------------------------------------------------------


class FailingPuts(StorageWrapper):
    """Storage whose writes fail while ``failing`` is set."""

    failing = True

    async def put(self, key: str, data: bytes) -> None:
        if self.failing:
            raise StorageError(f"simulated outage writing {key}")
        await self.inner.put(key, data)


async def test_the_storage_breaker_trips_on_failing_writes_and_pauses_claiming(
    tmp_path: Path,
) -> None:
    # Given the demo kind on a storage whose writes fail, a breaker that opens after two
    # failed writes for 3 s, and a worker
    settings = kiln_settings(tmp_path, {"KILN_BREAKER_MIN_CALLS": "2",
                                        "KILN_BREAKER_OPEN_S": "3"})  # fmt: skip
    storage = FailingPuts(open_storage(settings.resolved_storage_url))
    app = kiln.App(settings=settings, storage_backend=storage)
    demo.register(app)
    small = {"prompt": "a lantern", "width": 64, "height": 64, "steps": 2}
    async with app:
        worker = app.worker(concurrency=1, resources={"gpu": 1})
        async with running(worker.run()), asyncio.timeout(TASK_TIMEOUT_S):
            # When two tasks fail to upload
            ids = [(await app.submit(demo.KIND, {**small, "seed": n}, max_attempts=1)).task.id
                   for n in range(2)]  # fmt: skip
            failed = await final(app, ids)
            assert {t.error["code"] for t in failed if t.error} == {"storage_error"}

            # Then the storage breaker is open, shared, and on the worker's metrics
            assert app.breakers.state("storage") == "open"
            registry = CollectorRegistry()
            registry.register(app.breakers)
            assert registry.get_sample_value("kiln_breaker_state", {"breaker": "storage"}) == 2
            assert (
                registry.get_sample_value(
                    "kiln_breaker_transitions_total", {"breaker": "storage", "to": "open"}
                )
                == 1
            )
            opened = await until(lambda: _row(app, "storage", "open"), "the row to open")
            # And a new task is not claimed while it is open
            waiting = (await app.submit(demo.KIND, {**small, "seed": 9})).task.id
            assert (await app.get(waiting)).status is Status.PENDING
            storage.failing = False

            # When the open period is over, the probe succeeds and the breaker closes
            [done] = await final(app, [waiting])
            assert (done.status, done.attempt) == (Status.SUCCESS, 1)
            assert await claimed_at(app, waiting) >= opened.opened_until
            await until(lambda: _row(app, "storage", "closed"), "the row to close")
        assert app.breakers.state("storage") == "closed"


async def _row(app: kiln.App, name: str, state: str) -> BreakerRecord | None:
    found = {r.name: r for r in await app.engine.store.limits.breakers()}.get(name)
    return found if found is not None and found.state == state else None
