"""Reading, listing and acting on tasks; stats, health and the pages around the API."""

from __future__ import annotations

import shutil
import time
from typing import Any

import pytest
from api_support import (
    ADMIN_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    running_api,
    wait_until,
)

import kiln
from kiln import demo
from kiln.api.schemas import StatsOut, TaskList, TaskOut
from kiln.config import Settings
from kiln.store.postgres import PostgresStore
from services.postgres import PostgresServer


async def _submit(api: ApiUnderTest, prompt: str = "a fox", **fields: Any) -> dict[str, Any]:
    response = await api.submit(image_body(prompt, **fields))
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_get_returns_the_task(api: ApiUnderTest) -> None:
    task = await _submit(api)

    response = await api.client.get(f"/v1/tasks/{task['id']}")

    assert response.status_code == 200
    assert response.json() == task
    TaskOut.model_validate(response.json())


async def test_get_unknown_task_is_404(api: ApiUnderTest) -> None:
    assert_error(await api.client.get("/v1/tasks/tsk_nope"), 404, "not_found")


async def test_queue_position_follows_priority_then_age(api: ApiUnderTest) -> None:
    low = await _submit(api, "first", priority=0)
    high = await _submit(api, "second", priority=10)

    low_now = (await api.client.get(f"/v1/tasks/{low['id']}")).json()
    high_now = (await api.client.get(f"/v1/tasks/{high['id']}")).json()

    assert high_now["queue_position"] == 1
    assert low_now["queue_position"] == 2


async def test_list_is_newest_first_and_pages_with_the_cursor(api: ApiUnderTest) -> None:
    ids = [(await _submit(api, f"task {n}"))["id"] for n in range(5)]

    first = await api.client.get("/v1/tasks", params={"limit": 2})
    second = await api.client.get(
        "/v1/tasks", params={"limit": 2, "cursor": first.json()["next_cursor"]}
    )
    last = await api.client.get(
        "/v1/tasks", params={"limit": 2, "cursor": second.json()["next_cursor"]}
    )

    TaskList.model_validate(first.json())
    pages = [first.json(), second.json(), last.json()]
    assert [t["id"] for p in pages for t in p["items"]] == ids[::-1]
    assert last.json()["next_cursor"] is None
    assert first.json()["items"][0]["queue_position"] == 5


