"""A pipeline's transactional part: its steps are created, and it ends, in the transaction
of the change that makes it so (docs/pipelines.md).

The graph and its policy are pure (:mod:`kiln.pipelines`); here they meet the rows. Every
function runs inside one transaction of the store (``ops`` is the store's
:class:`~kiln.store.sqlstore.TaskOps`), and locks the pipeline's row first,
so two steps that end together advance it one after the other. One lock order everywhere:
the pipeline's row, then its steps in id order (a step's own final change locks its
pipeline before the step: ``TaskOps._apply``); a step this code changes is read locked and
decided from that row, and another task's refusal never aborts the transaction.

The pipeline keeps the map of its steps (``name/copy`` to task id) in its ``result``: a
step whose content is already done by another task (content dedup) is that task, done as
of the moment it was taken: the outputs its successors read are kept in the map
(``taken``), whatever that task does later.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from kiln import canonical
from kiln import counters as names
from kiln import pipelines as graph
from kiln.errors import Conflict, NotFound
from kiln.models import JSON, NewTask, SubmitResult, Task, TaskEvent, Timeouts
from kiln.states import ENDED_UNSUCCESSFULLY, FINAL, RUNNING, Event, Status
from kiln.store.queries import Queries
from kiln.store.records import Change
from kiln.store.rows import dumps, task_from_row
from kiln.store.tx import Refused, Tx


class Host(Protocol):
    """What these operations need of the store (:class:`~kiln.store.sqlstore.TaskOps`)."""

    q: Queries
    clock: Callable[[], float]

    async def _submit(self, tx: Tx, new: NewTask) -> SubmitResult | Refused: ...

    async def _insert(self, tx: Tx, new: NewTask, now: float) -> Task | None: ...

    async def _apply(self, tx: Tx, change: Change) -> tuple[Task, list[TaskEvent]] | Refused: ...


#: A running pipeline has no deadline of its own (its steps have theirs): far away, so
#: the supervisor's sweep never finds it due.
NO_DEADLINE = 253402300799.0
#: The pipeline's stage while its steps run.
STAGE = "steps"


#: Steps read for a change, locked until commit, in id order (the one lock order).
LOCK_STEPS = "SELECT * FROM tasks WHERE id {IN_LIST} ORDER BY id {FOR_UPDATE}"


def step_map(pipeline: Task) -> dict[str, str]:
    return dict((pipeline.result or {}).get("steps", {}))


def taken_map(pipeline: Task) -> dict[str, JSON]:
    """The steps taken from another task (content dedup), by ``name/copy``: that task's
    id and the outputs it had when taken."""
    return dict((pipeline.result or {}).get("taken", {}))


def _result(mapping: dict[str, str], taken: dict[str, JSON]) -> JSON:
    return {"steps": mapping, "taken": taken} if taken else {"steps": mapping}


async def submit(ops: Host, tx: Tx, new: NewTask) -> SubmitResult | Refused:
    """Insert-or-get the pipeline as any task; a new one starts (GENERATING) with its first
    steps, in this transaction."""
    result = await ops._submit(tx, new)
    if isinstance(result, Refused) or not result.created:
        return result
    started = await start(ops, tx, result.task, (Event.RUN_STEPS,), {"started_at": ops.clock()})
    return SubmitResult(started, created=True)


async def start(
    ops: Host, tx: Tx, pipeline: Task, events: tuple[Event, ...], fields: dict[str, Any]
) -> Task:
    """Move the pipeline to GENERATING through ``events`` and create what is ready."""
    targets = {Event.RUN_STEPS: Status.GENERATING, Event.RETRY: Status.RETRYING}
    change = Change(
        task_id=pipeline.id,
        expect_status=pipeline.status,
        expect_epoch=None,
        steps=tuple((event, targets[event]) for event in events),
        fields={
            **fields,
            "deadline_at": NO_DEADLINE,
            "stage": STAGE,
            "result": _result(step_map(pipeline), taken_map(pipeline)),
            "error": None,
        },
    )
    applied = await ops._apply(tx, change)
    if isinstance(applied, Refused):
        raise applied.error
    return await advance(ops, tx, applied[0])


async def step_ended(ops: Host, tx: Tx, step: Task, event: Event) -> None:
    """A step of a pipeline reached a final status: advance its pipeline (when it still
    runs) in the same transaction. A running step that stopped for a cancel taken back
    (its pipeline was retried meanwhile: no cancel asked any more) runs again instead."""
    assert step.pipeline_id is not None
    if await tx.one(ops.q.lock_task, (step.pipeline_id,)) is None:
        return
    row = await tx.one(ops.q.get_task, (step.pipeline_id,))
    assert row is not None
    pipeline = task_from_row(row)
    if pipeline.status is not Status.GENERATING:
        return
    if event in (Event.STOPPED, Event.FORCE_CANCEL) and not step.cancel_requested:
        await _retry_step(ops, tx, step)
        return
    await advance(ops, tx, pipeline)


async def _steps(ops: Host, tx: Tx, ids: list[str]) -> dict[str, Task]:
    if not ids:
        return {}
    rows = await tx.all(ops.q.get_tasks, (sorted(set(ids)),))
    return {task.id: task for task in map(task_from_row, rows)}


async def _locked_steps(ops: Host, tx: Tx, ids: list[str]) -> list[Task]:
    """The tasks of ``ids``, locked until commit in id order (the pipeline's row is locked
    first by the caller): what a change of them decides from."""
    if not ids:
        return []
    rows = await tx.all(ops.q.sql(LOCK_STEPS), (id_list(ops.q, ids),))
    return [task_from_row(row) for row in rows]


def id_list(q: Queries, ids: Any) -> Any:
    """Ids as the parameter of ``{IN_LIST}`` in SQL built here (SQLite reads a JSON array;
    named queries get this from their driver)."""
    found = sorted(set(ids))
    return json.dumps(found) if q.dialect == "sqlite" else found


def _view(
    pipeline: Task, mapping: dict[str, str], taken: dict[str, JSON], tasks: dict[str, Task]
) -> tuple[dict[graph.Copy, Status], dict[graph.Copy, JSON]]:
    """Each made copy's status and result as the pipeline sees them. A copy taken from
    another task is SUCCESS with the outputs it had when taken: that task's later changes
    (a rerun after its result was lost) carry no news for this pipeline, which must never
    wait on them."""
    statuses: dict[graph.Copy, Status] = {}
    results: dict[graph.Copy, JSON] = {}
    for key, task_id in mapping.items():
        copy = _copy(key)
        task = tasks.get(task_id)
        if key in taken:
            statuses[copy] = Status.SUCCESS
            results[copy] = {"outputs": list(taken[key].get("outputs", []))}
        elif task is not None and task.pipeline_id != pipeline.id:
            # taken before its outputs were kept in the map: done as well
            statuses[copy] = Status.SUCCESS
            results[copy] = (task.result or {}) if task.status is Status.SUCCESS else {}
        elif task is not None:
            statuses[copy] = task.status
            results[copy] = task.result or {}
    return statuses, results


async def advance(ops: Host, tx: Tx, pipeline: Task) -> Task:
    """Create the copies that are ready, until none is (a copy whose content another task
    already did counts as done at once); then end the pipeline when its steps say so."""
    steps: list[JSON] = pipeline.params["steps"]
    policy = str(pipeline.params.get("on_failure", "stop"))
    repeats = {str(s["name"]): int(s.get("repeat", 1)) for s in steps}
    mapping, taken = step_map(pipeline), taken_map(pipeline)
    tasks = await _steps(ops, tx, list(mapping.values()))
    missing: str | None = None
    while True:
        statuses, results = _view(pipeline, mapping, taken, tasks)
        verdict = graph.verdict(steps, policy, statuses)
        if verdict.end is not None or not verdict.create:
            break
        for step, index in verdict.create:
            records = graph.input_records(step, index, repeats, results)
            if isinstance(records, str):
                missing = records
                break
            task = await _create(ops, tx, pipeline, step, index, records)
            key = graph.key((str(step["name"]), index))
            mapping[key] = task.id
            tasks[task.id] = task
            if task.pipeline_id != pipeline.id:  # taken from another task: done as it is now
                outputs = list((task.result or {}).get("outputs", []))
                taken[key] = {"task_id": task.id, "outputs": outputs}
        if missing is not None:
            break
    statuses, _ = _view(pipeline, mapping, taken, tasks)  # with the copies made last
    done = sum(1 for status in statuses.values() if status is Status.SUCCESS)
    fields = {
        "result": _result(mapping, taken),
        "progress_step": done,
        "progress_total": sum(repeats.values()),
    }
    if missing is not None:
        lacking = {"code": "step_input_missing", "message": missing, "retryable": False}
        return await _end(ops, tx, pipeline, Status.FAILED, fields, lacking, mapping)
    if verdict.end is None:
        now = ops.clock()
        args = (dumps(fields["result"]), done, fields["progress_total"], now, now, pipeline.id)
        row = await tx.one(ops.q.pipeline_progress, args)
        assert row is not None
        return task_from_row(row)
    error = _failure(verdict.failed, mapping, tasks)
    return await _end(ops, tx, pipeline, verdict.end, fields, error, mapping)


def _failure(
    failed: list[graph.Copy], mapping: dict[str, str], tasks: dict[str, Task]
) -> JSON | None:
    """The pipeline's error when steps ended without success (none when none did)."""
    if not failed:
        return None
    first = tasks[mapping[graph.key(failed[0])]]
    cause = (first.error or {}).get("code", str(first.status).lower())
    message = f"step {graph.key(failed[0])} ended {first.status}: {cause}"
    return {"code": "step_failed", "retryable": False, "message": message}


