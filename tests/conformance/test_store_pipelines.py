"""Pipelines on both stores (docs/pipelines.md): the pipeline and its first steps are one
submit transaction; a step's SUCCESS makes the next steps (or ends the pipeline) in its
own transaction; the failure policy, cancel, retry, content dedup per step, fan-out and
fan-in, and retention that keeps a pipeline's steps with it."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import pydantic
import pytest

import kiln
from kiln.config import Settings
from kiln.engine import rerun_fields
from kiln.errors import InvalidRequest, StaleDecision
from kiln.models import JSON, Task
from kiln.scheduler import tick_task
from kiln.states import Event, Status
from kiln.store import ScheduleRecord, Store, Tick
from kiln.store import pipelines as store_pipelines

from .backends import Row

pytestmark = pytest.mark.usefixtures("queue_counts_checked")

GEN, USE, SHEET = "pl.generate", "pl.use", "pl.sheet"


class GenParams(pydantic.BaseModel):
    prompt: str
    seed: int = 0
    fail: bool = False


class UseParams(pydantic.BaseModel):
    size: int = 64


async def _handler(ctx: Any, params: Any) -> None:
    return None


@pytest.fixture
def app(store: Store, settings: Settings) -> kiln.App:
    app = kiln.App(store=store, settings=settings, rng=random.Random(7))
    app.task(GEN, params=GenParams)(_handler)
    app.task(USE, params=UseParams, inputs=("image",))(_handler)
    app.task(SHEET, inputs=("images",))(_handler)
    return app


def chain(prompt: str = "a fox", thumb: int = 32, **extra: Any) -> JSON:
    """generate -> upscale -> thumbnail, each reading the previous step's out.png."""
    return {
        "steps": [
            {"name": "generate", "kind": GEN, "params": {"prompt": prompt, **extra}},
            {"name": "upscale", "kind": USE, "params": {"size": 128},
             "inputs": {"image": "step:generate/out.png"}},
            {"name": "thumb", "kind": USE, "params": {"size": thumb},
             "inputs": {"image": "step:upscale/out.png"}},
        ]
    }  # fmt: skip


