"""What one request may create (docs/limits.md): the rate limit takes a token per task a
request creates (a pipeline and every copy of its steps, in a batch too), a request that
would create more than KILN_MAX_TASKS_PER_REQUEST is 413 ``too_many_tasks`` with nothing
stored, a tenant's schedules are capped (409 ``too_many_schedules``, the admin exempt),
and every rate-limited batch item is counted."""

from __future__ import annotations

from typing import Any

from api_support import (
    ADMIN_KEY,
    ALICE_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    running_api,
    with_keys,
)

from kiln.config import Settings
from kiln.limits import Rate, TenantLimit

FAST = {"width": 64, "height": 64, "steps": 2, "simulate": {"step_ms": 0}}


def repeated(copies: int, *, steps: int = 1, prompt: str = "a lighthouse") -> dict[str, Any]:
    """A pipeline of ``steps`` independent steps, each repeated ``copies`` times: it
    creates 1 + steps x copies tasks."""
    return {
        "kind": "pipeline",
        "params": {
            "steps": [
                {"name": f"gen{n}", "kind": "image.generate", "repeat": copies,
                 "params": {"prompt": f"{prompt} {n}", "seed": 7, **FAST}}
                for n in range(steps)
            ]
        },
    }  # fmt: skip


def burst_of(settings: Settings, burst: float) -> Settings:
    """Alice may create ``burst`` tasks now and one more every 100 s."""
    return with_keys(settings).with_(
        tenant_limits={"alice": TenantLimit(rate=Rate(per_s=0.01, burst=burst))}
    )


async def rate_limited_total(api: ApiUnderTest) -> float:
    for line in (await api.client.get("/metrics")).text.splitlines():
        if line.startswith("kiln_rate_limited_total "):
            return float(line.split()[1])
    raise AssertionError("no kiln_rate_limited_total in /metrics")


async def test_a_pipeline_takes_a_token_for_itself_and_every_copy_of_its_steps(
    settings: Settings,
) -> None:
    # Given alice may create 10 tasks in a burst
    async with running_api(burst_of(settings, 10), key=ALICE_KEY) as api:
        # When she submits a pipeline of one step repeated 5 times (6 tasks)
        first = await api.submit(repeated(5, prompt="first"))
        assert first.status_code == 201, first.text
        assert await api.task_count() == 6
        # Then a second one (6 tasks more, 4 tokens left) is refused, nothing stored
        second = await api.submit(repeated(5, prompt="second"))
        error = assert_error(second, 429, "rate_limited")
        assert "6 tasks" in error["message"]
        assert int(second.headers["Retry-After"]) > 100
        assert await api.task_count() == 6
        # And a single task still fits in what is left
        assert (await api.submit(image_body("one more"))).status_code == 201


async def test_pipelines_in_a_batch_take_a_token_per_task(settings: Settings) -> None:
    # Given alice may create 10 tasks in a burst
    async with running_api(burst_of(settings, 10), key=ALICE_KEY) as api:
        # When she sends 5 pipelines of 4 tasks each (one step repeated 3 times) in a batch
        items = [repeated(3, prompt=f"p{i}") for i in range(5)]
        response = await api.client.post("/v1/tasks/batch", json={"tasks": items})
        # Then 2 pipelines (8 tasks) go in; the other 3 are refused rate_limited
        assert response.status_code == 200, response.text
        answers = response.json()["items"]
        assert [a["status"] for a in answers] == ["created"] * 2 + ["refused"] * 3
        assert {a["error"]["code"] for a in answers[2:]} == {"rate_limited"}
        assert await api.task_count() == 8
        # And each refused item is counted
        assert await rate_limited_total(api) == 3


async def test_every_rate_limited_batch_item_is_counted(settings: Settings) -> None:
    async with running_api(burst_of(settings, 1), key=ALICE_KEY) as api:
        items = [image_body(f"fox {i}") for i in range(5)]
        response = await api.client.post("/v1/tasks/batch", json={"tasks": items})
        statuses = [a["status"] for a in response.json()["items"]]
        assert statuses == ["created", "refused", "refused", "refused", "refused"]
        assert await rate_limited_total(api) == 4


async def test_a_batch_of_pipelines_past_the_default_cap_is_413_and_stores_nothing(
    api: ApiUnderTest,
) -> None:
    # Given 6 pipelines of 201 tasks each (two steps repeated 100 times), 1,206 in all,
    # with no rate limit: the default cap of 1,000 tasks a request applies
    items = [repeated(100, steps=2, prompt=f"p{i}") for i in range(6)]

    response = await api.client.post("/v1/tasks/batch", json={"tasks": items})

    error = assert_error(response, 413, "too_many_tasks")
    assert "1206" in error["message"] and "1000" in error["message"]
    assert "KILN_MAX_TASKS_PER_REQUEST" in error["message"]
    detail = error["details"][0]
    assert (detail["count"], detail["limit"]) == (1206, 1000)
    assert detail["setting"] == "KILN_MAX_TASKS_PER_REQUEST"
    assert await api.task_count() == 0
    # And the server keeps serving; a batch within the cap goes in
    smaller = await api.client.post("/v1/tasks/batch", json={"tasks": items[:4]})
    assert [a["status"] for a in smaller.json()["items"]] == ["created"] * 4


async def test_one_pipeline_past_a_lower_cap_is_413_and_stores_nothing(
    settings: Settings,
) -> None:
    async with running_api(settings.with_(max_tasks_per_request=50)) as api:
        response = await api.submit(repeated(60))
        error = assert_error(response, 413, "too_many_tasks")
        assert (error["details"][0]["count"], error["details"][0]["limit"]) == (61, 50)
        assert await api.task_count() == 0
        assert (await api.submit(repeated(49))).status_code == 201


def every_minute(prompt: str = "the harbour") -> dict[str, Any]:
    return {"cron": "* * * * *", "task": image_body(prompt)}


async def test_a_tenant_past_its_schedule_cap_gets_409_and_the_admin_is_exempt(
    settings: Settings,
) -> None:
    capped = with_keys(settings).with_(max_schedules_per_tenant=2)
    async with running_api(capped, key=ALICE_KEY) as api:
        made = [await api.client.post("/v1/schedules", json=every_minute()) for _ in range(2)]
        assert [r.status_code for r in made] == [201, 201]
        # When alice asks for a third
        refused = await api.client.post("/v1/schedules", json=every_minute())
        # Then it is refused, and nothing is stored
        error = assert_error(refused, 409, "too_many_schedules")
        assert "KILN_MAX_SCHEDULES_PER_TENANT" in error["message"]
        assert (error["details"][0]["count"], error["details"][0]["limit"]) == (2, 2)
        assert len(await api.kiln.engine.store.schedules.page(tenant="alice")) == 2
        # The admin key is not capped
        for _ in range(3):
            admin = await api.client.post(
                "/v1/schedules", json=every_minute(), headers=bearer(ADMIN_KEY)
            )
            assert admin.status_code == 201, admin.text
        # Deleting one of alice's makes room again
        await api.client.delete(f"/v1/schedules/{made[0].json()['id']}")
        assert (await api.client.post("/v1/schedules", json=every_minute())).status_code == 201


async def test_a_schedule_whose_ticks_pass_the_task_cap_is_refused(settings: Settings) -> None:
    async with running_api(settings.with_(max_tasks_per_request=50)) as api:
        body = {"cron": "* * * * *", "task": repeated(60)}
        response = await api.client.post("/v1/schedules", json=body)
        assert_error(response, 413, "too_many_tasks")
        assert await api.kiln.engine.store.schedules.page(tenant=None) == []