def _copy(key: str) -> graph.Copy:
    name, _, index = key.rpartition("/")
    return name, int(index)


async def _create(
    ops: Host, tx: Tx, pipeline: Task, step: JSON, index: int, records: list[JSON]
) -> Task:
    """A copy of a step as a task of its own; content dedup applies: a task that already
    succeeded with the same content is the step (done); one still running elsewhere is
    not waited for, the step runs as its own task."""
    run = step["copies"][index]
    contents = [f"{r['name']}:{r['sha256']}" for r in records]
    dedup = pipeline.dedup_key is not None  # a pipeline submitted with dedup off: none
    kind, params = str(step["kind"]), run["params"]
    new = NewTask(
        id=canonical.new_task_id(),
        tenant=pipeline.tenant,
        kind=kind,
        params=params,
        fingerprint=canonical.digest({"kind": kind, "params": params, "inputs": contents}),
        idempotency_key=None,
        dedup_key=canonical.dedup_key(kind, params, contents) if dedup else None,
        priority=pipeline.priority,
        max_attempts=pipeline.max_attempts,
        deadline_s=pipeline.deadline_s,
        timeouts=Timeouts(*step["timeouts"]),
        inputs=records,
        model=run.get("model"),
        batch_key=run.get("batch_key"),
        pipeline_id=pipeline.id,
        step=str(step["name"]),
        step_copy=index,
    )
    now = ops.clock()
    if new.dedup_key is not None:
        row = await tx.one(ops.q.dedup_lookup, (new.tenant, new.dedup_key))
        if row is not None:
            found = task_from_row(row)
            if found.status is Status.SUCCESS:
                tx.bump(names.DEDUP_HITS, "content")
                return found
            new = _without_dedup(new)
    task = await ops._insert(tx, new, now)
    if task is None:  # the same content was inserted meanwhile: run this one anyway
        task = await ops._insert(tx, _without_dedup(new), now)
    assert task is not None
    return task


