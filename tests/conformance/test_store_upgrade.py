"""A database written by an earlier kiln upgrades in place and keeps working.

``upgrade/<backend>_b501b2a.sql`` is a dump of a store written by the code of commit
b501b2a (the last one with two separate store implementations): four tasks (PENDING with
an idempotency key, GENERATING with a live lease, SUCCESS, FAILED without retries), their
events, counters, a breaker, a token bucket and a leader. Each test loads the dump into a
fresh database, opens it with today's store, and uses it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kiln.states import FINAL, Event, Status, replay
from kiln.store import Store, open_store
from kiln.store.queries import migrations
from services.postgres import PostgresServer

from .factories import KIND, SettableClock, make_new_task, step_change

DUMPS = Path(__file__).parent / "upgrade"
#: The statuses the dump holds, by the prompt of each task's params.
WRITTEN = {
    "pending one": Status.PENDING,
    "running one": Status.GENERATING,
    "done one": Status.SUCCESS,
    "failed one": Status.FAILED,
}


def _load_sqlite(directory: Path) -> str:
    path = directory / "kiln.db"
    conn = sqlite3.connect(path)
    try:
        conn.executescript((DUMPS / "sqlite_b501b2a.sql").read_text(encoding="utf-8"))
    finally:
        conn.close()
    return f"sqlite:///{path}"


def _load_postgres(server: PostgresServer) -> str:
    import psycopg

    url = server.new_database(template="template0")
    script = "\n".join(
        line
        for line in (DUMPS / "postgres_b501b2a.sql").read_text(encoding="utf-8").splitlines()
        if not line.startswith("\\")  # psql's own commands (\restrict)
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(script.encode())
    return url


#: A few seconds after the dumps were written: the leases and deadlines in them still hold.
THEN = 1_796_161_345.0


@pytest.fixture(params=["sqlite", "postgres"])
async def upgraded(
    request: pytest.FixtureRequest, tmp_path: Path, clock: SettableClock
) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        url = _load_sqlite(tmp_path)
    else:
        url = _load_postgres(request.getfixturevalue("postgres_server"))
    clock.now = THEN
    store = open_store(url, clock=clock)
    try:
        yield store
    finally:
        await store.close()


async def test_a_database_of_b501b2a_opens_with_every_task_and_its_log(upgraded: Store) -> None:
    # When today's store opens the old database
    tasks, _ = await upgraded.list_tasks(tenant=None, limit=100)
    # Then every task is there in its status, and replaying its events gives that status
    assert {t.params["prompt"]: t.status for t in tasks} == WRITTEN
    for task in tasks:
        events = await upgraded.events(task_id=task.id)
        assert replay((e.event, e.from_status, e.status) for e in events) == task.status
    # And the counts, counters and shared state written then are read now
    stats = await upgraded.stats(tenant=None, ghost_after_s=60)
    assert {s: n for s, n in stats.counts.items() if n} == {
        "PENDING": 1, "GENERATING": 1, "SUCCESS": 1, "FAILED": 1,
    }  # fmt: skip
    assert stats.failures == {"boom": 1}
    assert [b.name for b in await upgraded.limits.breakers()] == ["image.generate"]
    counters = await upgraded.counters()
    assert counters[("transitions", "UPLOADING>SUCCESS")] == 1


async def test_an_upgraded_database_keeps_its_keys_and_takes_new_work(upgraded: Store) -> None:
    by_prompt = {t.params["prompt"]: t for t in (await upgraded.list_tasks(tenant=None))[0]}
    # Given the old database's idempotency key and content
    replayed = await upgraded.submit(
        make_new_task({"prompt": "pending one"}, idempotency_key="key-a")
    )
    assert replayed.replayed and replayed.task.id == by_prompt["pending one"].id
    deduplicated = await upgraded.submit(make_new_task({"prompt": "done one"}, tenant="globex"))
    assert deduplicated.deduplicated and deduplicated.task.id == by_prompt["done one"].id
    # When the old running task finishes and the old pending one is claimed and run
    running = by_prompt["running one"]
    generated, _ = await upgraded.apply(step_change(running, Event.GENERATED))
    done, _ = await upgraded.apply(step_change(generated, (Event.UPLOADED, Status.SUCCESS)))
    claimed = await upgraded.claim(worker_id="w2", kinds=[KIND], limit=5, lease_ttl_s=60)
    # Then both move on like any task of today, and a new submission is new work
    assert done.status is Status.SUCCESS and done.status in FINAL
    assert [t.id for t in claimed] == [by_prompt["pending one"].id]
    assert claimed[0].attempt == 1 and claimed[0].epoch == 1
    fresh = await upgraded.submit(make_new_task({"prompt": "a new one"}))
    assert fresh.created


def test_the_dumps_are_at_the_last_migration_before_the_change() -> None:
    # The upgrade tests start from the schema b501b2a wrote; newer migrations apply on top.
    sqlite_dump = (DUMPS / "sqlite_b501b2a.sql").read_text(encoding="utf-8")
    postgres_dump = (DUMPS / "postgres_b501b2a.sql").read_text(encoding="utf-8")
    assert "INSERT INTO \"schema_migrations\" VALUES(8,'0008_breakers.sql'" in sqlite_dump
    assert max(v for v, _, _ in migrations("sqlite")) >= 8
    assert "0006_breakers.sql" in postgres_dump
    assert max(v for v, _, _ in migrations("postgres")) >= 6
