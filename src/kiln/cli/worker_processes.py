"""The ``kiln worker`` processes ``kiln serve`` starts beside itself (KILN_WORKER_PROCESSES).

One Python process runs on one core at a time: its event loop and its store's writer
thread share one interpreter lock. On SQLite, ``kiln serve`` therefore starts one
``kiln worker`` per core beyond its own (``auto``), on the same database and storage:
each claims and runs tasks with its own event loop and writer, and the processes' writes
meet at the database file's lock (:mod:`kiln.store.sqlite_share`: a kernel lock, and a
wake-up when a submission makes work claimable, so a worker of another process starts it
at once). On PostgreSQL the same: each worker process has its own pool of
connections and is woken by ``LISTEN``; workers on other machines are ``kiln worker``
processes of their own.

A worker process serves the kinds that need no GPU slot: the GPU slots (``KILN_GPUS``)
belong to the machine, and stay with ``kiln serve``'s own worker. Each one is an ordinary
``kiln worker``: a SIGKILLed one loses nothing (its leases expire, the supervisor moves
its attempts on); ``kiln serve`` passes each stopping signal it gets on to them at once,
as a byte on their stdin, a pipe from it (:class:`Beside`): they drain beside its own
worker, within the same ``KILN_SHUTDOWN_GRACE_S``, and a second signal gives every
attempt back at once; a ``kiln serve`` that dies without a word (SIGKILL) takes them with
it: each drains once its stdin reads end of file (:data:`WITH_PARENT`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kiln
from kiln.config import Settings

log = logging.getLogger("kiln.cli")
#: The flag that makes a ``kiln worker`` drain when the process that started it is gone:
#: its stdin is a pipe from ``kiln serve``, which reads end of file once ``kiln serve``
#: exits in any way, SIGKILL included (the kernel closes the pipe's other end).
WITH_PARENT = "--exit-with-parent"
WORKER = (sys.executable, "-m", "kiln", "worker", WITH_PARENT)

#: What a ``kiln worker`` started by ``kiln serve`` may not inherit: its own port, and the
#: options ``kiln serve`` sets for it.
NOT_INHERITED = ("KILN_METRICS_PORT", "KILN_KINDS", "KILN_GPUS", "KILN_CONCURRENCY")


def process_count(settings: Settings, cores: int | None = None) -> int:
    """How many worker processes ``kiln serve`` starts: the setting, or for ``auto`` one
    per core beyond the first; none without workers."""
    if settings.no_workers or settings.workers == 0:
        return 0
    if settings.worker_processes is not None:
        return settings.worker_processes
    return max((cores if cores is not None else usable_cores()) - 1, 0)


def usable_cores() -> int:
    """The CPUs this process may run on, capped by a cgroup v2 CPU quota (a container's
    ``--cpus``): ``os.cpu_count()`` counts the host's."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(min(cores, math.ceil(int(quota) / int(period))), 1)


def kinds_without_gpu(app: kiln.App) -> list[str]:
    """The registered kinds that take no GPU slot (with KILN_KIND_RESOURCES on top)."""
    settings = app.settings
    return sorted(
        name
        for name, kind in app.kinds.items()
        if not settings.kind_needs(name, kind.resources).get("gpu")
    )


def worker_environment(settings: Settings, kinds: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env.update(
        KILN_DATABASE_URL=settings.resolved_database_url,
        KILN_STORAGE_URL=settings.resolved_storage_url,
        KILN_DATA_DIR=str(settings.data_dir),
        KILN_CONCURRENCY=str(settings.workers),
        KILN_KINDS=",".join(kinds),
        KILN_GPUS="0",
    )
    return env


@dataclass
class Beside:
    """The worker processes ``kiln serve`` started, and the stopping signals it passed on
    to them."""

    procs: list[subprocess.Popen[bytes]]
    forwarded: int = 0

    def forward(self, sig: int) -> None:
        """Pass a stopping signal of ``kiln serve`` on at once, one byte on each worker
        process's stdin: with the first they drain while ``kiln serve`` drains its own
        worker (not after it: the stop takes one grace period, not two); with a second
        they give their attempts back at once, as ``kiln serve`` does. A byte, not the
        signal: a process that got the signal itself (a terminal's Ctrl-C) counts the two
        as one."""
        self.forwarded += 1
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.write(b".")
                    proc.stdin.flush()


@contextlib.contextmanager
def started_beside(app: kiln.App) -> Iterator[Beside]:
    """Start the worker processes, and stop them (SIGTERM unless a signal was passed on
    already, then SIGKILL after the grace period) when the block ends."""
    settings = app.settings
    count = process_count(settings)
    kinds = kinds_without_gpu(app) if count else []
    if count and not kinds:
        log.info("worker_processes_skipped", extra={"reason": "every kind takes a GPU slot"})
        count = 0
    env = worker_environment(settings, kinds)
    started = [subprocess.Popen(WORKER, env=env, stdin=subprocess.PIPE) for _ in range(count)]
    if started:
        log.info(
            "worker_processes_started",
            extra={"pids": [p.pid for p in started], "kinds": kinds},
        )
    beside = Beside(started)
    try:
        yield beside
    finally:
        stop_all(started, settings.shutdown_grace_s + 5, signalled=beside.forwarded > 0)


def stop_all(
    started: list[subprocess.Popen[bytes]], grace_s: float, *, signalled: bool = False
) -> None:
    """Stop the worker processes: SIGTERM (unless they were signalled already), then
    SIGKILL to one still running after ``grace_s``."""
    for proc in started:
        if proc.poll() is None and not signalled:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
