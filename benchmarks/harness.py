"""What every lifecycle figure shares: the app with its no-op kind, submitting, waiting
for SUCCESS, the ``Figure`` record, and the machine it ran on."""

from __future__ import annotations

import asyncio
import datetime as dt
import multiprocessing
import multiprocessing.process
import os
import platform
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kiln
from kiln.cli.heap import settle_heap
from kiln.config import Settings
from kiln.store import Store

if TYPE_CHECKING:
    from pg_lifecycle import ServerUse

KIND = "bench.noop"
SUBMIT_CHUNK = 500
POLL_S = 0.01


@dataclass
class Figure:
    """One lifecycle run: N tasks of one output size, first submit to last SUCCESS."""

    tasks: int
    output_bytes: int
    concurrency: int
    wall_s: float
    submit_s: float
    transitions: int
    succeeded: int
    cpu_s: float = 0.0
    thread_cpu_s: dict[str, float] = field(default_factory=dict)
    write_batches: tuple[int, int] | None = None
    by_transition: dict[str, int] = field(default_factory=dict)
    server: ServerUse | None = None

    @property
    def lifecycles_per_s(self) -> float:
        return self.succeeded / self.wall_s

    @property
    def transitions_per_s(self) -> float:
        return self.transitions / self.wall_s

    @property
    def cpu_us_per_lifecycle(self) -> float:
        return self.cpu_s / max(self.succeeded, 1) * 1e6

    @property
    def mean_batch(self) -> float | None:
        if not self.write_batches or not self.write_batches[0]:
            return None
        return self.write_batches[1] / self.write_batches[0]


def build_app(
    url: str,
    results: Path,
    synchronous: str,
    output_bytes: int,
    store: Store | None = None,
    submit_process: bool = False,
) -> kiln.App:
    """``submit_process``: plain submissions written by a submit process, as ``kiln serve``
    does on SQLite with two cores or more (KILN_SQLITE_SUBMIT_PROCESS=auto)."""
    settings = Settings(
        data_dir=results.parent,
        database_url=url,
        storage_url=results.as_uri(),
        sqlite_synchronous=synchronous,
        sqlite_submit_process="on" if submit_process else "off",
    )
    settle_heap(settings.gc_threshold)  # as kiln serve and kiln worker do at startup
    app = kiln.App(settings=settings, store=store)
    payload = os.urandom(output_bytes) if output_bytes else b""

    @app.task(KIND)
    async def noop(ctx: Any, params: Any) -> kiln.Output | None:
        if payload:
            return kiln.Output("out.bin", payload)
        return None

    return app


async def submit_all(app: kiln.App, tasks: int, chunk: int = SUBMIT_CHUNK) -> int:
    """Submit ``tasks`` new tasks, ``chunk`` of them in flight at a time."""
    created = 0
    for start in range(0, tasks, chunk):
        results = await asyncio.gather(
            *(app.submit(KIND, {"n": i}, dedup=False)
              for i in range(start, min(start + chunk, tasks)))
        )  # fmt: skip
        created += sum(1 for r in results if r.created)
    return created


def transitions_of(counters: dict[tuple[str, str], int]) -> dict[str, int]:
    return {labels: n for (name, labels), n in counters.items() if name == "transitions"}


async def wait_for_success(
    app: kiln.App, tasks: int, timeout_s: float, poll_s: float = POLL_S
) -> tuple[float, int]:
    """Poll the store's counter table until ``tasks`` tasks reached SUCCESS; return when,
    and how many reads that took."""
    deadline = time.perf_counter() + timeout_s
    polls = 0
    while True:
        moved = transitions_of(await app.engine.store.counters())
        polls += 1
        if sum(n for label, n in moved.items() if label.endswith(">SUCCESS")) >= tasks:
            return time.perf_counter(), polls
        if time.perf_counter() > deadline:
            raise TimeoutError(f"not all {tasks} tasks reached SUCCESS in {timeout_s} s: {moved}")
        await asyncio.sleep(poll_s)


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg": load(),
    }


def load() -> str:
    """The 1-minute load average: other processes on the machine skew every figure."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def head_lines(figure: Figure) -> list[str]:
    label = "no-op, no outputs" if figure.output_bytes == 0 else f"{figure.output_bytes} B output"
    return [
        f"lifecycle ({label}): {figure.tasks} tasks, concurrency {figure.concurrency}",
        f"  wall (first submit to last SUCCESS) {figure.wall_s:.3f} s,"
        f" of which submitting {figure.submit_s:.3f} s",
        f"  lifecycles/s   {figure.lifecycles_per_s:10.1f}",
        f"  transitions/s  {figure.transitions_per_s:10.1f}"
        f"  ({figure.transitions} transitions,"
        f" {figure.transitions / max(figure.tasks, 1):.2f} per task)",
    ]


def cpu_line(figure: Figure) -> str:
    split = ", ".join(f"{role} {s:.2f} s" for role, s in sorted(figure.thread_cpu_s.items()))
    return (
        f"  CPU {figure.cpu_s:.2f} s = {figure.cpu_us_per_lifecycle:.0f} us per lifecycle ({split})"
    )


@contextmanager
def scratch_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Workers:
    """The worker processes of one figure, started with ``spawn`` (no inherited loop):
    each runs ``target(*args, pipe)``, says "ready" (or waits for "go" when held), and
    sends its report when told "stop"."""

    target: Callable[..., None]
    pipes: list[Connection] = field(default_factory=list)
    processes: list[multiprocessing.process.BaseProcess] = field(default_factory=list)

    def start(self, count: int, *args: Any) -> None:
        spawn = multiprocessing.get_context("spawn")
        for i in range(count):
            mine, theirs = spawn.Pipe()
            process = spawn.Process(
                target=self.target, args=(*args, theirs), name=f"kiln-bench-worker-{i}", daemon=True
            )
            process.start()
            theirs.close()
            self.pipes.append(mine)
            self.processes.append(process)
        for pipe in self.pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise RuntimeError("a worker process did not start")

    def go(self) -> None:
        """Start the held workers (a drain)."""
        for pipe in self.pipes:
            pipe.send("go")

    def stop(self) -> list[dict[str, Any]]:
        for pipe in self.pipes:
            pipe.send("stop")
        reports = []
        for pipe in self.pipes:
            if not pipe.poll(60):
                raise RuntimeError("a worker process did not report")
            reports.append(pipe.recv())
        for process in self.processes:
            process.join(30)
        return reports

    def kill_leftovers(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(10)
