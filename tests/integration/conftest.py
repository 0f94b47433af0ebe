"""Integration fixtures: worker processes, fake-clock apps, and polling with a deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

import kiln
from kiln import demo
from kiln.config import Settings
from kiln.models import Task, TaskEvent
from kiln.states import Event, Status, replay
from kiln.storage import Storage
from kiln.store import Store

from .cli_workers import CliWorkers

WORKER_SCRIPT = Path(__file__).with_name("worker_process.py")


class AdvancingClock(Protocol):
    """The shape of the ``clock`` fixture (tests/conftest.py FakeClock)."""

    now: float

    def __call__(self) -> float: ...

    def advance(self, seconds: float) -> None: ...


async def wait_until(
    predicate: Callable[[], Awaitable[bool]],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` until it holds; fail the test when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


async def wait_for_task(
    store: Store,
    task_id: str,
    check: Callable[[Task], bool],
    *,
    timeout_s: float = 10.0,
    what: str = "task condition",
) -> Task:
    """Poll the store until ``check(task)`` holds; return the task that satisfied it."""
    seen: list[Task] = []

    async def holds() -> bool:
        task = await store.get(task_id)
        assert task is not None, f"task {task_id} disappeared"
        seen[:] = [task]
        return check(task)

    try:
        await wait_until(holds, timeout_s=timeout_s, what=what)
    except pytest.fail.Exception:
        last = seen[0] if seen else None
        state = f"{last.status} attempt={last.attempt} error={last.error}" if last else "none"
        pytest.fail(f"timed out waiting for {what} on task {task_id} (last: {state})")
    return seen[0]


async def wait_for_status(
    store: Store, task_id: str, *statuses: Status, timeout_s: float = 10.0
) -> Task:
    return await wait_for_task(
        store,
        task_id,
        lambda task: task.status in statuses,
        timeout_s=timeout_s,
        what=f"status in {[str(s) for s in statuses]}",
    )


async def task_events(store: Store, task_id: str) -> list[TaskEvent]:
    return await store.events(task_id=task_id, limit=10_000)


async def assert_one_final_state(store: Store, task_id: str) -> list[TaskEvent]:
    """I1/I6: the log replays to the task's status and ends in exactly one final event."""
    task = await store.get(task_id)
    assert task is not None
    events = await task_events(store, task_id)
    assert replay((e.event, e.from_status, e.status) for e in events) == task.status
    finals = [e for e in events if e.final]
    assert len(finals) == 1, [f"{e.event}:{e.status}" for e in events]
    assert finals[0] is events[-1]
    assert finals[0].status == task.status
    return events


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most (start, end) spans open at one moment (an end before a start that ties)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def successes(events: list[TaskEvent]) -> list[TaskEvent]:
    return [e for e in events if e.status == Status.SUCCESS]


def demo_params(
    prompt: str, *, steps: int = 6, step_ms: int = 1, **simulate: object
) -> dict[str, object]:
    """Small, fast `image.generate` params."""
    return {
        "prompt": prompt,
        "width": 64,
        "height": 64,
        "steps": steps,
        "simulate": {"step_ms": step_ms, **simulate},
    }


async def object_keys(storage: Storage, prefix: str) -> list[str]:
    return [info.key async for info in storage.list(prefix)]


# Worker processes -------------------------------------------------------------------------


@dataclass
class WorkerProcesses:
    """Starts ``worker_process.py`` children; whatever is still alive at teardown is killed."""

    settings: Settings
    log_dir: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *extra: str, lease_ttl_s: float = 1.0) -> subprocess.Popen[bytes]:
        log_path = self.log_dir / f"worker-{len(self.started)}.log"
        args = [
            sys.executable,
            str(WORKER_SCRIPT),
            "--database", self.settings.resolved_database_url,
            "--storage", self.settings.resolved_storage_url,
            "--lease-ttl", str(lease_ttl_s),
            *extra,
        ]  # fmt: skip
        with log_path.open("wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc

    def sigkill(self, proc: subprocess.Popen[bytes]) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL

    def logs(self) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("worker-*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def crash_settings(settings: Settings) -> Settings:
    """Short leases and backoff, so a killed worker's task is swept within about a second."""
    return settings.with_(lease_ttl_s=1.0, supervisor_interval_s=0.05,
                          retry_base_s=0.01, retry_max_s=0.05)  # fmt: skip


@pytest.fixture
def worker_processes(crash_settings: Settings, tmp_path: Path) -> Iterator[WorkerProcesses]:
    procs = WorkerProcesses(crash_settings, tmp_path)
    try:
        yield procs
    finally:
        procs.close()
        sys.stderr.write(procs.logs())


@pytest.fixture
async def crash_app(crash_settings: Settings) -> AsyncIterator[kiln.App]:
    """The test process's App (real clock) on the same database and storage as the children."""
    instance = kiln.App(settings=crash_settings)
    demo.register(instance)
    async with instance:
        yield instance


@pytest.fixture(params=["sqlite", "postgres"])
def each_store(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    """The test's settings on each store backend (real clock)."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return settings.with_(database_url=server.new_database())
    return settings


@pytest.fixture(params=["sqlite", "postgres"])
async def fake_app(
    request: pytest.FixtureRequest, settings: Settings, clock: AdvancingClock
) -> AsyncIterator[kiln.App]:
    """An App on the fake clock, on each store backend: supervisor tests move time instead
    of sleeping."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        settings = settings.with_(database_url=server.new_database())
    instance = kiln.App(settings=settings, clock=clock)
    demo.register(instance)
    async with instance:
        yield instance


async def claim_one(app: kiln.App, *, lease_ttl_s: float = 60.0, worker_id: str = "w1") -> Task:
    """Claim the next task straight from the store: a worker that never heartbeats."""
    claimed = await app.engine.store.claim(
        worker_id=worker_id, kinds=list(app.kinds), limit=1, lease_ttl_s=lease_ttl_s
    )
    assert len(claimed) == 1
    return claimed[0]


async def claim_generating(app: kiln.App, *, lease_ttl_s: float = 60.0) -> Task:
    task = await claim_one(app, lease_ttl_s=lease_ttl_s)
    return await app.apply(task, Event.ACQUIRE, fenced=True)


# `kiln worker` processes on either store --------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def new_database(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """Makes a fresh database on the backend under test, each call."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return lambda: str(server.new_database())
    return lambda: f"sqlite:///{tmp_path / uuid.uuid4().hex[:8]}.db"


@pytest.fixture
def cli_workers(tmp_path: Path) -> Iterator[Callable[..., CliWorkers]]:
    """Makes :class:`CliWorkers` groups (``make(root, database_url, **env)``); every one is
    stopped at teardown and its logs' tails shown."""
    made: list[CliWorkers] = []

    def make(root: Path, database_url: str, **env: str) -> CliWorkers:
        made.append(CliWorkers(root, database_url, **env))
        return made[-1]

    yield make
    for group in made:
        group.stop()
        sys.stderr.write(group.tail())
