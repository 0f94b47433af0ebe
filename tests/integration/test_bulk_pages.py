"""A bulk cancel of 40 pipelines of 200 steps each, through a real `kiln serve` on SQLite,
while a real `kiln worker` process holds leases on the same file: the pages are cut by
the rows they change, the worker's running attempts keep their leases all along (no
`expire`, no second claim, no retry; at the end they stop for their own cancel, a write
fenced by the epoch they were claimed at), and another tenant's submissions are answered
and committed between the pages. Outcomes and events only, never timings."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import kiln

from .cli_workers import CliWorkers
from .conftest import demo_params, wait_until

PIPELINES = 40
RUNNING = 4  # the other tenant's long attempts, on the worker's four slots
ACME, GLOBEX = "acme-key", "globex-key"


def wide(n: int) -> dict[str, Any]:
    """200 steps made at once: two steps of 100 copies, neither reading the other."""
    return {
        "steps": [
            {
                "name": side,
                "kind": "image.generate",
                "repeat": 100,
                "params": {"prompt": f"{side} {n}", "width": 64, "height": 64, "steps": 2},
            }
            for side in ("left", "right")
        ]
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Serve:
    """`kiln serve --no-workers` (the API and the supervisor) on the cluster's file."""

    def __init__(self, cluster: CliWorkers) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = cluster.root / "serve.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", "serve", "--no-workers", "--port", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=cluster.env,
                cwd=cluster.root,
            )

    async def healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        try:
            async with httpx.AsyncClient(timeout=0.5) as http:
                return (await http.get(f"{self.url}/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[CliWorkers]:
    started = CliWorkers(
        tmp_path / "cluster",
        f"sqlite:///{tmp_path / 'kiln.db'}",
        KILN_API_KEYS=f"acme:{ACME},globex:{GLOBEX}",
        KILN_SUPERVISOR_INTERVAL_S="0.2",
        # A shared pool: its holder checks its lease before each renewal, so an attempt
        # whose renewal waited past the lease stops at once (lease_lost) instead of racing
        # the supervisor's expire
        KILN_POOLS=f"gpu-a100:{RUNNING}",
        KILN_KIND_RESOURCES="image.generate=gpu-a100:1",
    )
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
async def serve(cluster: CliWorkers) -> Any:
    server = Serve(cluster)
    try:
        await wait_until(server.healthy, timeout_s=30, what="kiln serve to answer")
        yield server
    finally:
        server.stop()


def rows(db: Path, sql: str, *args: object) -> list[tuple[Any, ...]]:
    """Read the file as it is committed (a connection of its own, read only)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute(sql, args).fetchall()


def events_of(db: Path, task_id: str) -> list[str]:
    return [
        e for (e,) in rows(db, "SELECT event FROM events WHERE task_id = ? ORDER BY seq", task_id)
    ]


def held(db: Path, task_id: str) -> tuple[str, int, int]:
    """(status, epoch, attempt) of a task as committed."""
    found = rows(db, "SELECT status, epoch, attempt FROM tasks WHERE id = ?", task_id)
    return found[0]


def assert_leases_kept(
    db: Path, before: dict[str, tuple[str, int, int]], cluster: CliWorkers
) -> None:
    """Each long attempt is still GENERATING at the epoch it was claimed at, its events
    those of one attempt, and the worker halted none of its attempts but for a cancel."""
    for task_id, (status, epoch, attempt) in before.items():
        assert events_of(db, task_id) == ["submit", "claim", "acquire"], task_id
        assert (status, attempt) == ("GENERATING", 1)
        assert held(db, task_id) == ("GENERATING", epoch, 1), task_id
    assert not [r for r in cluster.lines("attempt_halted") if r.get("reason") != "cancel"]


def assert_every_step_cancelled_once(db: Path) -> None:
    assert rows(
        db, "SELECT count(*) FROM tasks WHERE pipeline_id IS NOT NULL AND status = 'CANCELLED'"
    ) == [(PIPELINES * 200,)]
    cancels = rows(
        db,
        "SELECT e.task_id, count(*) FROM events e JOIN tasks t"
        " ON t.id = e.task_id WHERE t.pipeline_id IS NOT NULL"
        " AND e.event = 'cancel' GROUP BY e.task_id",
    )
    assert len(cancels) == PIPELINES * 200 and {n for _, n in cancels} == {1}
    ended = rows(db, "SELECT count(*) FROM events WHERE event = 'steps_cancelled'")
    assert ended == [(PIPELINES,)]


async def running_attempts(globex: kiln.AsyncClient, db: Path) -> dict[str, tuple[str, int, int]]:
    """The other tenant's long tasks, once the worker runs all of them: by id, (status,
    epoch, attempt)."""
    ids = []
    for n in range(RUNNING):
        params = demo_params(f"long {n}", steps=150, step_ms=400)
        ids.append((await globex.submit("image.generate", params, max_attempts=1))["id"])

    async def all_generating() -> bool:
        return all(held(db, i)[0] == "GENERATING" for i in ids)

    await wait_until(all_generating, timeout_s=60, what="the worker to run every long task")
    return {i: held(db, i) for i in ids}


async def submit_meanwhile(globex: kiln.AsyncClient, done: asyncio.Event) -> list[dict[str, Any]]:
    """The other tenant submits, one task after another, until the bulk cancel is over."""
    answers = []
    while not done.is_set():
        params = demo_params(f"meanwhile {len(answers)}", steps=2)
        answers.append(await globex.submit("image.generate", params, delay_s=3600))
        await asyncio.sleep(0.05)  # a steady trickle, not a flood
    return answers


@pytest.mark.slow
@pytest.mark.timeout(300)  # 8,000 steps made and cancelled, on a machine shared with others
async def test_a_bulk_cancel_of_pipelines_leaves_the_writer_to_leases_and_submissions(
    cluster: CliWorkers, serve: Serve, tmp_path: Path
) -> None:
    db = tmp_path / "kiln.db"
    cluster.start("--concurrency", str(RUNNING), "--gpus", str(RUNNING))
    async with (
        kiln.AsyncClient(serve.url, api_key=ACME, timeout_s=120) as acme,
        kiln.AsyncClient(serve.url, api_key=GLOBEX, timeout_s=120) as globex,
    ):
        # Given the other tenant's four long attempts running on a `kiln worker` process
        before = await running_attempts(globex, db)
        # And 40 running pipelines of 200 waiting steps each (the worker's slots are full)
        pipelines = [(await acme.submit("pipeline", wide(n)))["id"] for n in range(PIPELINES)]
        # When acme cancels them by kind, page after page, while globex submits
        done = asyncio.Event()
        meanwhile = asyncio.create_task(submit_meanwhile(globex, done))
        pages = [page async for page in acme.cancel_many({"kind": ["pipeline"]})]
        done.set()
        submitted = await meanwhile
        # Then the worker's running attempts kept their leases: no expire, no new claim, no
        # retry, the same epoch, still generating
        assert_leases_kept(db, before, cluster)
        # And the other tenant's submissions were all answered, some committed between pages
        assert submitted and all(a["created"] for a in submitted)
        seqs = rows(db, "SELECT seq FROM events WHERE event = 'steps_cancelled' ORDER BY seq")
        first, last = seqs[0][0], seqs[-1][0]
        between = rows(
            db,
            "SELECT count(*) FROM events WHERE event = 'submit' AND tenant ="
            " 'globex' AND seq > ? AND seq < ?",
            first,
            last,
        )
        assert between[0][0] >= 1, (first, last)
        # And the pages were cut by rows: several, each pipeline in exactly one, in order
        print(f"pages: {[p['cancelled'] for p in pages]}, submitted meanwhile {len(submitted)}")
        assert len(pages) > 1 and all(p["cancelled"] >= 1 for p in pages[:-1])
        assert [i for p in pages for i in p["task_ids"]] == pipelines
        # And every pipeline and each of its 8,000 steps ended cancelled, each exactly once
        assert_every_step_cancelled_once(db)
        # When the long attempts are cancelled, the worker stops each (a write fenced by the
        # epoch it claimed at): it still held every lease
        for task_id in before:
            await globex.cancel(task_id)

        async def all_stopped() -> bool:
            return all(held(db, i)[0] == "CANCELLED" for i in before)

        await wait_until(all_stopped, timeout_s=60, what="the worker to stop the long tasks")
        for task_id in before:
            assert events_of(db, task_id) == ["submit", "claim", "acquire", "stopped"], task_id
