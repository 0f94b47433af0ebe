"""GET /v1/usage and kiln_gpu_seconds_total: the GPU-second ledger over HTTP."""

from __future__ import annotations

from typing import Any

from api_support import ADMIN_KEY, BOB_KEY, ApiUnderTest, assert_error, bearer, image_body
from test_api_metrics import labelled, scrape

from kiln.states import Status


async def _run(api: ApiUnderTest, prompt: str, key: str | None = None, **simulate: Any) -> str:
    body = image_body(prompt)
    body["params"]["simulate"] = {"step_ms": 1, **simulate}
    task_id: str = (await api.submit(body, key=key)).json()["id"]
    await api.kiln.wait(task_id, timeout_s=30)
    return task_id


async def test_a_tenant_sees_its_own_usage_which_matches_the_event_log(
    working_api: ApiUnderTest,
) -> None:
    # Given alice's task that fails once then succeeds, and bob's that succeeds
    mine = await _run(working_api, "alice's fox", fail_attempts=1)
    await _run(working_api, "bob's fox", key=BOB_KEY)
    # When alice asks for her usage by tenant, kind, model and outcome
    response = await working_api.client.get(
        "/v1/usage", params={"group_by": "tenant,kind,model,outcome"}
    )
    # Then she sees her two attempts only, one retried and one successful
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["group_by"] == ["tenant", "kind", "model", "outcome"]
    assert body["from"].endswith("Z") and body["to"].endswith("Z") and not body["truncated"]
    outcomes = {item["outcome"]: item for item in body["items"]}
    assert sorted(outcomes) == ["retry", "success"]
    assert {item["tenant"] for item in body["items"]} == {"alice"}
    assert all(item["kind"] == "image.generate" and item["attempts"] == 1 for item in body["items"])
    # And the ledger's seconds are the event log's dwell times
    store = working_api.kiln.engine.store
    events = await store.events(task_id=mine)
    generating = [e.dwell_s for e in events if e.from_status is Status.GENERATING]
    waiting = [e.dwell_s for e in events if e.from_status is Status.WAITING_FOR_RESOURCE]
    rows = await store.usage.of_task(mine)
    assert [r.generating_s for r in rows] == generating
    assert [r.waiting_s for r in rows] == waiting
    total = sum(item["generating_s"] for item in body["items"])
    assert abs(total - sum(g or 0.0 for g in generating)) < 1e-9


async def test_the_admin_sees_every_tenant_or_one_and_a_tenant_no_other(
    working_api: ApiUnderTest,
) -> None:
    # Given one successful task each for alice and bob
    await _run(working_api, "alice's fox")
    await _run(working_api, "bob's fox", key=BOB_KEY)
    admin = bearer(ADMIN_KEY)
    # When the admin asks by tenant, then for bob alone
    every = await working_api.client.get("/v1/usage?group_by=tenant", headers=admin)
    bobs = await working_api.client.get("/v1/usage?tenant=bob&group_by=day", headers=admin)
    # Then it sees both tenants, then bob's one attempt
    assert [item["tenant"] for item in every.json()["items"]] == ["alice", "bob"]
    (only,) = bobs.json()["items"]
    assert only["attempts"] == 1 and len(only["day"]) == 10 and "tenant" not in only
    # And alice may not ask for bob's
    assert_error(await working_api.client.get("/v1/usage?tenant=bob"), 403, "forbidden")
    # And /metrics reports the GPU-seconds by tenant, kind, model and outcome to the admin
    samples = await scrape(working_api, ADMIN_KEY)
    gpu = labelled(samples, "kiln_gpu_seconds_total", "tenant", "kind", "model", "outcome")
    assert set(gpu) == {
        ("alice", "image.generate", "", "success"), ("bob", "image.generate", "", "success"),
    }  # fmt: skip
    assert all(seconds > 0 for seconds in gpu.values())


async def test_bad_usage_parameters_are_422_in_the_error_envelope(
    keyed_api: ApiUnderTest,
) -> None:
    for query, loc, value in (
        ("group_by=tenant,colour", ["query", "group_by"], "colour"),
        ("from=yesterday", ["query", "from"], "yesterday"),
        ("from=2027-01-15T08:00:00", ["query", "from"], "2027-01-15T08:00:00"),  # no offset
        ("to=soon", ["query", "to"], "soon"),
    ):
        error = assert_error(await keyed_api.client.get(f"/v1/usage?{query}"), 422,
                             "invalid_request")  # fmt: skip
        # each detail says where, what and which kind of error, as every other 422 does
        (detail,) = error["details"]
        assert set(detail) == {"loc", "msg", "type"}, detail
        assert detail["loc"] == loc and value in detail["msg"] and detail["type"]
    # And a window that ends before it starts holds nothing
    empty = await keyed_api.client.get("/v1/usage?from=2027-01-16&to=2027-01-15&group_by=kind")
    assert empty.status_code == 200 and empty.json()["items"] == []
    # And a bare date is that day's midnight UTC
    ok = await keyed_api.client.get("/v1/usage?from=2027-01-15&to=2027-01-16T00:00:00%2B00:00")
    assert ok.status_code == 200, ok.text
    assert ok.json()["from"] == "2027-01-15T00:00:00.000Z"
    assert ok.json()["items"] == [
        {"attempts": 0, "waiting_s": 0.0, "loading_s": 0.0, "generating_s": 0.0,
         "gpu_seconds": 0.0}
    ]  # fmt: skip


async def test_a_tenant_key_may_not_group_usage_by_worker(working_api: ApiUnderTest) -> None:
    # Given an attempt of alice's, run by the API's worker
    await _run(working_api, "alice's fox")
    # When alice asks for her usage by worker, alone or with other keys
    for group_by in ("worker", "kind,worker"):
        refused = await working_api.client.get(f"/v1/usage?group_by={group_by}")
        # Then she is refused: worker ids are the deployment's, not a tenant's
        assert_error(refused, 403, "forbidden")
    # And by anything else she still sees her own
    mine = await working_api.client.get("/v1/usage?group_by=kind,pool")
    assert mine.status_code == 200 and mine.json()["items"][0]["attempts"] == 1
    # And the admin sees the worker that ran it
    every = await working_api.client.get("/v1/usage?group_by=worker", headers=bearer(ADMIN_KEY))
    (item,) = every.json()["items"]
    assert item["worker"].count(":") >= 2 and item["attempts"] == 1


async def test_without_keys_usage_may_be_grouped_by_worker(api: ApiUnderTest) -> None:
    answer = await api.client.get("/v1/usage?group_by=worker")
    assert answer.status_code == 200 and answer.json()["group_by"] == ["worker"]
