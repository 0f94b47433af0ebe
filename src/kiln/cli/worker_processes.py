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
its attempts on); ``kiln serve`` stops them on its way out as it stops its own worker
(SIGTERM: they drain within ``KILN_SHUTDOWN_GRACE_S``), and a ``kiln serve`` that dies
without a word (SIGKILL) takes them with it: each drains once its stdin, a pipe from
``kiln serve``, reads end of file (:data:`WITH_PARENT`).
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


@contextlib.contextmanager
def started_beside(app: kiln.App) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start the worker processes, and stop them (SIGTERM, then SIGKILL after the grace
    period) when the block ends."""
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
    try:
        yield started
    finally:
        stop_all(started, settings.shutdown_grace_s + 5)


def stop_all(started: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
