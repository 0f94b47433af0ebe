"""/v1/schedules and delayed submissions over HTTP: shapes, tenants, refusals that store
nothing, pause and resume, and the fires counted in /metrics."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import (
    ADMIN_KEY,
    BOB_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    running_api,
)
from test_api_metrics import labelled, scrape
from test_api_transform import kiln_with_transform

from images import png
from kiln.api.schedules import ScheduleOut
from kiln.config import Settings
from kiln.store import LeaderToken

SCHEDULE_FIELDS = {
    "id", "cron", "timezone", "kind", "task", "overlap", "missed", "paused", "next_run_at",
    "last_task_id", "last_fired_at", "fired", "skipped", "created_at", "updated_at",
}  # fmt: skip


def schedule_body(cron: str = "0 9 * * 1-5", **fields: Any) -> dict[str, Any]:
    return {"cron": cron, "timezone": "Europe/Berlin", "task": image_body("a harbour"), **fields}


async def schedule_count(api: ApiUnderTest) -> int:
    return len(await api.kiln.engine.store.schedules.page(tenant=None, limit=1000))


async def test_a_schedule_is_created_read_listed_paused_resumed_and_deleted(
    keyed_api: ApiUnderTest,
) -> None:
    created = await keyed_api.client.post("/v1/schedules", json=schedule_body())
    assert created.status_code == 201, created.text
    schedule = created.json()
    assert set(schedule) == SCHEDULE_FIELDS
    ScheduleOut.model_validate(schedule)  # the documented shape
    assert created.headers["Location"] == f"/v1/schedules/{schedule['id']}"
    assert schedule["kind"] == "image.generate" and schedule["timezone"] == "Europe/Berlin"
    assert schedule["overlap"] == "skip" and schedule["missed"] == "fire_once"
    assert schedule["task"]["params"]["steps"] == 4 and schedule["next_run_at"] is not None
    path = f"/v1/schedules/{schedule['id']}"

    assert (await keyed_api.client.get(path)).json() == schedule
    listed = (await keyed_api.client.get("/v1/schedules")).json()
    assert [s["id"] for s in listed["items"]] == [schedule["id"]] and listed["next_cursor"] is None

    paused = (await keyed_api.client.post(f"{path}/pause")).json()
    assert paused["paused"] and paused["next_run_at"] is None
    resumed = (await keyed_api.client.post(f"{path}/resume")).json()
    assert not resumed["paused"] and resumed["next_run_at"] is not None

    deleted = await keyed_api.client.delete(path)
    assert deleted.json() == {"id": schedule["id"], "deleted": True}
    assert_error(await keyed_api.client.get(path), 404, "not_found")


async def test_another_tenants_schedule_is_not_found_and_the_admin_sees_all(
    keyed_api: ApiUnderTest,
) -> None:
    schedule = (await keyed_api.client.post("/v1/schedules", json=schedule_body())).json()
    path = f"/v1/schedules/{schedule['id']}"
    bob = bearer(BOB_KEY)
    for method, url in [("GET", path), ("POST", f"{path}/pause"), ("DELETE", path)]:
        assert_error(await keyed_api.client.request(method, url, headers=bob), 404, "not_found")
    assert (await keyed_api.client.get("/v1/schedules", headers=bob)).json()["items"] == []
    admin = (await keyed_api.client.get("/v1/schedules", headers=bearer(ADMIN_KEY))).json()
    assert [s["id"] for s in admin["items"]] == [schedule["id"]]


async def test_schedules_are_paged_by_cursor(keyed_api: ApiUnderTest) -> None:
    ids = [
        (await keyed_api.client.post("/v1/schedules", json=schedule_body())).json()["id"]
        for _ in range(3)
    ]
    first = (await keyed_api.client.get("/v1/schedules", params={"limit": 2})).json()
    assert [s["id"] for s in first["items"]] == ids[:2] and first["next_cursor"] == ids[1]
    rest = await keyed_api.client.get(
        "/v1/schedules", params={"limit": 2, "cursor": first["next_cursor"]}
    )
    assert [s["id"] for s in rest.json()["items"]] == ids[2:]
    bad = await keyed_api.client.get("/v1/schedules", params={"cursor": "nope"})
    assert_error(bad, 422, "invalid_request")


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (schedule_body("not a cron"), "invalid_request"),
        (schedule_body("0 0 30 2 *"), "invalid_request"),
        (schedule_body(timezone="Mars/Olympus"), "invalid_request"),
        (schedule_body(timezone="localtime"), "invalid_request"),
        (schedule_body(timezone="posixrules"), "invalid_request"),
        ({**schedule_body(), "task": {"kind": "nope", "params": {}}}, "unknown_kind"),
        ({**schedule_body(), "task": image_body("")}, "invalid_request"),
        ({**schedule_body(), "task": image_body("x", delay_s=5)}, "invalid_request"),
        (schedule_body(overlap="sometimes"), "invalid_request"),
        (schedule_body(missed="catch_up"), "invalid_request"),
        ({"timezone": "UTC", "task": image_body()}, "invalid_request"),
    ],
)
async def test_a_refused_schedule_stores_nothing(
    keyed_api: ApiUnderTest, body: dict[str, Any], code: str
) -> None:
    assert_error(await keyed_api.client.post("/v1/schedules", json=body), 422, code)
    assert await schedule_count(keyed_api) == 0


async def test_a_delayed_submission_is_scheduled_with_no_queue_position(
    keyed_api: ApiUnderTest,
) -> None:
    body = image_body("later", run_at=time.time() + 3600)
    response = await keyed_api.submit(body)
    assert response.status_code == 201, response.text
    task = response.json()
    assert task["status"] == "PENDING" and task["queue_position"] is None
    assert task["scheduled_for"] is not None
    now_task = (await keyed_api.submit(image_body("now"))).json()
    assert now_task["scheduled_for"] is None and now_task["queue_position"] == 1
    cancelled = await keyed_api.client.post(f"/v1/tasks/{task['id']}/cancel")
    assert cancelled.json()["status"] == "CANCELLED"


@pytest.mark.parametrize(
    "fields",
    [
        {"run_at": time.time() + 60, "delay_s": 60},
        {"delay_s": -1},
        {"run_at": -5},
        {"delay_s": 400 * 86400},
        {"run_at": "2999-01-01T00:00:00Z"},
        {"run_at": "2030-01-01 09:00"},
        {"run_at": "soon"},
        {"run_at": True},
    ],
)
async def test_a_refused_delay_stores_nothing(keyed_api: ApiUnderTest, fields: Any) -> None:
    assert_error(await keyed_api.submit(image_body(**fields)), 422, "invalid_request")
    assert await keyed_api.task_count() == 0


@pytest.fixture
async def upload_api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API with image.transform registered too, no keys."""
    async with running_api(settings, kiln_app=kiln_with_transform(settings)) as under_test:
        yield under_test


