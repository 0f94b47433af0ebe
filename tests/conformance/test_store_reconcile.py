"""What the reconciler asks of every store: tasks by id in one query, and the fenced
``lose`` of a SUCCESS task's result (alone, or chained to ``schedule_retry``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

import kiln
from kiln.errors import Conflict
from kiln.reconcile import Missing, ResultLostPolicy, lose_result
from kiln.states import Event, Status
from kiln.store import Store

from .backends import Row
from .factories import KIND, drive, make_new_task

Truth = Callable[..., list[Row]]
S = Status


def _lost(task: kiln.Task) -> list[Missing]:
    return [Missing(task.id, f"tasks/{task.id}/1-1/image.png", "missing")]


async def test_get_many_returns_the_tasks_that_exist_by_id(store: Store) -> None:
    # Given three tasks
    ids = [(await store.submit(make_new_task({"prompt": f"p{n}"}))).task.id for n in range(3)]
    # When they are asked for with an unknown id and a repeat, in any order
    found = await store.get_many([ids[2], "tsk_unknown", ids[0], ids[2], ids[1]])
    # Then each task that exists comes once, by id, as get() reads it
    assert sorted(found) == sorted(ids)
    for task_id in ids:
        assert found[task_id] == await store.get(task_id)
    assert await store.get_many([]) == {}
    assert await store.get_many(["tsk_unknown"]) == {}


async def test_get_many_reads_more_ids_than_one_statement_takes(store: Store) -> None:
    # Given more tasks than SQLite binds in one statement
    ids = [(await store.submit(make_new_task({"prompt": f"p{n}"}))).task.id for n in range(1100)]
    # When they are asked for at once
    found = await store.get_many(ids)
    # Then every one comes back
    assert set(found) == set(ids)


async def test_lose_with_fail_ends_failed_result_lost_and_bumps_the_epoch(
    engine: kiln.App, store: Store, truth: Truth
) -> None:
    # Given a SUCCESS task
    task = await drive(store, make_new_task(), S.SUCCESS)
    # When its result is lost under the fail policy
    lost = await lose_result(engine, task, _lost(task), ResultLostPolicy.FAIL)
    # Then it is FAILED result_lost, final, without a result, at a new epoch
    assert lost.status is S.FAILED
    assert lost.result is None
    assert lost.error is not None and lost.error["code"] == "result_lost"
    assert lost.error["retryable"] is False
    assert lost.epoch == task.epoch + 1
    assert lost.finished_at is not None
    events = await store.events(task_id=task.id)
    assert [(e.event, e.status, e.final) for e in events[-1:]] == [(Event.LOSE, S.FAILED, True)]
    assert truth("SELECT status FROM tasks WHERE id = ?", task.id) == [("FAILED",)]
    # And the same content submitted again makes a new task (FAILED leaves dedup)
    again = await store.submit(make_new_task())
    assert again.created and again.task.id != task.id


async def test_lose_with_rerun_schedules_a_retry_due_now_in_the_same_change(
    engine: kiln.App, store: Store
) -> None:
    # Given a SUCCESS task that used every attempt it had
    task = await drive(store, make_new_task(max_attempts=1), S.SUCCESS)
    # When its result is lost under the rerun policy
    lost = await lose_result(engine, task, _lost(task), ResultLostPolicy.RERUN)
    # Then it waits in RETRYING, due now, with one more attempt allowed
    assert lost.status is S.RETRYING
    assert lost.result is None and lost.finished_at is None
    assert lost.error is not None and lost.error["code"] == "result_lost"
    assert lost.max_attempts == 2
    assert lost.next_retry_at is not None and lost.next_retry_at <= store.clock()
    events = await store.events(task_id=task.id)
    assert [(e.event, e.from_status, e.status) for e in events[-2:]] == [
        (Event.LOSE, S.SUCCESS, S.FAILED),
        (Event.SCHEDULE_RETRY, S.FAILED, S.RETRYING),
    ]
    assert not any(e.final for e in events[-2:])
    # And a worker can claim it for a new attempt at a new epoch
    [claimed] = await store.claim(worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=30.0)
    assert (claimed.id, claimed.attempt) == (task.id, task.attempt + 1)
    assert claimed.epoch > lost.epoch


async def test_lose_applies_only_at_the_epoch_it_read(engine: kiln.App, store: Store) -> None:
    # Given a SUCCESS task, and a copy of it read at an older epoch
    task = await drive(store, make_new_task(), S.SUCCESS)
    stale = dataclasses.replace(task, epoch=task.epoch - 1)
    # When the stale copy's result is lost, and then the current one's twice
    with pytest.raises(Conflict):
        await lose_result(engine, stale, _lost(task), ResultLostPolicy.FAIL)
    unchanged = await store.get(task.id)
    await lose_result(engine, task, _lost(task), ResultLostPolicy.RERUN)
    with pytest.raises(Conflict):
        await lose_result(engine, task, _lost(task), ResultLostPolicy.RERUN)
    # Then only the write at the epoch read applied, once
    assert unchanged == task
    after = await store.get(task.id)
    assert after is not None and after.status is S.RETRYING and after.max_attempts == 4
    events = await store.events(task_id=task.id)
    assert [e.event for e in events].count(Event.LOSE) == 1