@pytest.fixture(params=["sqlite", "postgres"])
def each_store(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    if request.param == "sqlite":
        return settings
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return settings.with_(database_url=server.new_database())


async def test_positions_in_a_listing_equal_each_tasks_own(each_store: Settings) -> None:
    async with running_api(each_store) as api:
        # Given queued tasks of mixed priorities, a delayed one and a cancelled one, listed
        # in pages of 7 and in one page
        for n in range(24):
            await _submit(api, f"task {n}", priority=[0, 5, -2, 0][n % 4])
        await _submit(api, "later", delay_s=3600)
        cancelled = await _submit(api, "cancelled")
        await api.client.post(f"/v1/tasks/{cancelled['id']}/cancel")
        listed: dict[str, Any] = {}
        cursor = None
        while True:
            params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
            page = (await api.client.get("/v1/tasks", params=params)).json()
            listed.update((t["id"], t["queue_position"]) for t in page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        whole = (await api.client.get("/v1/tasks", params={"limit": 200})).json()["items"]
        # Then every task's position is the one its own GET gives
        own = {
            t["id"]: (await api.client.get(f"/v1/tasks/{t['id']}")).json()["queue_position"]
            for t in whole
        }
        assert listed == own == {t["id"]: t["queue_position"] for t in whole}
        assert sorted(p for p in own.values() if p is not None) == list(range(1, 25))


async def test_list_filters_by_status_and_kind(api: ApiUnderTest) -> None:
    kept = await _submit(api, "kept")
    cancelled = await _submit(api, "cancelled")
    await api.client.post(f"/v1/tasks/{cancelled['id']}/cancel")

    pending = await api.client.get("/v1/tasks", params={"status": "PENDING"})
    done = await api.client.get("/v1/tasks", params={"status": "CANCELLED", "kind": ""})
    other_kind = await api.client.get("/v1/tasks", params={"kind": "video.render"})

    assert [t["id"] for t in pending.json()["items"]] == [kept["id"]]
    assert [t["id"] for t in done.json()["items"]] == [cancelled["id"]]
    assert other_kind.json() == {"items": [], "next_cursor": None}


@pytest.mark.parametrize(
    "params",
    [{"limit": 0}, {"limit": 201}, {"limit": "many"}, {"status": "DONE"}],
    ids=["limit 0", "limit 201", "limit not a number", "unknown status"],
)
async def test_list_with_bad_query_is_422(api: ApiUnderTest, params: dict[str, Any]) -> None:
    assert_error(await api.client.get("/v1/tasks", params=params), 422, "invalid_request")


async def test_cancel_pending_task_is_cancelled(api: ApiUnderTest) -> None:
    task = await _submit(api)

    response = await api.client.post(f"/v1/tasks/{task['id']}/cancel")

    assert response.status_code == 200
    assert response.json()["status"] == "CANCELLED"
    assert response.json()["final"] is True
    assert response.json()["queue_position"] is None


async def test_cancel_final_task_is_409_already_final(api: ApiUnderTest) -> None:
    task = await _submit(api)
    await api.client.post(f"/v1/tasks/{task['id']}/cancel")

    response = await api.client.post(f"/v1/tasks/{task['id']}/cancel")

    assert_error(response, 409, "already_final")


async def test_retry_of_cancelled_task_is_retrying_and_due(api: ApiUnderTest) -> None:
    task = await _submit(api)
    await api.client.post(f"/v1/tasks/{task['id']}/cancel")

    response = await api.client.post(f"/v1/tasks/{task['id']}/retry")

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "RETRYING" and body["final"] is False
    assert body["finished_at"] is None and body["next_retry_at"] is not None
    assert body["max_attempts"] == 4
    assert body["queue_position"] == 1


async def test_retry_of_live_task_is_409_not_retryable(api: ApiUnderTest) -> None:
    task = await _submit(api)

    response = await api.client.post(f"/v1/tasks/{task['id']}/retry")

    assert_error(response, 409, "not_retryable")


async def test_actions_on_unknown_task_are_404(api: ApiUnderTest) -> None:
    for action in ("cancel", "retry"):
        assert_error(await api.client.post(f"/v1/tasks/tsk_nope/{action}"), 404, "not_found")


async def test_review_of_task_not_in_review_is_409(keyed_api: ApiUnderTest) -> None:
    task = await _submit(keyed_api)

    response = await keyed_api.client.post(
        f"/v1/tasks/{task['id']}/review",
        json={"decision": "approve"},
        headers=bearer(ADMIN_KEY),
    )

    assert_error(response, 409, "not_in_review")


async def test_without_keys_anyone_may_review(api: ApiUnderTest) -> None:
    task = await _submit(api)

    response = await api.client.post(f"/v1/tasks/{task['id']}/review", json={"decision": "reject"})

    assert_error(response, 409, "not_in_review")


async def test_review_needs_a_valid_decision_as_json(keyed_api: ApiUnderTest) -> None:
    task = await _submit(keyed_api)
    url = f"/v1/tasks/{task['id']}/review"
    admin = bearer(ADMIN_KEY)

    bad_decision = await keyed_api.client.post(url, json={"decision": "maybe"}, headers=admin)
    not_json = await keyed_api.client.post(url, content=b"approve", headers=admin)
    unknown = await keyed_api.client.post(
        "/v1/tasks/tsk_nope/review", json={"decision": "approve"}, headers=admin
    )

    assert_error(bad_decision, 422, "invalid_request")
    assert_error(not_json, 415, "unsupported_media_type")
    assert_error(unknown, 404, "not_found")


async def _reviewed(api: ApiUnderTest, prompt: str, decision: str) -> dict[str, Any]:
    params = {"prompt": prompt, "width": 64, "height": 64, "steps": 2,
              "simulate": {"step_ms": 0, "review": True}}  # fmt: skip
    task = (await api.submit({"kind": "image.generate", "params": params})).json()
    await _until_status(api, task["id"], "NEEDS_REVIEW")
    in_review = (await api.client.get(f"/v1/tasks/{task['id']}")).json()
    assert in_review["status"] == "NEEDS_REVIEW" and in_review["result"] is None
    outputs = await api.client.get(f"/v1/tasks/{task['id']}/outputs/image.png")
    assert_error(outputs, 404, "not_found")
    response = await api.client.post(
        f"/v1/tasks/{task['id']}/review",
        json={"decision": decision, "reason": "checked"},
        headers=bearer(ADMIN_KEY),
    )
    assert response.status_code == 200, response.text
    reviewed: dict[str, Any] = response.json()
    return reviewed


async def _until_status(api: ApiUnderTest, task_id: str, status: str) -> None:
    async for event in api.kiln.watch(task_id):
        if getattr(event, "status", None) == status:
            return
    raise AssertionError(f"task {task_id} never reached {status}")


async def test_admin_approval_makes_a_held_task_succeed(working_api: ApiUnderTest) -> None:
    task = await _reviewed(working_api, "held then approved", "approve")

    assert task["status"] == "SUCCESS"
    assert task["result"]["outputs"][0]["name"] == "image.png"
    download = await working_api.client.get(task["result"]["outputs"][0]["url"])
    assert download.status_code == 200


async def test_admin_rejection_fails_the_task_without_result(working_api: ApiUnderTest) -> None:
    task = await _reviewed(working_api, "held then rejected", "reject")

    assert task["status"] == "FAILED" and task["final"] is True
    assert task["result"] is None
    assert task["error"]["code"] == "content_rejected"
    assert task["error"]["message"] == "checked"


async def test_stats_count_the_tenants_tasks(api: ApiUnderTest) -> None:
    await _submit(api, "one")
    cancelled = await _submit(api, "two")
    await api.client.post(f"/v1/tasks/{cancelled['id']}/cancel")

    response = await api.client.get("/v1/stats")

    assert response.status_code == 200
    body = response.json()
    StatsOut.model_validate(body)
    assert body["counts"]["PENDING"] == 1 and body["counts"]["CANCELLED"] == 1
    assert body["ghosts"] == 0 and body["failures"] == {} == body["failures_last_hour"]
    assert set(body["dwell_seconds"]["PENDING"]) == {"p50", "p95"}


async def test_health_and_readiness_answer_ok(api: ApiUnderTest) -> None:
    health = await api.client.get("/healthz")
    ready = await api.client.get("/readyz")

    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert ready.status_code == 200 and ready.json() == {"status": "ok"}


async def test_readiness_fails_when_the_storage_cannot_be_written(settings: Settings) -> None:
    async with running_api(settings) as under_test:
        results = settings.data_dir / "results"
        shutil.rmtree(results)
        results.write_bytes(b"not a directory")

        probe = await under_test.client.get("/readyz")

    assert_error(probe, 503, "not_ready")


async def test_health_routes_need_no_key(keyed_api: ApiUnderTest) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/", "/openapi.json", "/docs"):
        response = await keyed_api.client.get(path)
        assert response.status_code == 200, path


async def test_root_serves_the_dashboard_page(api: ApiUnderTest) -> None:
    page = await api.client.get("/")
    script = await api.client.get("/dashboard/app.js")

    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<html" in page.text.lower()
    assert script.status_code == 200


async def test_openapi_documents_every_route_and_the_bodies(api: ApiUnderTest) -> None:
    schema = (await api.client.get("/openapi.json")).json()

    paths = set(schema["paths"])
    assert {
        "/v1/tasks", "/v1/tasks/{task_id}", "/v1/tasks/{task_id}/cancel",
        "/v1/tasks/{task_id}/retry", "/v1/tasks/{task_id}/review",
        "/v1/tasks/{task_id}/outputs/{name}", "/v1/tasks/{task_id}/events", "/v1/events",
        "/v1/stats", "/healthz", "/readyz", "/metrics",
    } <= paths  # fmt: skip
    components = schema["components"]["schemas"]
    submit_body = schema["paths"]["/v1/tasks"]["post"]["requestBody"]
    assert submit_body["content"]["application/json"]["schema"]["$ref"].endswith("SubmitRequest")
    submit = components["SubmitRequest"]
    variants = {
        kind: components[ref.rsplit("/", 1)[1]]
        for kind, ref in submit["discriminator"]["mapping"].items()
    }
    assert submit["discriminator"]["propertyName"] == "kind"
    assert [v["$ref"] for v in submit["oneOf"]] == list(submit["discriminator"]["mapping"].values())
    assert set(variants) == {"image.generate", "pipeline"}
    variant = variants["image.generate"]
    assert variant["additionalProperties"] is False
    assert variant["required"] == ["kind", "params"]
    assert variant["properties"]["kind"]["const"] == "image.generate"
    params = components[variant["properties"]["params"]["$ref"].rsplit("/", 1)[1]]
    assert params["required"] == ["prompt"]
    assert "TimeoutsIn" in components and "ErrorEnvelope" in components
    assert "securitySchemes" not in schema.get("components", {})


async def test_openapi_asks_for_a_bearer_key_when_keys_are_set(keyed_api: ApiUnderTest) -> None:
    schema = (await keyed_api.client.get("/openapi.json")).json()

    (scheme,) = schema["components"]["securitySchemes"].values()
    assert scheme == {**scheme, "type": "http", "scheme": "bearer"}
    assert schema["paths"]["/v1/tasks"]["post"]["security"]


@pytest.mark.postgres
async def test_an_unreachable_database_answers_503_and_the_server_keeps_serving(
    settings: Settings, postgres_server: PostgresServer
) -> None:
    # Given an API on a PostgreSQL database that holds a task
    url = postgres_server.new_database()
    store = PostgresStore(url, clock=time.time, acquire_timeout_s=0.5)
    app = kiln.App(settings=settings, store=store)
    demo.register(app)
    async with app, running_api(settings, kiln_app=app) as api:
        created = await api.client.post("/v1/tasks", json=image_body("a lighthouse"))
        assert created.status_code == 201
        # When the database goes away (dropped, its connections cut)
        postgres_server.sql(f"DROP DATABASE {url.rsplit('/', 1)[1]} WITH (FORCE)")
        read = await api.client.get(f"/v1/tasks/{created.json()['id']}")
        submit = await api.client.post("/v1/tasks", json=image_body("a harbour"))
        # Then requests answer 503 store_unavailable with a hint to retry, not 500
        assert_error(read, 503, "store_unavailable")
        assert_error(submit, 503, "store_unavailable")
        assert read.headers["Retry-After"] == "1"
        assert_error(await api.client.get("/readyz"), 503, "not_ready")
        # And the server still answers what needs no database
        assert (await api.client.get("/healthz")).status_code == 200


async def test_a_get_reads_the_task_and_its_position_in_one_store_read(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two queued tasks
    await api.submit(image_body("first"))
    second = (await api.submit(image_body("second"))).json()
    store = api.kiln.engine.store
    last = await store.last_seq()  # the event feed has read the log: none of its reads below
    await wait_until(lambda: api.kiln.engine.hub.last_seq >= last)
    reads: list[object] = []
    read = store._read

    async def counted(op: Any) -> Any:
        reads.append(op)
        return await read(op)

    monkeypatch.setattr(store, "_read", counted)
    # When the second is read
    found = await api.client.get(f"/v1/tasks/{second['id']}")
    # Then the answer holds its position, read with the task in one round trip
    assert found.status_code == 200
    assert found.json()["queue_position"] == 2
    assert len(reads) == 1