def _without_dedup(new: NewTask) -> NewTask:
    return replace(new, dedup_key=None)


async def _end(
    ops: Host,
    tx: Tx,
    pipeline: Task,
    status: Status,
    fields: dict[str, Any],
    error: JSON | None,
    mapping: dict[str, str],
) -> Task:
    """End the pipeline; a failure first stops what still runs of its own steps."""
    if status is not Status.SUCCESS:
        await stop_steps(ops, tx, pipeline, list(mapping.values()))
    event = {
        Status.SUCCESS: Event.STEPS_DONE,
        Status.FAILED: Event.STEP_FAILED,
        Status.CANCELLED: Event.STEPS_CANCELLED,
    }[status]
    change = Change(
        task_id=pipeline.id,
        expect_status=Status.GENERATING,
        expect_epoch=None,
        steps=((event, status),),
        fields={**fields, "stage": None, "error": error},
        error=error,
    )
    applied = await ops._apply(tx, change)
    if isinstance(applied, Refused):
        raise applied.error
    return applied[0]


async def stop_steps(ops: Host, tx: Tx, pipeline: Task, ids: list[str]) -> None:
    """Cancel the pipeline's own steps that wait (PENDING, RETRYING, NEEDS_REVIEW) and ask
    the running ones to stop (cancel_requested), as a cancel of each would. Each is read
    locked (the pipeline's row is locked already) and decided from that row: a worker that
    claimed or released a step meanwhile is seen, never refused."""
    now = ops.clock()
    for step in await _locked_steps(ops, tx, ids):
        if step.pipeline_id != pipeline.id or step.status in FINAL:
            continue
        if step.status in RUNNING:
            await tx.one(ops.q.request_cancel, (now, now, step.id))
            continue
        change = Change(
            task_id=step.id,
            expect_status=step.status,
            expect_epoch=None,
            steps=((Event.CANCEL, Status.CANCELLED),),
        )
        await ops._apply(tx, change)  # no pipeline_id: it does not advance it


