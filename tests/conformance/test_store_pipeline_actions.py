"""What the rest of kiln does around a pipeline, on both stores: a tenant's running cap
counts its steps, not the pipeline that waits for them; a pipeline takes no run_at; a step
of an ended pipeline is retried with its pipeline; an output index row goes when its
task's result is lost and run again."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

import kiln
from kiln.config import Settings
from kiln.errors import InvalidRequest
from kiln.reconcile import ResultLostPolicy, lose_result
from kiln.states import Event, Status
from kiln.store import Store

from .test_store_pipelines import (
    GEN,
    GenParams,
    _handler,
    claim,
    fail,
    output,
    steps,
    submit,
    succeed,
)
from .test_store_pipelines import app as app  # the fixture, under its own name

pytestmark = pytest.mark.usefixtures("queue_counts_checked")


async def test_a_running_pipeline_takes_no_place_under_its_tenants_running_cap(
    store: Store, settings: Settings
) -> None:
    # Given a tenant allowed one running task, and one pipeline of two steps in a chain
    capped = dataclasses.replace(settings, tenant_running=1)
    app = kiln.App(store=store, settings=capped, rng=random.Random(7))
    app.task(GEN, params=GenParams)(_handler)
    pipeline = await submit(app, {"steps": [
        {"name": "a", "kind": GEN, "params": {"prompt": "cap a"}},
        {"name": "b", "kind": GEN, "params": {"prompt": "cap b"}},
    ]})  # fmt: skip
    assert (await app.get(pipeline.id)).status is Status.GENERATING
    # When a worker claims: the running pipeline does not use the tenant's one place
    [first] = await app.engine.claim(worker_id="w", kinds=[GEN], limit=1, lease_ttl_s=30)
    assert first.pipeline_id == pipeline.id and first.step == "a"
    # And its running step does: a plain task of the tenant waits for it
    await app.submit(GEN, {"prompt": "plain"}, tenant="acme")
    assert await app.engine.claim(worker_id="w", kinds=[GEN], limit=1, lease_ttl_s=30) == []
    await succeed(app, first)
    claimed = await app.engine.claim(worker_id="w", kinds=[GEN], limit=1, lease_ttl_s=30)
    assert len(claimed) == 1


@pytest.mark.parametrize("when", [{"delay_s": 60.0}, {"run_at": "2099-01-01T00:00:00Z"}])
async def test_a_pipeline_takes_no_run_at_and_nothing_is_stored(
    app: kiln.App, when: dict[str, Any]
) -> None:
    params = {"steps": [{"name": "a", "kind": GEN, "params": {"prompt": "later"}}]}
    with pytest.raises(InvalidRequest) as refused:
        await app.submit("pipeline", params, tenant="acme", **when)
    assert refused.value.details[0]["loc"] == ["body", next(iter(when))]
    assert (await app.list_tasks(tenant="acme"))[0] == []


async def test_a_step_of_an_ended_pipeline_is_retried_with_its_pipeline(app: kiln.App) -> None:
    # Given a chain whose first step failed for good: the pipeline ended FAILED
    pipeline = await submit(app, {"steps": [
        {"name": "a", "kind": GEN, "params": {"prompt": "retry a"}},
        {"name": "b", "kind": GEN, "params": {"prompt": "retry b"}},
    ]})  # fmt: skip
    failed = await fail(app, await claim(app, GEN))
    assert failed.status is Status.FAILED
    assert (await app.get(pipeline.id)).status is Status.FAILED
    # When the step is retried on its own (as kiln retry --status FAILED would)
    retried = await app.retry(failed.id, "acme")
    # Then its pipeline runs again from it, and the chain goes on when it succeeds
    assert retried.status is Status.RETRYING
    assert (await app.get(pipeline.id)).status is Status.GENERATING
    await succeed(app, await claim(app, GEN))
    made = await steps(app, pipeline.id)
    assert made["b/0"].status in (Status.PENDING, Status.RETRYING)
    await succeed(app, await claim(app, GEN))
    assert (await app.get(pipeline.id)).status is Status.SUCCESS


async def test_an_output_index_row_goes_when_its_result_is_lost_and_run_again(
    app: kiln.App,
) -> None:
    # Given a task that succeeded with an output of a fixed content
    await app.submit(GEN, {"prompt": "indexed"}, tenant="acme")
    sha = "ab" * 32

    async def succeed_with_fixed_content() -> str:
        task = await claim(app, GEN)
        result = {"outputs": [{**output(task), "sha256": sha}]}
        task = await app.apply(task, Event.ACQUIRE, fenced=True)
        task = await app.apply(task, Event.GENERATED, fenced=True)
        await app.apply(task, Event.UPLOADED, Status.SUCCESS, fenced=True,
                        fields={"result": result})  # fmt: skip
        return str(result["outputs"][0]["key"])

    first_key = await succeed_with_fixed_content()
    assert (await app.engine.store.inputs.find_object("acme", sha)).output["key"] == first_key  # type: ignore[union-attr]
    # When its result is found lost and it runs again: the old object is no longer named
    [task] = (await app.list_tasks(tenant="acme"))[0]
    await lose_result(app, task, [], ResultLostPolicy.RERUN)
    assert await app.engine.store.inputs.find_object("acme", sha) is None
    # And the new run's object is what the index names
    second_key = await succeed_with_fixed_content()
    assert second_key != first_key
    assert (await app.engine.store.inputs.find_object("acme", sha)).output["key"] == second_key  # type: ignore[union-attr]


async def test_a_bulk_retry_by_code_retries_the_ended_pipelines_of_the_steps_it_names(
    app: kiln.App,
) -> None:
    from kiln.bulk_actions import FilterIn, bulk_action, filter_of

    # Given two chains whose first steps failed for good (code boom): both pipelines ended
    def chain_of(n: int) -> dict[str, Any]:
        return {"steps": [
            {"name": "a", "kind": GEN, "params": {"prompt": f"outage {n}"}},
            {"name": "b", "kind": GEN, "params": {"prompt": f"after {n}"}},
        ]}  # fmt: skip

    pipelines = [await submit(app, chain_of(n)) for n in range(2)]
    for _ in pipelines:
        assert (await fail(app, await claim(app, GEN))).status is Status.FAILED
    assert {(await app.get(p.id)).status for p in pipelines} == {Status.FAILED}
    # When a bulk retry names the failed steps by their code (kiln retry --code boom)
    found = filter_of("retry", FilterIn(status=["FAILED"], kind=[GEN], code=["boom"]),
                      scope="acme", everything=False, now=app.now())  # fmt: skip
    page = await bulk_action(app.engine, "retry", found, dry_run=False)
    # Then each step is retried with its pipeline: the pipelines run again from them
    assert (page["matched"], page["retried"], page["skipped"]) == (2, 2, 0)
    assert sorted(page["task_ids"]) == sorted(p.id for p in pipelines)
    assert {(await app.get(p.id)).status for p in pipelines} == {Status.GENERATING}
    for _ in range(4):  # the two retried steps, then the two steps they make ready
        await succeed(app, await claim(app, GEN))
    assert {(await app.get(p.id)).status for p in pipelines} == {Status.SUCCESS}


async def test_a_forced_cancel_decided_before_its_pipeline_was_retried_is_refused(
    app: kiln.App,
) -> None:
    from kiln.errors import StaleDecision

    # Given a running step asked to stop by its pipeline's cancel, as the supervisor's
    # sweep reads it (its cancel overdue)
    pipeline = await submit(app, {"steps": [
        {"name": "a", "kind": GEN, "params": {"prompt": "forced"}},
    ]})  # fmt: skip
    step = await claim(app, GEN)
    await app.cancel(pipeline.id, "acme")
    read = await app.get(step.id)
    assert read.cancel_requested
    # When the pipeline is retried (the step's stop taken back) before the sweep acts
    await app.retry(pipeline.id, "acme")
    # Then the forced cancel decided on the earlier read is refused: the attempt goes on
    with pytest.raises(StaleDecision):
        await app.apply(read, Event.FORCE_CANCEL, bump_epoch=True)
    now = await app.get(step.id)
    assert (now.status, now.epoch, now.cancel_requested) == (step.status, read.epoch, False)
    await succeed(app, now)
    assert (await app.get(pipeline.id)).status is Status.SUCCESS