def output(task: Task) -> JSON:
    data = task.id.encode()
    return {"name": "out.png", "key": f"tasks/{task.id}/{task.attempt}-{task.epoch}/out.png",
            "content_type": "image/png", "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


async def claim(app: kiln.App, kind: str) -> Task:
    claimed = await app.engine.store.claim(worker_id="w-1", kinds=[kind], limit=1, lease_ttl_s=30.0)
    assert len(claimed) == 1, f"nothing of {kind} to claim"
    return claimed[0]


async def succeed(app: kiln.App, task: Task) -> Task:
    """Move a claimed step to SUCCESS as a worker does (fenced), with one output."""
    task = await app.apply(task, Event.ACQUIRE, fenced=True)
    task = await app.apply(task, Event.GENERATED, fenced=True)
    result = {"outputs": [output(task)]}
    return await app.apply(task, Event.UPLOADED, Status.SUCCESS, fenced=True,
                           fields={"result": result, "error": None})  # fmt: skip


async def fail(app: kiln.App, task: Task) -> Task:
    error = {"code": "boom", "message": "broken", "retryable": False}
    return await app.apply(task, Event.FAIL, fenced=True, retry_error=error)


async def submit(app: kiln.App, params: JSON, **kw: Any) -> Task:
    return (await app.submit("pipeline", params, tenant="acme", **kw)).task


async def steps(app: kiln.App, pipeline_id: str) -> dict[str, Task]:
    pipeline = await app.get(pipeline_id)
    return await app.pipeline_steps(pipeline)


def counted(truth: Callable[..., list[Row]]) -> dict[str, int]:
    """The tasks by status as the counts say (their shards summed), zeros left out."""
    rows = truth("SELECT status, SUM(n) FROM task_counts GROUP BY status")
    return {str(status): int(n) for status, n in rows if int(n) != 0}


def successor_missing(truth: Callable[..., list[Row]]) -> list[Row]:
    """Steps that succeeded in a running pipeline whose successor in the chain does not
    exist: a state no commit may leave (the successor is made in the same transaction)."""
    return truth(
        "SELECT s.id, s.step FROM tasks s JOIN tasks p ON p.id = s.pipeline_id"
        " WHERE s.status = 'SUCCESS' AND s.step IN ('generate', 'upscale')"
        " AND p.status = 'GENERATING' AND NOT EXISTS (SELECT 1 FROM tasks n"
        " WHERE n.pipeline_id = s.pipeline_id AND n.step ="
        " CASE s.step WHEN 'generate' THEN 'upscale' ELSE 'thumb' END)"
    )


async def test_submit_creates_the_pipeline_and_its_first_steps_together(
    app: kiln.App, truth: Callable[..., list[Row]]
) -> None:
    # When a three-step pipeline is submitted
    pipeline = await submit(app, chain())
    # Then it runs at once (GENERATING, no lease, never due), with only its first step made
    assert pipeline.status is Status.GENERATING and pipeline.lease_expires_at is None
    assert pipeline.deadline_at == store_pipelines.NO_DEADLINE
    made = await steps(app, pipeline.id)
    assert list(made) == ["generate/0"]
    first = made["generate/0"]
    assert (first.status, first.pipeline_id, first.step, first.step_copy) == (
        Status.PENDING, pipeline.id, "generate", 0,
    )  # fmt: skip
    # And its log is submit then run_steps, written with the step's submit
    events = [(e.event, e.status) for e in await app.engine.store.events(task_id=pipeline.id)]
    assert events == [(Event.SUBMIT, Status.PENDING), (Event.RUN_STEPS, Status.GENERATING)]
    assert truth("SELECT COUNT(*) FROM tasks")[0][0] == 2
    # And no worker claims the pipeline itself
    assert (
        await app.engine.store.claim(worker_id="w", kinds=["pipeline"], limit=5, lease_ttl_s=9)
        == []
    )


async def test_the_supervisor_never_finds_a_running_pipeline_due(app: kiln.App, clock: Any) -> None:
    # Given a running pipeline, long past its submission's deadline_s
    pipeline = await submit(app, chain(), deadline_s=60)
    clock.advance(10_000)
    # Then the sweep's read does not hold it (its step, PENDING, is due for its deadline)
    due = await app.engine.store.due(limit=100, cancel_grace_s=1)
    swept = [t.id for group in (due.deadline_passed, due.lease_expired, due.state_expired,
                                due.cancel_overdue) for t in group]  # fmt: skip
    assert pipeline.id not in swept and len(swept) == 1
    # And it is no ghost, and autoscaling sees no running work of kind pipeline
    assert await app.engine.store.count_ghosts(older_than_s=0) == 0
    load = await app.engine.store.load.read()
    assert [kind for kind, _, _ in load.claimed] == []
    assert [kind for kind, _, _ in load.ready] == [GEN]
    assert (await app.get(pipeline.id)).status is Status.GENERATING


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"steps": [{"name": "a", "kind": "nope", "params": {}}]}, "unknown kind"),
        ({"steps": [{"name": "a", "kind": GEN, "params": {"prompt": 3}}]}, "invalid pipeline step"),
        ({"steps": [{"name": "a", "kind": USE, "params": {},
                     "inputs": {"image": "step:b/out.png"}},
                    {"name": "b", "kind": GEN, "params": {"prompt": "x"}}]}, "not an earlier"),
        ({"steps": [{"name": "a", "kind": USE, "params": {},
                     "inputs": {"image": "step:a/out.png"}}]}, "not an earlier"),
        ({"steps": [{"name": "a", "kind": GEN, "params": {"prompt": "x"}, "repeat": 101}]},
         "repeat"),
        ({"steps": [{"name": "a", "kind": GEN, "params": {"prompt": "x"}},
                    {"name": "a", "kind": GEN, "params": {"prompt": "y"}}]}, "two steps"),
        ({"steps": [{"name": "a", "kind": USE, "params": {}}]}, "takes the inputs"),
        ({"steps": []}, "steps must be"),
        ({"steps": [{"name": "a", "kind": GEN, "params": {"prompt": "x"}}],
          "on_failure": "shrug"}, "on_failure"),
    ],
)  # fmt: skip
async def test_a_bad_pipeline_is_refused_and_nothing_is_stored(
    app: kiln.App, truth: Callable[..., list[Row]], params: JSON, why: str
) -> None:
    with pytest.raises(InvalidRequest, match=why):
        await submit(app, params)
    assert truth("SELECT COUNT(*) FROM tasks")[0][0] == 0


