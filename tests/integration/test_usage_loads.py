"""A worker's attempts in the GPU-second ledger and the event log: the model loads it timed,
the pool its kind takes, itself as the worker, and the seconds of the event log, on each
store."""

from __future__ import annotations

import asyncio
from typing import Any

import kiln
from kiln.app import running
from kiln.config import Settings
from kiln.states import Event, Status
from kiln.worker import Context


class SlowLoader:
    """Loads the model its params name once per process (50 ms), then keeps it."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()

    async def __call__(self, ctx: Context, params: dict[str, Any]) -> None:
        model = str(params["model"])
        if model not in self.loaded:
            async with ctx.loading_model(model):
                await asyncio.sleep(0.05)
                self.loaded.add(model)
        await asyncio.sleep(0.01)


async def test_a_workers_rows_carry_its_load_times_its_pool_and_its_id(
    each_store: Settings,
) -> None:
    app = kiln.App(settings=each_store.with_(pools={"gpu": 1}))
    app.task("test.load", resources={"gpu": 1}, model="model")(SlowLoader())
    async with app:
        # Given two tasks on model a: the first loads it, the second finds it loaded
        ids = [(await app.submit("test.load", {"model": "a", "n": n})).task.id for n in range(2)]
        worker = app.worker(concurrency=1, idle_poll_s=(0.01, 0.05))
        # When a worker runs them
        async with running(worker.run()):
            done = [await app.wait(task_id, timeout_s=30) for task_id in ids]
        assert [t.status for t in done] == [Status.SUCCESS, Status.SUCCESS]
        rows = [(await app.engine.store.usage.of_task(task_id))[0] for task_id in ids]
        events = [await app.engine.store.events(task_id=task_id) for task_id in ids]
    # Then the first attempt's row holds the load the worker timed, the second none
    timed = worker.model_loads.by_model["a"]
    assert timed.count == 1 and rows[0].loading_s == timed.total_s and rows[1].loading_s == 0
    assert rows[0].loading_s <= rows[0].generating_s
    # And each names the model, the pool its kind takes and the worker, with the log's seconds
    for row, log in zip(rows, events, strict=True):
        assert (row.model, row.pool, row.worker, row.outcome) == ("a", "gpu", worker.worker_id,
                                                                  "success")  # fmt: skip
        generating = [e.dwell_s for e in log if e.from_status is Status.GENERATING]
        waiting = [e.dwell_s for e in log if e.from_status is Status.WAITING_FOR_RESOURCE]
        assert [row.generating_s] == generating and [row.waiting_s] == waiting
    # And the event that left GENERATING after the load records the load's own seconds (in
    # the API's events too); no other event carries any
    loaded = [(e.event, e.loading_s) for e in events[0] if e.loading_s is not None]
    assert loaded == [(Event.GENERATED, timed.total_s)]
    assert events[0][-2].to_json()["loading_s"] == round(timed.total_s, 3)
    assert all(e.loading_s is None and "loading_s" not in e.to_json() for e in events[1])


async def test_an_attempt_with_nothing_to_upload_logs_generated_and_uploaded_in_one_write(
    each_store: Settings,
) -> None:
    app = kiln.App(settings=each_store.with_(pools={"gpu": 1}))

    @app.task("test.nothing", resources={"gpu": 1})
    async def nothing(ctx: Context, params: dict[str, Any]) -> None:
        await asyncio.sleep(0.01)

    async with app:
        # Given a task whose handler returns no outputs (and a kind with no review)
        task_id = (await app.submit("test.nothing", {"n": 1})).task.id
        worker = app.worker(concurrency=1, idle_poll_s=(0.01, 0.05))
        # When a worker runs it
        async with running(worker.run()):
            done = await app.wait(task_id, timeout_s=30)
        store = app.engine.store
        log = await store.events(task_id=task_id)
        (row,) = await store.usage.of_task(task_id)
    # Then it succeeded with no outputs, and its log still holds both steps, in order and
    # numbered, written by one change: the same instant, no time spent in UPLOADING
    assert done.status is Status.SUCCESS and done.result == {"outputs": []}
    generated, uploaded = log[-2:]
    assert [(e.event, e.from_status, e.status, e.final) for e in (generated, uploaded)] == [
        (Event.GENERATED, Status.GENERATING, Status.UPLOADING, False),
        (Event.UPLOADED, Status.UPLOADING, Status.SUCCESS, True),
    ]
    assert [e.id for e in log] == [f"{task_id}:{n}" for n in range(1, len(log) + 1)]
    assert generated.seq < uploaded.seq and generated.at == uploaded.at
    assert uploaded.dwell_s == 0.0 and generated.dwell_s is not None and generated.dwell_s > 0
    # And the attempt's row of the ledger ends it as a success, with the log's seconds
    assert (row.outcome, row.pool, row.worker) == ("success", "gpu", worker.worker_id)
    assert row.generating_s == generated.dwell_s
