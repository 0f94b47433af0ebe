"""What every peer's script shares (it runs in the peers' own venv, stdlib only here).

The peer's own worker CLI runs as a separate process group at its defaults; its no-op
handler appends one line ``"<n> <time.time() at start>"`` to a shared file (``O_APPEND``,
one ``write`` per job, whole lines). The script reads that file: the drain starts at the
first handler start, the pickup latency of job n is its start less the moment the
generator was scheduled to submit it.

Three figures per call, the last line one JSON object:

- ``drain_per_s``: N jobs queued, then the worker CLI starts; N over the time from the
  first handler start to the moment the peer shows all N done (``done_at``);
- ``enqueue_drain_per_s``: the worker CLI runs (warmed up), N jobs are enqueued in the
  peer's batches; N over the time from the first enqueue to all done; with
  ``enqueue_drain_cpu_us``, the CPU per job of the script (its enqueues) and the worker
  CLI's processes over that time, and ``enqueue_drain_server_cpu_us``, the server's
  (PostgreSQL's processes, or Redis: ``BENCH_SERVER_PID``), as kiln's lifecycle counts its
  own processes and its server's;
- ``pickup_p50_ms`` / ``pickup_p99_ms``: an open-loop generator submits one job every
  1/rate s for ``--seconds`` (each submit fired on its own, never waiting for the one
  before), handler start less the scheduled submit time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
POLL_S = 0.005
#: Job numbers of the pickup figure start here (the enqueue + drain jobs are 0..N-1).
PICKUP = 10_000_000


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=500.0, help="pickup: jobs per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="pickup: how long")
    parser.add_argument("--scratch", required=True, help="a folder for the done files")
    parser.add_argument(
        "--enqueue-batch", type=int, default=500, help="jobs per enqueue call, where batched"
    )
    return parser.parse_args()


def record(path: str) -> Callable[[int], None]:
    """The handler's side: one whole line per job on an O_APPEND descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(n: int) -> None:
        os.write(fd, f"{n} {time.time():.6f}\n".encode())

    return write


def starts(path: Path) -> dict[int, float]:
    """Job number -> handler start, from the done file (warm-up jobs, n < 0, left out)."""
    found: dict[int, float] = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        n, at = line.split()
        if int(n) >= 0:
            found.setdefault(int(n), float(at))
    return found


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as handle:
        return sum(1 for line in handle if not line.startswith(b"-"))


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``check`` every 5 ms; the wall-clock time it first held."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(POLL_S)
    return time.time()


def _cpu_ticks(stat: str) -> tuple[int, int, int]:
    """(pid's process group, parent, user + system ticks with reaped children's) of a
    ``/proc/<pid>/stat`` text."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[2]), int(fields[1]), sum(int(f) for f in fields[11:15])


def cpu_s(group: int | None = None, parent: int | None = None) -> float:
    """CPU seconds of the live processes of a process ``group``, or of ``parent`` and its
    children (a server: the postmaster and its backends)."""
    ticks = 0
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgid, ppid, used = _cpu_ticks(path.read_text())
        except (OSError, ValueError, IndexError):
            continue
        pid = int(path.parent.name)
        if (group is not None and pgid == group) or (parent is not None and parent in (pid, ppid)):
            ticks += used
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """The CPU of one figure: this script, the worker CLI's processes, and the server."""

    def __init__(self, cli: Cli) -> None:
        self.cli = cli
        server = os.environ.get("BENCH_SERVER_PID")
        self.server = int(server) if server else None
        self.start = self._read()

    def _read(self) -> tuple[float, float]:
        own = os.times()
        here = own.user + own.system + cpu_s(group=self.cli.process.pid)
        return here, cpu_s(parent=self.server) if self.server else 0.0

    def per_job_us(self, jobs: int) -> dict[str, float]:
        """``enqueue_drain_cpu_us`` and ``enqueue_drain_server_cpu_us`` since the start."""
        here, server = self._read()
        return {
            "enqueue_drain_cpu_us": round(1e6 * (here - self.start[0]) / jobs, 1),
            "enqueue_drain_server_cpu_us": round(1e6 * (server - self.start[1]) / jobs, 1),
        }


def warmed(path: Path) -> bool:
    """The warm-up job (a negative number) has run."""
    return path.exists() and any(line.startswith("-") for line in path.read_text().splitlines())


class Cli:
    """The peer's worker CLI in its own process group, its log in a file."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.handle = log.open("wb")
        self.process = subprocess.Popen(
            command,
            env={**os.environ, **env},
            cwd=HERE,
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive(self) -> bool:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the worker CLI exited ({self.process.returncode}):\n{tail}")
        return True

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.handle.close()


async def open_loop(
    rate: float, seconds: float, submit: Callable[[int], Awaitable[Any]]
) -> list[float]:
    """Fire submit(i) at t0 + i/rate, each as its own task; the scheduled times."""
    total = round(rate * seconds)
    loop = asyncio.get_running_loop()
    t0_loop, t0_wall = loop.time() + 0.05, time.time() + 0.05
    scheduled, pending = [], set()
    for i in range(total):
        delay = t0_loop + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        scheduled.append(t0_wall + i / rate)
        task = asyncio.ensure_future(submit(i))
        pending.add(task)
        task.add_done_callback(pending.discard)
    while pending:
        await asyncio.gather(*pending)
    return scheduled


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def pickup_figures(scheduled: list[float], path: Path, started: float) -> dict[str, Any]:
    """Pickup job i is job number PICKUP + i in the done file."""
    seen = starts(path)
    missing = [i for i in range(len(scheduled)) if PICKUP + i not in seen]
    if missing:
        raise RuntimeError(f"{len(missing)} pickup jobs never started")
    waits = [(seen[PICKUP + i] - at) * 1000 for i, at in enumerate(scheduled)]
    last = max(seen[PICKUP + i] for i in range(len(scheduled)))
    return {
        "pickup_p50_ms": round(percentile(waits, 0.50), 2),
        "pickup_p99_ms": round(percentile(waits, 0.99), 2),
        "pickup_max_ms": round(max(waits), 2),
        "pickup_jobs": len(scheduled),
        "pickup_offered_per_s": round(len(scheduled) / (scheduled[-1] - scheduled[0]), 1),
        # below the offered rate: the system did not keep up, its queue grew all along
        "pickup_started_per_s": round(len(scheduled) / (last - scheduled[0]), 1),
        "pickup_enqueue_s": round(time.time() - started, 2),
    }


def emit(body: dict[str, Any]) -> None:
    print(json.dumps(body), flush=True)
    sys.stdout.flush()