async def test_each_success_makes_the_next_step_in_its_own_transaction(
    app: kiln.App, truth: Callable[..., list[Row]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = await submit(app, chain())
    generate = await claim(app, GEN)
    # Given the step that makes the next one breaks after the step's SUCCESS was written
    real = store_pipelines._create

    async def broken(*args: Any) -> Task:
        raise RuntimeError("crash between the step and its successor")

    monkeypatch.setattr(store_pipelines, "_create", broken)
    with pytest.raises(RuntimeError):
        await succeed(app, generate)
    # Then the step's SUCCESS rolled back with it: it is still UPLOADING, nothing lost
    assert (await app.get(generate.id)).status is Status.UPLOADING
    assert successor_missing(truth) == []
    monkeypatch.setattr(store_pipelines, "_create", real)
    # When the steps succeed one by one
    uploading = await app.get(generate.id)
    done = await app.apply(uploading, Event.UPLOADED, Status.SUCCESS, fenced=True,
                           fields={"result": {"outputs": [output(uploading)]}})  # fmt: skip
    assert successor_missing(truth) == []
    upscale = await claim(app, USE)
    # Then the next step reads the earlier step's stored object by its key (no copy)
    assert upscale.step == "upscale"
    assert upscale.inputs == [{**output(done), "name": "image"}]
    upscaled = await succeed(app, upscale)
    assert successor_missing(truth) == []
    assert (await app.get(pipeline.id)).progress_step == 2
    thumb = await claim(app, USE)
    assert thumb.inputs[0]["key"] == output(upscaled)["key"]
    await succeed(app, thumb)
    # And the last step's SUCCESS ends the pipeline SUCCESS in the same transaction
    ended = await app.get(pipeline.id)
    assert ended.status is Status.SUCCESS and ended.progress_step == 3
    log = [e.event for e in await app.engine.store.events(task_id=pipeline.id)]
    assert log == [Event.SUBMIT, Event.RUN_STEPS, Event.STEPS_DONE]
    # And no step ever left the input uploads' table (references are not uploads)
    assert truth("SELECT COUNT(*) FROM task_inputs")[0][0] == 0


async def test_a_failed_step_stops_the_pipeline_and_cancels_what_waits(app: kiln.App) -> None:
    # Given a fan-out of two and a step after each copy
    params = {"steps": [
        {"name": "generate", "kind": GEN, "params": {"prompt": "x"}, "repeat": 2},
        {"name": "upscale", "kind": USE, "params": {}, "repeat": 2,
         "inputs": {"image": "step:generate/out.png"}},
    ]}  # fmt: skip
    pipeline = await submit(app, params)
    first = await claim(app, GEN)
    # When one copy fails for good
    await fail(app, first)
    # Then the pipeline is FAILED, naming the step, and the other copy is cancelled
    ended = await app.get(pipeline.id)
    assert ended.status is Status.FAILED and ended.error is not None
    assert ended.error["code"] == "step_failed" and "boom" in ended.error["message"]
    made = await steps(app, pipeline.id)
    assert sorted(t.status for t in made.values()) == ["CANCELLED", "FAILED"]


async def test_continue_lets_independent_steps_finish_before_failing(app: kiln.App) -> None:
    params = {"on_failure": "continue", "steps": [
        {"name": "bad", "kind": GEN, "params": {"prompt": "bad"}},
        {"name": "good", "kind": GEN, "params": {"prompt": "good"}},
        {"name": "after", "kind": USE, "params": {}, "inputs": {"image": "step:bad/out.png"}},
    ]}  # fmt: skip
    pipeline = await submit(app, params)
    one, two = await claim(app, GEN), await claim(app, GEN)
    bad, good = (one, two) if one.step == "bad" else (two, one)
    await fail(app, bad)
    # Then the pipeline still runs while the independent step does
    assert (await app.get(pipeline.id)).status is Status.GENERATING
    await succeed(app, good)
    # And ends FAILED once nothing else can run; the step after the failure is never made
    assert (await app.get(pipeline.id)).status is Status.FAILED
    assert sorted(await steps(app, pipeline.id)) == ["bad/0", "good/0"]


async def test_cancel_stops_running_and_pending_steps_and_retry_reruns_only_the_rest(
    app: kiln.App,
) -> None:
    params = {"steps": [
        {"name": "generate", "kind": GEN, "params": {"prompt": "x"}, "repeat": 3},
    ]}  # fmt: skip
    pipeline = await submit(app, params)
    running = await claim(app, GEN)
    done = await succeed(app, await claim(app, GEN))
    # When the pipeline is cancelled with one copy running, one pending and one done
    cancelled = await app.cancel(pipeline.id, "acme")
    # Then it is CANCELLED at once, the pending copy is cancelled, the running one asked
    assert cancelled.status is Status.CANCELLED
    made = await steps(app, pipeline.id)
    statuses = {t.id: t for t in made.values()}
    assert statuses[done.id].status is Status.SUCCESS
    assert statuses[running.id].cancel_requested
    pending = [t for t in made.values() if t.id not in (done.id, running.id)]
    assert [t.status for t in pending] == [Status.CANCELLED]
    # And the running copy stops later without moving the pipeline again
    running = await app.get(running.id)
    await app.apply(running, Event.STOPPED, fenced=True)
    assert (await app.get(pipeline.id)).status is Status.CANCELLED
    # When the pipeline is retried
    retried = await app.retry(pipeline.id, "acme")
    # Then it runs again, only the copies that did not succeed are due again
    assert retried.status is Status.GENERATING
    made = await steps(app, pipeline.id)
    assert made[done.step + "/" + str(done.step_copy)].status is Status.SUCCESS
    assert sorted(t.status for t in made.values()) == ["RETRYING", "RETRYING", "SUCCESS"]
    for _ in range(2):
        await succeed(app, await claim(app, GEN))
    assert (await app.get(pipeline.id)).status is Status.SUCCESS
    # And the copy that had succeeded ran once
    assert (await app.get(done.id)).attempt == 1
    log = [e.event for e in await app.engine.store.events(task_id=pipeline.id)]
    assert log == [Event.SUBMIT, Event.RUN_STEPS, Event.STEPS_CANCELLED, Event.RETRY,
                   Event.RUN_STEPS, Event.STEPS_DONE]  # fmt: skip


async def test_a_step_whose_content_is_done_counts_as_done_at_once(app: kiln.App) -> None:
    # Given a pipeline that ran to the end
    first = await submit(app, chain())
    for kind in (GEN, USE, USE):
        await succeed(app, await claim(app, kind))
    assert (await app.get(first.id)).status is Status.SUCCESS
    # When another pipeline starts with the same first step and then differs
    second = await submit(app, chain(thumb=16))
    # Then its first step is the task that already did it (nothing to run), and its
    # second step, reading the same object, is the earlier upscale too: only the last runs
    made = await steps(app, second.id)
    earlier = await steps(app, first.id)
    assert made["generate/0"].id == earlier["generate/0"].id
    assert made["upscale/0"].id == earlier["upscale/0"].id
    assert made["thumb/0"].id != earlier["thumb/0"].id
    assert (await app.get(second.id)).progress_step == 2
    last = await claim(app, USE)
    assert last.id == made["thumb/0"].id
    await succeed(app, last)
    assert (await app.get(second.id)).status is Status.SUCCESS


async def test_fan_out_of_ten_then_fan_in(app: kiln.App) -> None:
    params = {"steps": [
        {"name": "generate", "kind": GEN, "params": {"prompt": "x", "seed": 40}, "repeat": 10},
        {"name": "sheet", "kind": SHEET, "params": {}, "inputs": {"images": "step:generate/*"}},
    ]}  # fmt: skip
    pipeline = await submit(app, params)
    made = await steps(app, pipeline.id)
    # Then ten copies exist at once, each with its own seed
    assert sorted(t.params["seed"] for t in made.values()) == list(range(40, 50))
    outputs = {}
    for _ in range(10):
        task = await succeed(app, await claim(app, GEN))
        outputs[task.step_copy] = task.result["outputs"][0]["key"] if task.result else None
        # And the fan-in step waits for all of them
        assert ("sheet/0" in await steps(app, pipeline.id)) == (len(outputs) == 10)
    sheet = await claim(app, SHEET)
    # And it reads every copy's output, by key, in copy order
    assert [i["key"] for i in sheet.inputs] == [outputs[i] for i in range(10)]
    await succeed(app, sheet)
    assert (await app.get(pipeline.id)).status is Status.SUCCESS


async def test_retention_keeps_a_pipelines_steps_with_it(
    app: kiln.App, clock: Any, truth: Callable[..., list[Row]]
) -> None:
    pipeline = await submit(app, chain())
    generate = await succeed(app, await claim(app, GEN))
    clock.advance(100)
    # A step that finished long ago is kept while its pipeline is
    assert await app.engine.store.purge(finished_before=clock()) == []
    await succeed(app, await claim(app, USE))
    await succeed(app, await claim(app, USE))
    clock.advance(100)
    # When the finished pipeline is purged, its steps go with it, in one transaction
    purged = await app.engine.store.purge(finished_before=clock())
    assert {t.id for t in purged} >= {pipeline.id, generate.id}
    assert len(purged) == 4
    assert truth("SELECT COUNT(*) FROM tasks")[0][0] == 0


async def test_a_rerun_of_a_pipeline_plans_its_steps_again(app: kiln.App) -> None:
    # Given a pipeline (its stored params show each step's copies and timeouts)
    first = await submit(app, chain())
    assert "copies" in first.params["steps"][0]
    # When it is run again as a new variation
    again = (await app.rerun(first.id, dedup=False)).task
    # Then a new pipeline runs the same steps, from its first
    assert again.id != first.id and again.status is Status.GENERATING
    assert again.params == first.params
    assert list(await steps(app, again.id)) == ["generate/0"]


async def test_a_schedule_tick_starts_a_pipeline_with_its_first_steps(app: kiln.App) -> None:
    # Given a schedule whose ticks submit a pipeline, and the leadership
    now = app.engine.store.clock()
    planned = app.kind("pipeline").validate(chain())
    submission = {"kind": "pipeline", "params": planned, "priority": 0, "max_attempts": 3,
                  "deadline_s": 3600.0, "metadata": {}}  # fmt: skip
    schedule = await app.engine.store.schedules.create(ScheduleRecord(
        id="sch_pl", tenant="acme", cron="* * * * * *", timezone="UTC", submission=submission,
        overlap="queue", missed="fire_once", paused=False, next_at=now,
    ))  # fmt: skip
    token = await app.engine.store.lead("supervisor", "s1", 30)
    assert token is not None
    # When its tick fires
    tick = Tick(schedule.id, now, now + 1, tick_task(schedule, now), now)
    done = await app.engine.store.schedules.handle_tick(tick, token)
    # Then the pipeline runs with its first step made in that transaction
    assert done is not None and done.task is not None
    assert done.task.kind == "pipeline" and done.task.status is Status.GENERATING
    assert list(await steps(app, done.task.id)) == ["generate/0"]


async def test_bulk_cancel_and_retry_treat_a_pipeline_as_its_own_actions_do(app: kiln.App) -> None:
    from kiln.bulk_actions import FilterIn, bulk_action, filter_of

    def found(action: str, **fields: Any) -> Any:
        return filter_of(action, FilterIn(**fields), scope="acme", everything=False,
                         now=app.now())  # fmt: skip

    params = {"steps": [
        {"name": "generate", "kind": GEN, "params": {"prompt": "bulk"}, "repeat": 3},
    ]}  # fmt: skip
    pipeline = await submit(app, params)
    running = await claim(app, GEN)
    done = await succeed(app, await claim(app, GEN))
    # When a bulk cancel names the running pipeline by kind
    page = await bulk_action(app.engine, "cancel", found("cancel", kind=["pipeline"]),
                             dry_run=False)  # fmt: skip
    # Then it is cancelled as POST /v1/tasks/{id}/cancel does it: with its steps, not
    # merely asked to stop (no worker would ever stop it)
    assert (page["cancelled"], page["cancel_requested"], page["skipped"]) == (1, 0, 0)
    cancelled = await app.get(pipeline.id)
    assert cancelled.status is Status.CANCELLED and not cancelled.cancel_requested
    made = await steps(app, pipeline.id)
    assert (await app.get(running.id)).cancel_requested
    assert sorted(t.status for t in made.values()) == ["CANCELLED", "SUCCESS",
                                                       "WAITING_FOR_RESOURCE"]  # fmt: skip
    await app.apply(await app.get(running.id), Event.STOPPED, fenced=True)
    # When a bulk retry names it: only the steps that did not succeed run again
    page = await bulk_action(app.engine, "retry", found("retry", kind=["pipeline"]),
                             dry_run=False)  # fmt: skip
    assert (page["retried"], page["skipped"]) == (1, 0)
    assert (await app.get(pipeline.id)).status is Status.GENERATING
    made = await steps(app, pipeline.id)
    assert sorted(t.status for t in made.values()) == ["RETRYING", "RETRYING", "SUCCESS"]
    # And run again, the same bulk retry finds nothing to do
    again = await bulk_action(app.engine, "retry", found("retry", kind=["pipeline"]),
                              dry_run=False)  # fmt: skip
    assert (again["matched"], again["retried"]) == (0, 0)
    # When the pending steps are cancelled by a bulk cancel of their kind
    pending = found("cancel", kind=[GEN], status=["RETRYING"])
    page = await bulk_action(app.engine, "cancel", pending, dry_run=False)
    # Then the pipeline follows its first cancelled step, as for a single cancel of one:
    # it ends CANCELLED and cancels its other pending step in that transaction, which the
    # page then finds changed (skipped)
    assert (page["matched"], page["cancelled"], page["skipped"]) == (2, 1, 1)
    ended = await app.get(pipeline.id)
    assert ended.status is Status.CANCELLED
    made = await steps(app, pipeline.id)
    assert sorted(t.status for t in made.values()) == ["CANCELLED", "CANCELLED", "SUCCESS"]
    assert (await app.get(done.id)).attempt == 1


async def test_a_retry_takes_back_the_stop_asked_of_a_step_an_expire_sent_back_to_the_queue(
    app: kiln.App, clock: Any
) -> None:
    # Given a running step whose lease lapsed: the supervisor reads it as it sweeps
    pipeline = await submit(app, chain("a wren"))
    step = await app.apply(await claim(app, GEN), Event.ACQUIRE, fenced=True)
    stale = await app.get(step.id)
    # When its pipeline is cancelled (the step asked to stop), the sweep's expire decided
    # on its earlier read (a retry planned) is refused: the step was asked to stop since
    await app.cancel(pipeline.id, "acme")
    lapsed = {"code": "lease_expired", "message": "lapsed", "retryable": True}
    with pytest.raises(StaleDecision):
        await app.apply(stale, Event.EXPIRE, bump_epoch=True, retry_error=lapsed)
    # And the next sweep, reading it again, ends the attempt without a retry
    ended = await app.apply(await app.get(step.id), Event.EXPIRE, bump_epoch=True,
                            retry_error=lapsed)  # fmt: skip
    assert ended.final and ended.cancel_requested
    # When the pipeline is retried
    assert (await app.retry(pipeline.id, "acme")).status is Status.GENERATING
    # Then the step runs again, no longer asked to stop: the worker that claims it runs it
    # (it would stop one asked to stop, and the stop would end the pipeline CANCELLED)
    clock.advance(60)
    again = await claim(app, GEN)
    assert again.id == step.id and not again.cancel_requested
    await succeed(app, again)
    made = await steps(app, pipeline.id)
    assert made["upscale/0"].status is Status.PENDING
    assert (await app.get(pipeline.id)).status is Status.GENERATING


@pytest.mark.postgres_only
async def test_a_steps_failure_commits_when_a_sibling_is_claimed_meanwhile(
    app: kiln.App, backend: Any, tmp_path: Any, clock: Any
) -> None:
    # Given a fan-out of three, one copy claimed
    params = {"steps": [{"name": "g", "kind": GEN, "params": {"prompt": "fan", "seed": 1},
                         "repeat": 3}]}  # fmt: skip
    pipeline = await submit(app, params)
    first = await claim(app, GEN)
    other = backend.open(tmp_path / "store", clock)  # a worker's process on the same database
    await other.last_seq()
    real = store_pipelines._steps
    taken: list[list[Task]] = []

    async def racing(ops: Any, tx: Any, ids: list[str]) -> Any:
        found = await real(ops, tx, ids)
        if not taken:  # right after the pipeline read its steps, a PENDING sibling is claimed
            taken.append(await other.claim(worker_id="w-2", kinds=[GEN], limit=1, lease_ttl_s=30))
        return found

    store_pipelines._steps = racing  # type: ignore[assignment]
    try:
        # When the claimed copy fails for good
        failed = await fail(app, first)
    finally:
        store_pipelines._steps = real  # type: ignore[assignment]
        await other.close()
    # Then its failure commits (it is not refused for the sibling's change), the pipeline
    # ends FAILED, the sibling claimed meanwhile is asked to stop, the last one cancelled
    assert len(taken[0]) == 1
    assert failed.status is Status.FAILED
    assert (await app.get(pipeline.id)).status is Status.FAILED
    sibling = await app.get(taken[0][0].id)
    assert sibling.status is Status.WAITING_FOR_RESOURCE and sibling.cancel_requested
    made = await steps(app, pipeline.id)
    assert sorted(t.status for t in made.values()) == [
        "CANCELLED", "FAILED", "WAITING_FOR_RESOURCE",
    ]  # fmt: skip


@pytest.mark.postgres_only
async def test_many_steps_ending_together_with_a_cancel_never_deadlock(
    app: kiln.App, backend: Any, truth: Callable[..., list[Row]]
) -> None:
    import asyncio

    # Given fan-outs of eight copies, every copy running
    def fan_out(prompt: str) -> JSON:
        return {"steps": [{"name": "g", "kind": GEN, "params": {"prompt": prompt}, "repeat": 8}]}

    pipelines = [await submit(app, fan_out(prompt)) for prompt in ("many", "more")]
    running = await app.engine.store.claim(worker_id="w", kinds=[GEN], limit=16, lease_ttl_s=30)
    assert len(running) == 16
    running = [await app.apply(t, Event.ACQUIRE, fenced=True) for t in running]
    running = [await app.apply(t, Event.GENERATED, fenced=True) for t in running]
    before = truth("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")

    async def end(index: int, task: Task) -> Any:
        if task.pipeline_id == pipelines[0].id and index % 3 == 1:  # the other is cancelled
            return await fail(app, task)
        result = {"outputs": [output(task)]}
        return await app.apply(task, Event.UPLOADED, Status.SUCCESS, fenced=True,
                               fields={"result": result, "error": None})  # fmt: skip

    # When they all end at once, from several tasks, as one pipeline is cancelled (one of
    # its copies still runs: the cancel finds it running)
    last = [t for t in running if t.pipeline_id == pipelines[1].id][-1]
    ended = await asyncio.gather(
        *(end(i, t) for i, t in enumerate(running) if t is not last),
        app.cancel(pipelines[1].id, "acme"),
        return_exceptions=True,
    )
    # Then every change commits: no deadlock surfaced, none even retried
    assert [e for e in ended if isinstance(e, BaseException)] == []
    after = truth("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    assert after == before
    assert (await app.get(last.id)).cancel_requested
    await app.apply(last, Event.STOPPED, fenced=True)
    # And each pipeline ended, each step with it
    for pipeline in pipelines:
        assert (await app.get(pipeline.id)).final
        assert all(t.final for t in (await steps(app, pipeline.id)).values())


async def test_a_step_taken_from_another_task_is_done_whatever_that_task_does_later(
    app: kiln.App,
) -> None:
    from kiln.reconcile import ResultLostPolicy, lose_result

    # Given a standalone task that succeeded with the content of a pipeline's first step
    await app.submit(GEN, {"prompt": "same"}, tenant="acme")
    other = await succeed(app, await claim(app, GEN))
    params = {"steps": [
        {"name": "a", "kind": GEN, "params": {"prompt": "same"}},
        {"name": "b", "kind": USE, "params": {"size": 64}, "inputs": {"image": "step:a/out.png"}},
    ]}  # fmt: skip
    pipeline = await submit(app, params)
    made = await steps(app, pipeline.id)
    # Then the step is that task, and its successor reads the outputs it had when taken
    assert made["a/0"].id == other.id
    kept = (await app.get(pipeline.id)).result or {}
    assert kept["taken"]["a/0"]["outputs"] == (other.result or {})["outputs"]
    assert [i["key"] for i in made["b/0"].inputs] == [output(other)["key"]]
    # When that task's result is lost and it runs again, while the successor succeeds
    await lose_result(app, await app.get(other.id), [], ResultLostPolicy.RERUN)
    assert (await app.get(other.id)).status is Status.RETRYING
    await succeed(app, await claim(app, USE))
    # Then the pipeline does not wait on it: it ends SUCCESS (it stayed GENERATING forever)
    assert (await app.get(pipeline.id)).status is Status.SUCCESS
    await succeed(app, await claim(app, GEN))
    assert (await app.get(pipeline.id)).status is Status.SUCCESS


async def test_a_pipeline_is_not_purged_while_one_of_its_steps_still_runs(
    app: kiln.App, clock: Any, truth: Callable[..., list[Row]]
) -> None:
    # Given a cancelled pipeline whose step still runs (asked to stop)
    pipeline = await submit(app, chain())
    running = await claim(app, GEN)
    await app.cancel(pipeline.id, "acme")
    clock.advance(10)
    # When a purge runs: nothing goes (the step would be orphaned, never purged)
    assert await app.engine.store.purge(finished_before=clock()) == []
    assert truth("SELECT COUNT(*) FROM tasks")[0][0] == 2
    # When the step stops, a later purge takes the pipeline with its step
    await app.apply(await app.get(running.id), Event.STOPPED, fenced=True)
    clock.advance(10)
    purged = await app.engine.store.purge(finished_before=clock())
    assert sorted(t.id for t in purged) == sorted([pipeline.id, running.id])
    assert truth("SELECT COUNT(*) FROM tasks")[0][0] == 0
    assert counted(truth) == {}


@pytest.mark.postgres_only
async def test_a_purge_keeps_a_pipeline_whose_step_a_user_retried_meanwhile(
    app: kiln.App,
    backend: Any,
    tmp_path: Any,
    clock: Any,
    truth: Callable[..., list[Row]],
    settings: Settings,
) -> None:
    from kiln.store.pgtx import PostgresTx

    # Given a FAILED pipeline with its FAILED step, long finished
    pipeline = await submit(app, chain())
    step = await fail(app, await claim(app, GEN))
    assert (await app.get(pipeline.id)).status is Status.FAILED
    clock.advance(10)
    other_store = backend.open(tmp_path / "store", clock)  # a server process elsewhere
    await other_store.last_seq()
    other = kiln.App(store=other_store, settings=settings, rng=random.Random(1))
    other.task(GEN, params=GenParams)(_handler)
    real = PostgresTx.all
    retried: list[Task] = []

    async def spying(self: Any, sql: str, args: Any = ()) -> Any:
        rows = await real(self, sql, args)
        if not retried and "finished_at <" in sql:  # right after the purge chose its tasks
            # another process retries the step alone, by its own compare-and-set (a retry
            # through the API goes through the pipeline, whose row the purge holds)
            read = await other.get(step.id)
            retried.append(await other.engine.apply(
                read, Event.RETRY, fields=rerun_fields(read, other.now())))  # fmt: skip
        return rows

    PostgresTx.all = spying  # type: ignore[method-assign]
    try:
        # When a purge runs as the step is retried
        purged = await app.engine.store.purge(finished_before=clock())
    finally:
        PostgresTx.all = real  # type: ignore[method-assign]
        await other_store.close()
    # Then the retried step and its pipeline stay, counted as they are
    assert retried[0].status is Status.RETRYING
    assert purged == []
    assert truth("SELECT status FROM tasks WHERE id = ?", step.id) == [("RETRYING",)]
    assert counted(truth) == {"FAILED": 1, "RETRYING": 1}


@pytest.mark.postgres_only
async def test_a_bulk_page_skips_a_pipeline_gone_meanwhile_and_acts_on_the_others(
    app: kiln.App, backend: Any, store: Store
) -> None:
    from kiln.store.bulk import CANCEL_PIPELINE, BulkFilter

    # Given two running pipelines
    gone = await submit(app, chain("gone"))
    kept = await submit(app, chain("kept"))

    def plan(task: Task) -> Any:
        if task.id == gone.id:  # purged by another process after the page read it
            backend.execute(store, "DELETE FROM tasks WHERE id = ?", (gone.id,))
        return CANCEL_PIPELINE

    # When a bulk cancel's page names both, the first deleted before its cancel
    found = BulkFilter(statuses=(Status.GENERATING,), kinds=("pipeline",), tenant="acme")
    page = await app.engine.store.bulk.page(found, None, 10, plan, rows=app.settings.bulk_page_rows)
    # Then only that one is skipped (NotFound in its savepoint); the other is cancelled
    assert (page.matched, page.skipped) == (2, 1)
    assert [t.id for t in page.changed] == [kept.id]
    assert (await app.get(kept.id)).status is Status.CANCELLED
    assert all(t.status is Status.CANCELLED for t in (await steps(app, kept.id)).values())


@pytest.mark.postgres_only
async def test_a_sibling_sent_back_to_the_queue_meanwhile_is_cancelled_not_left_to_run(
    app: kiln.App, backend: Any, tmp_path: Any, clock: Any, settings: Settings
) -> None:
    # Given a fan-out of two, both copies running
    params = {"steps": [{"name": "g", "kind": GEN, "params": {"prompt": "two"}, "repeat": 2}]}
    pipeline = await submit(app, params)
    first, sibling = await claim(app, GEN), await claim(app, GEN)
    other_store = backend.open(tmp_path / "store", clock)  # the supervisor's process
    await other_store.last_seq()
    other = kiln.App(store=other_store, settings=settings, rng=random.Random(1))
    other.task(GEN, params=GenParams)(_handler)
    real = store_pipelines._steps
    expired: list[Task] = []

    async def racing(ops: Any, tx: Any, ids: list[str]) -> Any:
        found = await real(ops, tx, ids)
        if not expired:  # right after the pipeline read its steps, the sibling's lease lapses
            lapsed = {"code": "lease_expired", "message": "lapsed", "retryable": True}
            expired.append(
                await other.apply(sibling, Event.EXPIRE, bump_epoch=True, retry_error=lapsed)
            )
        return found

    store_pipelines._steps = racing  # type: ignore[assignment]
    try:
        # When the first copy fails for good
        await fail(app, first)
    finally:
        store_pipelines._steps = real  # type: ignore[assignment]
        await other_store.close()
    # Then the sibling, back in the queue meanwhile, is cancelled (asking it to stop, as
    # the pipeline read it, did nothing: it would have run again for a failed pipeline)
    assert expired[0].status is Status.RETRYING
    assert (await app.get(pipeline.id)).status is Status.FAILED
    assert (await app.get(sibling.id)).status is Status.CANCELLED