async def test_a_refused_delay_on_an_upload_stores_nothing(upload_api: ApiUnderTest) -> None:
    body = {"kind": "image.transform", "params": {"op": "convert", "format": "png"},
            "delay_s": -3}  # fmt: skip
    files = {"image": ("in.png", png(), "image/png")}
    response = await upload_api.client.post(
        "/v1/tasks", data={"request": json.dumps(body)}, files=files
    )
    assert_error(response, 422, "invalid_request")
    assert await upload_api.task_count() == 0
    assert [
        p for p in (upload_api.kiln.settings.data_dir / "results").rglob("*") if p.is_file()
    ] == []


async def test_a_delayed_upload_is_scheduled(upload_api: ApiUnderTest) -> None:
    body = {"kind": "image.transform", "params": {"op": "convert", "format": "png"},
            "delay_s": 600}  # fmt: skip
    files = {"image": ("in.png", png(), "image/png")}
    response = await upload_api.client.post(
        "/v1/tasks", data={"request": json.dumps(body)}, files=files
    )
    assert response.status_code == 201, response.text
    task = response.json()
    assert task["scheduled_for"] is not None and task["queue_position"] is None
    assert [i["name"] for i in task["inputs"]] == ["image"]


async def test_fired_ticks_are_counted_in_metrics(keyed_api: ApiUnderTest) -> None:
    created = await keyed_api.client.post("/v1/schedules", json=schedule_body("* * * * * *"))
    schedule_id = created.json()["id"]
    store = keyed_api.kiln.engine.store
    sup = keyed_api.kiln.supervisor(owner="metrics-test")
    deadline = time.monotonic() + 10
    while (await store.schedules.get(schedule_id)).fired < 1:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        await sup.sweep()
    samples = await scrape(keyed_api)
    fires = labelled(samples, "kiln_schedule_fires_total", "outcome")
    assert fires[("fired",)] >= 1
    assert set(fires) == {("fired",), ("skipped_overlap",), ("skipped_missed",), ("rate_limited",)}
    assert isinstance(sup.token, LeaderToken)
