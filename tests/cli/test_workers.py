"""The worker registry with real processes: `kiln worker` processes list themselves while
they beat, one SIGKILLed disappears once its lease lapsed, one stopped by SIGTERM at once."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

import kiln
from kiln.store import WorkerRecord

from .conftest import Processes, Server, wait_until

pytestmark = pytest.mark.slow


def listed(data_dir: Path) -> dict[int, WorkerRecord]:
    """The workers the store lists now, by pid (read beside the processes)."""

    async def read() -> list[WorkerRecord]:
        async with kiln.App(settings=kiln.Settings(data_dir=data_dir)) as app:
            return await app.engine.store.workers.live()

    return {w.pid: w for w in asyncio.run(read())}


def kiln_workers(server: Server, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kiln", "workers", "--server", server.url, *args],
        capture_output=True, text=True, timeout=30, env=server.env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def api_only(processes: Processes) -> Server:
    """API and supervisor only, with 1 s leases."""
    return processes.serve(processes.root / "data", "--no-workers", KILN_LEASE_TTL_S="1")


def test_workers_list_themselves_and_disappear_when_gone(
    api_only: Server, processes: Processes
) -> None:
    # Given two worker processes
    killed = processes.worker(api_only, "--concurrency", "2")
    stopped = processes.worker(api_only, "--concurrency", "3")
    both = {killed.pid, stopped.pid}
    found = wait_until(lambda: both <= set(listed(api_only.data_dir)) and listed(api_only.data_dir),
                       30, "both workers listed")  # fmt: skip
    # Then each is listed with its pid, slots, kinds and what its kinds take
    assert isinstance(found, dict)
    assert (found[killed.pid].slots, found[stopped.pid].slots) == (2, 3)
    for worker in (found[killed.pid], found[stopped.pid]):
        assert "image.generate" in worker.kinds and worker.running == 0
        assert worker.resources.get("image.generate") == {"gpu": 1}
        assert worker.seen_at >= worker.started_at and worker.expires_at > worker.seen_at
    # And `kiln workers` shows them, as a table and as the API's JSON
    shown = json.loads(kiln_workers(api_only, "--json"))["workers"]
    assert {w["pid"] for w in shown} >= both
    for worker in shown:  # times in RFC 3339 UTC, as everywhere in the API
        started, seen = (datetime.fromisoformat(worker[k]) for k in ("started_at", "last_seen_at"))
        assert worker["started_at"].endswith("Z") and seen >= started
    table = kiln_workers(api_only)
    assert "RUNNING" in table and f"{killed.pid}" in table and "0/3" in table
    assert re.search(r"\bUP\b", table) and re.search(r" \d+[smhd]\n", table), table
    # When one is SIGKILLed, it is listed until its lease lapses, then no more
    processes.kill(killed)
    wait_until(lambda: killed.pid not in listed(api_only.data_dir), 10, "the killed one gone")
    assert stopped.pid in listed(api_only.data_dir)
    # And one stopped by SIGTERM is gone as it exits
    assert processes.stop(stopped) == 0
    assert stopped.pid not in listed(api_only.data_dir)
