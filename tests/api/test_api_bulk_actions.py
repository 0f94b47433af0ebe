"""POST /v1/tasks/cancel and /v1/tasks/retry: bulk actions by filter, over HTTP (auth,
tenants, the error envelope on bad input)."""

from __future__ import annotations

from typing import Any

from api_support import ADMIN_KEY, BOB_KEY, ApiUnderTest, assert_error, bearer, image_body


async def submit_pending(
    api: ApiUnderTest, n: int, prefix: str, key: str | None = None
) -> list[str]:
    ids = []
    for i in range(n):
        response = await api.submit(image_body(f"{prefix} {i}"), key=key)
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    return ids


async def statuses(api: ApiUnderTest, ids: list[str]) -> list[str]:
    found = []
    for task_id in ids:
        task = await api.kiln.get(task_id)
        found.append(str(task.status))
    return found


async def test_a_tenant_acts_on_its_own_tasks_and_the_admin_across_tenants(
    keyed_api: ApiUnderTest,
) -> None:
    # Given alice's three pending tasks and bob's two
    alice = await submit_pending(keyed_api, 3, "alice fox")
    bob = await submit_pending(keyed_api, 2, "bob fox", key=BOB_KEY)
    pending = {"filter": {"status": ["PENDING"]}}
    # When alice counts, then cancels by filter
    dry = await keyed_api.client.post("/v1/tasks/cancel", json={**pending, "dry_run": True})
    assert dry.status_code == 200, dry.text
    assert (dry.json()["matched"], dry.json()["cancelled"]) == (3, 0)
    done = await keyed_api.client.post("/v1/tasks/cancel", json=pending)
    # Then her tasks are cancelled, bob's are not
    body = done.json()
    assert (body["matched"], body["cancelled"], body["skipped"], body["cursor"]) == (3, 3, 0, None)
    assert sorted(body["task_ids"]) == sorted(alice)
    assert await statuses(keyed_api, alice) == ["CANCELLED"] * 3
    assert await statuses(keyed_api, bob) == ["PENDING"] * 2
    # And alice may not name bob's tenant
    other = {"filter": {"status": ["PENDING"], "tenant": "bob"}}
    assert_error(await keyed_api.client.post("/v1/tasks/cancel", json=other), 403, "forbidden")
    assert await statuses(keyed_api, bob) == ["PENDING"] * 2
    # When the admin narrows to bob, then acts across tenants
    admin = bearer(ADMIN_KEY)
    counted = await keyed_api.client.post(
        "/v1/tasks/cancel", json={**other, "dry_run": True}, headers=admin
    )
    assert counted.json()["matched"] == 2
    retried = await keyed_api.client.post(
        "/v1/tasks/retry", json={"filter": {"status": ["CANCELLED"]}}, headers=admin
    )
    # Then alice's cancelled tasks are retried (RETRYING, one more attempt allowed)
    assert retried.status_code == 200, retried.text
    assert (retried.json()["retried"], retried.json()["matched"]) == (3, 3)
    assert await statuses(keyed_api, alice) == ["RETRYING"] * 3


async def test_pages_resume_from_the_cursor_with_the_filter_the_server_resolved(
    api: ApiUnderTest,
) -> None:
    # Given five pending tasks
    ids = await submit_pending(api, 5, "paged fox")
    ask: dict[str, Any] = {
        "filter": {"created_after": "1h", "kind": ["image.generate"]},
        "limit": 2,
    }
    # When a cancel goes page by page, sending back the cursor and the resolved filter
    pages = []
    while True:
        response = await api.client.post("/v1/tasks/cancel", json=ask)
        assert response.status_code == 200, response.text
        page = response.json()
        pages.append(page)
        if page["cursor"] is None:
            break
        ask = {**ask, "cursor": page["cursor"], "filter": page["filter"]}
    # Then the pages took 2, 2 and 1 tasks, each once, and the relative time became a moment
    assert [p["cancelled"] for p in pages] == [2, 2, 1]
    assert sorted(i for p in pages for i in p["task_ids"]) == sorted(ids)
    assert isinstance(pages[0]["filter"]["created_after"], float)
    assert pages[0]["filter"]["kind"] == ["image.generate"]