async def _locked(ops: Host, tx: Tx, pipeline_id: str) -> Task:
    if await tx.one(ops.q.lock_task, (pipeline_id,)) is None:
        raise NotFound(f"no task {pipeline_id!r}")
    row = await tx.one(ops.q.get_task, (pipeline_id,))
    assert row is not None
    return task_from_row(row)


async def cancel(ops: Host, tx: Tx, pipeline_id: str) -> Task | Refused:
    """Cancel a running pipeline: its waiting steps are cancelled, its running ones asked
    to stop, and it ends CANCELLED, in one transaction."""
    pipeline = await _locked(ops, tx, pipeline_id)
    if pipeline.status is not Status.GENERATING:
        return Refused(Conflict(f"pipeline {pipeline_id} is {pipeline.status}, not running"))
    mapping = step_map(pipeline)
    fields = {"result": _result(mapping, taken_map(pipeline))}
    return await _end(ops, tx, pipeline, Status.CANCELLED, fields, None, mapping)


async def retry(ops: Host, tx: Tx, pipeline_id: str, fields: dict[str, Any]) -> Task | Refused:
    """Run a final FAILED, TIMEOUT or CANCELLED pipeline again: each of its own steps that
    did not succeed is retried (due now, one more attempt), the steps that did keep their
    outputs, and it runs again (RETRYING, then GENERATING) in one transaction."""
    pipeline = await _locked(ops, tx, pipeline_id)
    if pipeline.status not in ENDED_UNSUCCESSFULLY:
        return Refused(Conflict(f"pipeline {pipeline_id} is {pipeline.status}"))
    now = ops.clock()
    for step in await _locked_steps(ops, tx, list(step_map(pipeline).values())):
        # Its cancel was the pipeline's: a step still running goes on, and so does one an
        # expire sent back to the queue after the stop was asked (the supervisor decided
        # on an earlier read): claimed still asked to stop, it would stop at once, and
        # that stop would end the retried pipeline CANCELLED.
        if step.pipeline_id == pipeline.id and step.status not in FINAL and step.cancel_requested:
            await tx.run(ops.q.keep_running, (now, step.id))
        if step.pipeline_id == pipeline.id and step.status in ENDED_UNSUCCESSFULLY:
            await _retry_step(ops, tx, step)
    events = (Event.RETRY, Event.RUN_STEPS)
    return await start(ops, tx, pipeline, events, {**fields, "finished_at": None})


async def _retry_step(ops: Host, tx: Tx, step: Task) -> None:
    """A manual retry of one step: due now, one more attempt (as ``App.retry``)."""
    now = ops.clock()
    again = {
        "max_attempts": max(step.max_attempts, step.attempt) + 1,
        "finished_at": None,
        "next_retry_at": now,
        "ready_at": now,
        "cancel_requested": False,
        "cancel_requested_at": None,
        "deadline_at": max(step.deadline_at, now + step.deadline_s),
    }
    change = Change(
        task_id=step.id,
        expect_status=step.status,
        expect_epoch=None,
        steps=((Event.RETRY, Status.RETRYING),),
        fields=again,
    )
    await ops._apply(tx, change)  # no pipeline_id: it does not advance it; read locked


async def steps_of(ops: Host, tx: Tx, pipeline: Task) -> dict[str, Task]:
    """The tasks of a pipeline's map of steps, by ``name/copy``."""
    mapping = step_map(pipeline)
    tasks = await _steps(ops, tx, list(mapping.values()))
    return {key: tasks[task_id] for key, task_id in mapping.items() if task_id in tasks}
