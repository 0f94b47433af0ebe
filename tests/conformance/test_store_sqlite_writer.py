"""SQLite's writer builds what it writes instead of reading it back, inside the file lock:
what it answers must be what a read of the database gives, value and type alike (a REAL
column reads back a float even where an int was written; ``RETURNING`` gave the int)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from kiln.models import Task, TaskEvent, Timeouts
from kiln.states import Event, Status
from kiln.store.rows import TASK_COLUMNS, insert_args, inserted_row
from kiln.store.sqlite import SqliteStore, connect, migrate
from kiln.store.sqlite_tx import INSERT_TASK
from kiln.store.tx import EventRow, Tx

from .factories import claim_one, make_new_task, step_change

NOW = 1_800_000_000.0


def typed(task: Task) -> list[tuple[str, type, Any]]:
    """Every field with its type: ``5 == 5.0``, but a REAL column reads back as float."""
    return [(f.name, type(v), v) for f in fields(task) for v in [getattr(task, f.name)]]


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(str(tmp_path / "kiln.db"), clock=lambda: NOW)
    try:
        yield store
    finally:
        await store.close()


async def trace_writer(store: SqliteStore, seen: list[str]) -> None:
    """Record every statement the writer's connection runs from now on."""

    async def op(tx: Tx) -> None:
        tx.conn.set_trace_callback(seen.append)  # type: ignore[attr-defined]

    await store._write(op)


SUBMISSIONS: dict[str, Callable[[], Any]] = {
    "plain": lambda: make_new_task(),
    "delayed, webhook, model, batch": lambda: replace(
        make_new_task(priority=2),
        run_at=NOW + 30,
        webhook={"url": "https://example.com/hook", "events": ["final"]},
        model="sdxl",
        batch_key="b1",
        metadata={"who": "me", "n": [1, 2]},
    ),
    "a step of a pipeline, whole-second numbers": lambda: replace(
        make_new_task(deadline_s=60, timeouts=Timeouts(1, 2, 3)),
        pipeline_id="tsk_pipeline",
        step="draw",
        step_copy=3,
        run_at=NOW + 1,
    ),
    "rerun, no dedup key": lambda: replace(make_new_task(dedup=False), rerun_of="tsk_before"),
}


@pytest.mark.parametrize("shape", sorted(SUBMISSIONS))
def test_the_built_row_is_the_row_sqlite_stores(tmp_path: Path, shape: str) -> None:
    conn = connect(str(tmp_path / "kiln.db"))
    migrate(conn)
    new = SUBMISSIONS[shape]()
    for n, now in enumerate((NOW, int(NOW))):  # a clock may give whole seconds as an int
        new = replace(new, id=f"{new.id[:-1]}{n}", dedup_key=None)
        args = insert_args(new, now)
        conn.execute(INSERT_TASK, args)
        stored = conn.execute("SELECT * FROM tasks WHERE id = ?", (new.id,)).fetchone()
        built = inserted_row(args)
        assert built is not None and len(built) == len(TASK_COLUMNS)
        assert [(type(v), v) for v in built] == [(type(v), v) for v in stored]
    conn.close()


def test_a_value_sqlite_would_store_otherwise_is_read_back() -> None:
    new = make_new_task()
    assert inserted_row(insert_args(replace(new, priority=True), NOW)) is None  # type: ignore[arg-type]
    assert inserted_row(insert_args(replace(new, model=7), NOW)) is None  # type: ignore[arg-type]
    assert inserted_row(insert_args(replace(new, deadline_s=float("nan")), NOW)) is None


@pytest.mark.parametrize("shape", sorted(SUBMISSIONS))
async def test_a_submit_answers_the_task_as_stored(sqlite_store: SqliteStore, shape: str) -> None:
    submitted = (await sqlite_store.submit(SUBMISSIONS[shape]())).task
    stored = await sqlite_store.get(submitted.id)
    assert stored is not None
    assert typed(submitted) == typed(stored)


async def test_a_submit_of_taken_content_answers_the_task_holding_it(
    sqlite_store: SqliteStore,
) -> None:
    first = await sqlite_store.submit(make_new_task())
    again = await sqlite_store.submit(make_new_task())
    assert first.created and not again.created and again.deduplicated
    assert again.task == first.task


async def test_the_lifecycle_reads_nothing_back_and_its_events_carry_their_seqs(
    sqlite_store: SqliteStore,
) -> None:
    # Given the statements of the writer, traced
    seen: list[str] = []
    await trace_writer(sqlite_store, seen)

    # When a task is submitted, claimed and taken through its attempt
    task = (await sqlite_store.submit(make_new_task())).task
    task = await claim_one(sqlite_store)
    events = []
    for event in (Event.ACQUIRE, Event.GENERATED, (Event.UPLOADED, Status.SUCCESS)):
        task, step = await sqlite_store.apply(step_change(task, event))
        events += step

    # Then no write of a submit or an event read a row back
    writes = [s for s in seen if s.lstrip().startswith(("INSERT INTO tasks", "INSERT INTO events"))]
    assert writes and not [s for s in writes if "RETURNING" in s]
    # And the events answered are the log's, seq for seq
    logged = await sqlite_store.events(task_id=task.id)
    assert events == logged[-3:]
    assert [e.seq for e in logged] == sorted({e.seq for e in logged})


@pytest.mark.parametrize("count", [1, 2, 3, 32, 37, 70])
async def test_event_rows_written_together_get_the_seqs_the_log_holds(
    sqlite_store: SqliteStore, count: int
) -> None:
    # Given a task with an event logged already, and another task's event after it
    task = (await sqlite_store.submit(make_new_task())).task
    other = (await sqlite_store.submit(make_new_task({"other": True}))).task
    claimed = (Event.CLAIM, Status.PENDING, Status.WAITING_FOR_RESOURCE)
    rows = [
        EventRow(task, 1 + n, *claimed, {"n": n} if n % 2 else None, NOW + n, 0.5 * n)
        for n in range(1, count + 1)
    ]

    # When they are written in one call
    async def write(tx: Tx) -> list[TaskEvent]:
        return await tx.insert_events(rows)

    answered = await sqlite_store._write(write)

    # Then each answer is its row as the log reads it, seqs in order after the others'
    logged = await sqlite_store.events(task_id=task.id)
    assert answered == logged[1:]
    assert [e.seq for e in answered] == sorted(e.seq for e in answered)
    first_other = (await sqlite_store.events(task_id=other.id))[0]
    assert answered[0].seq > first_other.seq
