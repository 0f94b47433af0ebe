"""Two real `kiln supervisor` processes on one store fire a schedule every second; the
leader is killed with SIGKILL mid-run. Every tick from the first to the last must have
made exactly one task: none twice (the tick's idempotency key and the schedule's
compare-and-set), none lost (the successor fires the ticks of the gap, late but within
the grace). On SQLite and on PostgreSQL.
"""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import kiln
from cli.conftest import Process, Processes, clean_env, wait_until
from kiln import canonical, demo
from kiln.config import Settings
from kiln.store import ScheduleRecord
from kiln.timing import Cron

from .conftest import demo_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

INTERVAL_S = 0.2


@pytest.fixture(params=["sqlite", "postgres"])
async def shared_app(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[kiln.App]:
    """The test's App (real clock) on the database the supervisors will share."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        settings = settings.with_(database_url=server.new_database())
    instance = kiln.App(settings=settings)
    demo.register(instance)
    async with instance:
        yield instance


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite:"):
        with sqlite3.connect(url.removeprefix("sqlite:///"), timeout=10) as conn:
            return conn.execute(sql).fetchall()
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def leader_pid(url: str) -> int | None:
    found = rows(url, "SELECT owner FROM leaders WHERE name = 'supervisor'")
    return int(found[0][0].rsplit(":", 2)[1]) if found else None


def task_keys(url: str) -> list[str]:
    return [r[0] for r in rows(url, "SELECT idempotency_key FROM tasks")]


async def test_each_tick_fires_exactly_once_across_a_killed_leader(
    shared_app: kiln.App, tmp_path: Path
) -> None:
    # Given a schedule every second, and two supervisor processes on its store
    url = shared_app.settings.resolved_database_url
    now = shared_app.now()
    cron = Cron.parse("* * * * * *", "UTC", now=now)
    params = shared_app.kind("image.generate").validate(demo_params("a tide clock"))
    schedule = await shared_app.engine.store.schedules.create(ScheduleRecord(
        id=canonical.new_id("sch_"), tenant="default", cron=cron.expression, timezone="UTC",
        submission={"kind": "image.generate", "params": params, "priority": 0,
                    "max_attempts": 3, "deadline_s": 3600.0, "timeouts": {}, "metadata": {},
                    "webhook": None},
        overlap="queue", missed="fire_once", paused=False, next_at=cron.next_after(now),
    ))  # fmt: skip
    env = clean_env(
        KILN_DATABASE_URL=url,
        KILN_STORAGE_URL=shared_app.settings.resolved_storage_url,
        KILN_SUPERVISOR_INTERVAL_S=str(INTERVAL_S),
    )
    procs = Processes(tmp_path)
    supervisors: list[Process] = [
        procs.start(f"supervisor{n}", ["supervisor", "--data-dir", str(tmp_path / "data")], env)
        for n in range(2)
    ]
    try:
        # When the leader has fired a few ticks and is killed, and the other takes over
        wait_until(lambda: len(task_keys(url)) >= 3, 60, "three ticks fired")
        pid = wait_until(lambda: leader_pid(url), 10, "a leader")
        victim = next(p for p in supervisors if p.pid == pid)
        procs.kill(victim)
        killed_at = len(task_keys(url))
        survivor = next(p for p in supervisors if p is not victim)
        wait_until(lambda: leader_pid(url) == survivor.pid, 30, "the survivor leads")
        wait_until(lambda: len(task_keys(url)) >= killed_at + 4, 60, "four more ticks")
        await shared_app.engine.store.schedules.set_paused(schedule.id, paused=True, next_at=None)
        time.sleep(3 * INTERVAL_S)  # a pass in flight when the pause came ends
        assert survivor.alive(), survivor.output()
    finally:
        procs.stop_all()
        for process in supervisors:
            print(f"--- {process.name}\n{process.output()[-3000:]}")

    # Then no key is used twice, and the fired ticks are every second from first to last
    keys = task_keys(url)
    assert max(Counter(keys).values()) == 1
    prefix = f"schedule:{schedule.id}:"
    ticks = sorted(int(k.removeprefix(prefix)) for k in keys)
    assert ticks == list(range(ticks[0], ticks[-1] + 1))
    assert ticks[0] == int(cron.next_after(now) or 0)
    after = await shared_app.engine.store.schedules.get(schedule.id)
    assert after is not None and after.fired == len(keys)