async def test_bad_input_is_refused_with_the_envelope_and_changes_nothing(
    keyed_api: ApiUnderTest,
) -> None:
    ids = await submit_pending(keyed_api, 2, "kept fox")
    post = keyed_api.client.post
    bad: list[tuple[str, Any, int, str]] = [
        ("cancel", {}, 422, "invalid_request"),  # empty filter without "all"
        ("cancel", {"filter": {}}, 422, "invalid_request"),
        ("cancel", {"filter": {"status": ["PENDING"]}, "nope": 1}, 422, "invalid_request"),
        ("cancel", {"filter": {"status": "PENDING"}}, 422, "invalid_request"),
        ("cancel", {"filter": {"status": ["SUCCESS"]}}, 422, "invalid_request"),
        ("retry", {"filter": {"status": ["PENDING"]}}, 422, "invalid_request"),
        ("cancel", {"filter": {"created_after": "yesterday"}}, 422, "invalid_request"),
        ("cancel", {"filter": {"kind": ["x"]}, "limit": 0}, 422, "invalid_request"),
        ("cancel", {"filter": {"kind": ["x"]}, "cursor": "%%%"}, 422, "invalid_cursor"),
        ("cancel", [1, 2], 422, "invalid_request"),
    ]
    for action, body, status, code in bad:
        error = assert_error(await post(f"/v1/tasks/{action}", json=body), status, code)
        assert error["message"]
    not_json = await post("/v1/tasks/cancel", content=b"x", headers={"Content-Type": "text/plain"})
    assert_error(not_json, 415, "unsupported_media_type")
    no_key = await post("/v1/tasks/cancel", json={"all": True}, headers={"Authorization": ""})
    assert_error(no_key, 401, "unauthorized")
    # Then nothing changed, and the server still serves
    assert await statuses(keyed_api, ids) == ["PENDING"] * 2
    every = await post("/v1/tasks/cancel", json={"all": True, "dry_run": True})
    assert every.status_code == 200 and every.json()["matched"] == 2


async def test_a_time_that_leaves_no_task_out_needs_all(keyed_api: ApiUnderTest) -> None:
    # Given two pending tasks
    ids = await submit_pending(keyed_api, 2, "epoch fox")
    post = keyed_api.client.post
    # When a filter names only times that every task falls inside of: the epoch or before
    # (as a number or as text), or an end later than now
    everything: list[dict[str, Any]] = [
        {"created_after": 0},
        {"created_after": 0.0},
        {"created_after": -86400},
        {"created_after": "1970-01-01T00:00:00Z"},
        {"created_before": "2999-01-01T00:00:00Z"},
        {"created_after": 0, "created_before": 253402300799},
    ]
    for fields in everything:
        # Then each is refused as the empty filter is, naming the way to mean it
        response = await post("/v1/tasks/cancel", json={"filter": fields})
        error = assert_error(response, 422, "invalid_request")
        assert '"all": true' in error["message"], (fields, error)
        dry = await post("/v1/tasks/cancel", json={"filter": fields, "dry_run": True})
        assert_error(dry, 422, "invalid_request")
    # And nothing changed
    assert await statuses(keyed_api, ids) == ["PENDING"] * 2
    # When the same filter says "all": true, it acts on every task
    every = await post("/v1/tasks/cancel", json={"filter": {"created_after": 0}, "all": True})
    assert every.status_code == 200, every.text
    assert sorted(every.json()["task_ids"]) == sorted(ids)
    # And a time that can leave a task out still narrows without "all"
    later = await submit_pending(keyed_api, 1, "recent fox")
    recent = await post("/v1/tasks/cancel", json={"filter": {"created_after": "1h"}})
    assert recent.status_code == 200, recent.text
    assert recent.json()["task_ids"] == later
