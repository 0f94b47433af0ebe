"""Bulk pages cut by the rows they change (KILN_BULK_PAGE_ROWS), on both stores: a page of
pipelines of 200 steps each stops once its transaction changed the budget, its cursor is
the last pipeline it took, the next page goes on from there, and every step ends
cancelled (or is retried) exactly once."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

import kiln
from kiln.bulk_actions import FilterIn, bulk_action, filter_of
from kiln.config import Settings
from kiln.models import JSON, Task
from kiln.states import Status
from kiln.store import Store

from .test_store_pipelines import GEN, GenParams, _handler

#: Rows a page may change: each pipeline here changes 402 (its row and its event, each
#: step's row and its event), so a page takes three (804 rows is under the budget, 1,206
#: is over) and the next page the rest.
BUDGET = 1000
PIPELINES = 5


@pytest.fixture
def paged_app(store: Store, settings: Settings) -> kiln.App:
    budgeted = dataclasses.replace(settings, bulk_page_rows=BUDGET)
    app = kiln.App(store=store, settings=budgeted, rng=random.Random(7))
    app.task(GEN, params=GenParams)(_handler)
    return app


def wide(n: int) -> JSON:
    """Two steps of 100 copies each, neither reading the other: 200 steps made at once."""
    return {
        "steps": [
            {"name": "left", "kind": GEN, "repeat": 100, "params": {"prompt": f"left {n}"}},
            {"name": "right", "kind": GEN, "repeat": 100, "params": {"prompt": f"right {n}"}},
        ]
    }


async def wide_pipelines(app: kiln.App) -> list[Task]:
    made = [(await app.submit("pipeline", wide(n), tenant="acme")).task for n in range(PIPELINES)]
    for pipeline in made:
        assert len(await app.pipeline_steps(pipeline)) == 200
    return made


async def every_page(app: kiln.App, action: str, **fields: Any) -> list[JSON]:
    found = filter_of(action, FilterIn(**fields), scope=None, everything=False, now=app.now())
    pages = [await bulk_action(app.engine, action, found, dry_run=False)]
    while pages[-1]["cursor"] is not None:
        cursor = pages[-1]["cursor"]
        pages.append(await bulk_action(app.engine, action, found, dry_run=False, cursor=cursor))
    return pages


async def events_of(app: kiln.App, task_id: str) -> list[str]:
    return [str(e.event) for e in await app.engine.store.events(task_id=task_id, limit=1000)]


async def test_a_page_of_pipelines_is_cut_by_rows_and_the_next_page_goes_on(
    paged_app: kiln.App,
) -> None:
    # Given five running pipelines of 200 waiting steps each (1,000 steps)
    pipelines = await wide_pipelines(paged_app)
    # When they are cancelled by kind, page after page, each page as large as the default
    # limit (100 tasks) allows
    pages = await every_page(paged_app, "cancel", kind=["pipeline"])
    # Then the first page stopped at the budget: three pipelines, with a cursor at the
    # third, and the next page took the other two and ended the action
    print(f"pages: {[(p['matched'], p['cancelled'], p['cursor']) for p in pages]}")
    assert [p["cancelled"] for p in pages] == [3, 2]
    assert [p["matched"] for p in pages] == [3, 2]
    assert pages[0]["cursor"] == pipelines[2].id and pages[-1]["cursor"] is None
    assert sum(p["skipped"] for p in pages) == 0
    # And each pipeline was taken once, in id order
    assert [i for p in pages for i in p["task_ids"]] == [p.id for p in pipelines]
    # And every pipeline and every step ended cancelled exactly once
    for pipeline in pipelines:
        assert (await paged_app.get(pipeline.id)).status is Status.CANCELLED
        assert (await events_of(paged_app, pipeline.id)).count("steps_cancelled") == 1
        for step in (await paged_app.pipeline_steps(await paged_app.get(pipeline.id))).values():
            assert step.status is Status.CANCELLED, step
            assert (await events_of(paged_app, step.id)).count("cancel") == 1
    # And run again from the start, nothing is left to do
    again = await every_page(paged_app, "cancel", kind=["pipeline"])
    assert [(p["matched"], p["cursor"]) for p in again] == [(0, None)]


async def test_a_page_of_pipeline_retries_is_cut_by_rows_too(paged_app: kiln.App) -> None:
    # Given five cancelled pipelines of 200 steps each
    pipelines = await wide_pipelines(paged_app)
    for pipeline in pipelines:
        await paged_app.cancel(pipeline.id)
    # When they are retried by kind, page after page
    pages = await every_page(paged_app, "retry", kind=["pipeline"], status=["CANCELLED"])
    # Then the pages took three and two, each pipeline once, in id order
    assert [p["retried"] for p in pages] == [3, 2]
    assert [i for p in pages for i in p["task_ids"]] == [p.id for p in pipelines]
    # And every pipeline runs again, every step of it retried exactly once
    for pipeline in pipelines:
        again = await paged_app.get(pipeline.id)
        assert again.status is Status.GENERATING
        assert (await events_of(paged_app, pipeline.id)).count("retry") == 1
        steps = await paged_app.pipeline_steps(again)
        assert len(steps) == 200
        for step in steps.values():
            assert step.status is Status.RETRYING, step
            assert (await events_of(paged_app, step.id)).count("retry") == 1
