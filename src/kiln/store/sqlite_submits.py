"""New submissions of one SQLite group commit, written in a few statements for all of them.

The writer thread shares the interpreter lock with the event loop. SQLite's own work runs
without that lock, but every statement hands it back and takes it again, and while the
event loop is busy each take waits for a switch: a writer that runs four statements per
submission spends its batch waiting for the loop, and the two take turns instead of
running at once. Plain submissions that meet in one batch (no idempotency key, no inputs
by reference, no trace, no fair-share position) are therefore written together: one
lookup of their content keys per tenant, one INSERT of their task rows, one of their event
rows; each submission's answer, its dedup hit and its counts are those
:meth:`kiln.store.sqlstore.TaskOps._submit` gives it alone, in the order they came, and its
queue position is read once all of them are written (a level's at once), as a read after
the commit gives it.

Whatever the group cannot answer the way one submission would (a content key taken by a
row it did not see), it leaves to the one-by-one path: :func:`submit_group` returns None
before it changed a row, and the writer runs the operations one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln import counters as names
from kiln.models import NewTask, SubmitResult, Task
from kiln.states import Event, Status
from kiln.store.claims import queued_and_due
from kiln.store.rows import insert_args, inserted_row, task_from_row
from kiln.store.sqlite_tx import INSERT_TASK, rows_of
from kiln.store.tx import EventRow, run_sync

if TYPE_CHECKING:
    from kiln.store.claims import ClaimPolicy
    from kiln.store.sqlite_tx import SqliteTx
    from kiln.store.sqlstore import Store

#: Task rows one INSERT writes at most (SQLite's default limit is 32,766 parameters).
ROWS_AT_ONCE = 16


@dataclass(slots=True, frozen=True)
class Grouped:
    """One plain submission as the writer can write it with others."""

    store: Store
    new: NewTask
    prepared: Sequence[Any]
    place: bool
    policy: ClaimPolicy | None

    @staticmethod
    def takes(new: NewTask, policy: ClaimPolicy | None) -> bool:
        """Whether a submission is plain enough to be written with others."""
        return (
            new.idempotency_key is None
            and not new.inputs
            and new.trace is None
            and (policy is None or not policy.fair)
        )


def submit_group(tx: SqliteTx, items: Sequence[Grouped]) -> list[SubmitResult] | None:
    """The answers of ``items``, written in ``tx``; None (nothing written) when one of them
    needs the one-by-one path."""
    store = items[0].store
    now = store.clock()
    rows: list[list[Any]] = []
    built: list[tuple[Any, ...]] = []
    for item in items:
        args = insert_args(item.new, now, item.prepared)
        row = inserted_row(args)
        if row is None:
            return None
        rows.append(args)
        built.append(row)
    held = _held_content(tx, items)
    results: list[SubmitResult] = []
    fresh: list[int] = []
    for i, item in enumerate(items):
        key = item.new.dedup_key
        found = None if key is None else held.get((item.new.tenant, key))
        if found is not None:
            tx.bump(names.DEDUP_HITS, "content")
            results.append(SubmitResult(found, created=False, deduplicated=True))
            continue
        task = task_from_row(built[i])
        if key is not None:
            held[(item.new.tenant, key)] = task
        fresh.append(i)
        results.append(SubmitResult(task, created=True))
    if fresh:
        _insert_tasks(tx, [rows[i] for i in fresh])
        submitted = Event.SUBMIT, None, Status.PENDING, None, now, None
        run_sync(tx.insert_events([EventRow(results[i].task, 1, *submitted) for i in fresh]))
        for i in fresh:
            tx.count_status(items[i].new.tenant, Status.PENDING, 1)
        run_sync(tx.notify_ready())
    placed = [i for i, item in enumerate(items) if item.place]
    if placed:
        now = store.clock()
        places = _positions(store, tx, [(results[i].task, items[i].policy) for i in placed], now)
        for i in placed:
            was = results[i]
            position = places.get(was.task.id)
            results[i] = SubmitResult(
                was.task, was.created, was.replayed, was.deduplicated, position, placed=True
            )
    return results


def _positions(
    store: Store, tx: SqliteTx, asked: Sequence[tuple[Task, ClaimPolicy | None]], now: float
) -> dict[str, int]:
    """The queue positions of the queued and due tasks of ``asked``, by task id, read at
    ``now`` after all of them were written: in the default order a level's tasks at once
    (:meth:`~kiln.store.claims.ClaimOps._places`: the first's place, then one pass over
    the level up to the last), under aging each alone."""
    ready = {task.id: (task, policy) for task, policy in asked if queued_and_due(task, now)}
    in_order = [task for task, policy in ready.values() if policy is None or policy.aging_s is None]
    found = run_sync(store._places(tx, in_order, now)) if in_order else {}
    for task, policy in ready.values():
        if task.id not in found:
            found[task.id] = run_sync(store._position(tx, task, policy, now))
    return found


def _held_content(tx: SqliteTx, items: Sequence[Grouped]) -> dict[tuple[str, str], Task]:
    """The live or successful tasks holding the items' content keys, one read per tenant."""
    keys: dict[str, list[str]] = {}
    for item in items:
        if item.new.dedup_key is not None:
            keys.setdefault(item.new.tenant, []).append(item.new.dedup_key)
    held: dict[tuple[str, str], Task] = {}
    for tenant, wanted in keys.items():
        for row in run_sync(tx.all(tx.q.dedup_lookup_many, (tenant, wanted))):
            task = task_from_row(row)
            held[(tenant, task.dedup_key)] = task  # type: ignore[index]
    return held


def _insert_tasks(tx: SqliteTx, rows: list[list[Any]]) -> None:
    for start in range(0, len(rows), ROWS_AT_ONCE):
        chunk = rows[start : start + ROWS_AT_ONCE]
        sql = rows_of(INSERT_TASK, len(chunk))
        written = tx.conn.execute(sql, [value for row in chunk for value in row]).rowcount
        if written != len(chunk):  # a content key taken meanwhile: one by one instead
            raise _Taken


class _Taken(Exception):
    """A content key was taken by a row the group did not see."""


__all__ = ["Grouped", "submit_group"]
