"""API keys, tenants and the admin key: who sees and does what."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from api_support import (
    ADMIN_KEY,
    ALICE_KEY,
    BOB_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    make_kiln,
)

from kiln.api import RedactAccessToken, create_app
from kiln.api.auth import authenticate
from kiln.config import Settings
from kiln.errors import Unauthorized


async def _alice_success(api: ApiUnderTest) -> dict[str, Any]:
    response = await api.submit(image_body("alice's fox"))
    assert response.status_code == 201, response.text
    await api.kiln.wait(response.json()["id"], timeout_s=30)
    task: dict[str, Any] = (await api.client.get(f"/v1/tasks/{response.json()['id']}")).json()
    assert task["status"] == "SUCCESS"
    return task


@pytest.mark.parametrize(
    "headers",
    [{}, bearer("not-a-key"), {"Authorization": f"Basic {ALICE_KEY}"}, {"Authorization": "Bearer"}],
    ids=["no key", "unknown key", "not bearer", "empty bearer"],
)
async def test_v1_routes_need_a_valid_key(keyed_api: ApiUnderTest, headers: dict[str, str]) -> None:
    client = keyed_api.client
    client.headers.pop("Authorization", None)
    requests = [
        client.get("/v1/tasks", headers=headers),
        client.get("/v1/tasks/tsk_x", headers=headers),
        client.post("/v1/tasks", json=image_body(), headers=headers),
        client.post("/v1/tasks/tsk_x/cancel", headers=headers),
        client.post("/v1/tasks/tsk_x/retry", headers=headers),
        client.post("/v1/tasks/tsk_x/review", json={"decision": "approve"}, headers=headers),
        client.get("/v1/tasks/tsk_x/outputs/image.png", headers=headers),
        client.get("/v1/tasks/tsk_x/events", headers=headers),
        client.get("/v1/events", headers=headers),
        client.get("/v1/stats", headers=headers),
    ]

    for request in requests:
        response = await request
        assert_error(response, 401, "unauthorized")
        assert response.headers["www-authenticate"] == "Bearer"
    assert await keyed_api.task_count() == 0


async def test_access_token_is_accepted_only_on_streams(keyed_api: ApiUnderTest) -> None:
    task = (await keyed_api.submit()).json()
    await keyed_api.client.post(f"/v1/tasks/{task['id']}/cancel")
    keyed_api.client.headers.pop("Authorization")

    stream = await keyed_api.client.get(
        f"/v1/tasks/{task['id']}/events", params={"access_token": ALICE_KEY}
    )
    plain = await keyed_api.client.get(
        f"/v1/tasks/{task['id']}", params={"access_token": ALICE_KEY}
    )

    assert stream.status_code == 200
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert_error(plain, 401, "unauthorized")


async def test_other_tenants_task_is_404_on_every_route(working_api: ApiUnderTest) -> None:
    task = await _alice_success(working_api)
    bob = bearer(BOB_KEY)
    client = working_api.client
    client.headers.pop("Authorization")

    answers = [
        await client.get(f"/v1/tasks/{task['id']}", headers=bob),
        await client.post(f"/v1/tasks/{task['id']}/cancel", headers=bob),
        await client.post(f"/v1/tasks/{task['id']}/retry", headers=bob),
        await client.get(task["result"]["outputs"][0]["url"], headers=bob),
        await client.get(f"/v1/tasks/{task['id']}/events", headers=bob),
        await client.get(f"/v1/tasks/{task['id']}/events", params={"access_token": BOB_KEY}),
    ]

    for response in answers:
        assert_error(response, 404, "not_found")
    listing = await client.get("/v1/tasks", headers=bob)
    stats = await client.get("/v1/stats", headers=bob)
    assert listing.json()["items"] == []
    assert stats.json()["counts"]["SUCCESS"] == 0
    assert stats.json()["dwell_seconds"] == {}


async def test_review_with_a_tenant_key_is_403(keyed_api: ApiUnderTest) -> None:
    task = (await keyed_api.submit()).json()

    response = await keyed_api.client.post(
        f"/v1/tasks/{task['id']}/review", json={"decision": "approve"}
    )

    assert_error(response, 403, "forbidden")


async def test_admin_sees_and_acts_on_every_tenants_tasks(keyed_api: ApiUnderTest) -> None:
    alice = (await keyed_api.submit(image_body("alice"))).json()
    bob = (await keyed_api.submit(image_body("bob"), key=BOB_KEY)).json()
    admin = bearer(ADMIN_KEY)

    listing = await keyed_api.client.get("/v1/tasks", headers=admin)
    fetched = await keyed_api.client.get(f"/v1/tasks/{bob['id']}", headers=admin)
    cancelled = await keyed_api.client.post(f"/v1/tasks/{alice['id']}/cancel", headers=admin)
    stats = await keyed_api.client.get("/v1/stats", headers=admin)

    assert {t["id"] for t in listing.json()["items"]} == {alice["id"], bob["id"]}
    assert fetched.status_code == 200
    assert cancelled.json()["status"] == "CANCELLED"
    assert stats.json()["counts"]["PENDING"] == 1 and stats.json()["counts"]["CANCELLED"] == 1


async def test_admin_submissions_belong_to_tenant_admin(keyed_api: ApiUnderTest) -> None:
    response = await keyed_api.submit(key=ADMIN_KEY)

    stored = await keyed_api.kiln.get(response.json()["id"])
    seen_by_alice = await keyed_api.client.get(f"/v1/tasks/{stored.id}")

    assert response.status_code == 201
    assert stored.tenant == "admin"
    assert_error(seen_by_alice, 404, "not_found")


async def test_tenants_have_separate_idempotency_keys_and_dedup(keyed_api: ApiUnderTest) -> None:
    headers = {"Idempotency-Key": "same-key"}
    alice = await keyed_api.submit(headers=headers)

    bob = await keyed_api.submit(key=BOB_KEY, headers=headers)

    assert alice.status_code == 201 and bob.status_code == 201
    assert alice.json()["id"] != bob.json()["id"]


async def test_without_keys_everyone_is_tenant_default(api: ApiUnderTest) -> None:
    response = await api.submit(image_body(), headers={"Authorization": "Bearer anything"})

    stored = await api.kiln.get(response.json()["id"])

    assert response.status_code == 201
    assert stored.tenant == "default"


def test_keys_map_to_their_tenants(settings: Settings) -> None:
    keyed = settings.with_(api_keys={"a-key": "alice"}, admin_key="root-key")

    alice = authenticate(keyed, "a-key")
    admin = authenticate(keyed, "root-key")

    assert (alice.tenant, alice.scope, alice.may_review) == ("alice", "alice", False)
    assert (admin.tenant, admin.scope, admin.may_review) == ("admin", None, True)
    with pytest.raises(Unauthorized):
        authenticate(keyed, "a-key ")
    with pytest.raises(Unauthorized):
        authenticate(keyed, None)


@pytest.mark.parametrize(
    "changes",
    [{"api_keys": {"k": "admin"}}, {"api_keys": {"k": "alice"}, "admin_key": "k"}],
    ids=["reserved tenant", "admin key reused"],
)
def test_server_refuses_to_start_with_unsafe_keys(
    settings: Settings, changes: dict[str, Any]
) -> None:
    app = make_kiln(settings)

    with pytest.raises(ValueError):
        create_app(app, settings=settings.with_(**changes))


def test_access_tokens_are_redacted_from_request_lines() -> None:
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", f"/v1/events?after=3&access_token={ALICE_KEY}", "1.1", 200),
        None,
    )  # fmt: skip

    RedactAccessToken().filter(record)

    line = record.getMessage()
    assert ALICE_KEY not in line
    assert "access_token=[redacted]" in line and "after=3" in line


def test_create_app_installs_the_redaction_on_uvicorn_loggers(settings: Settings) -> None:
    create_app(make_kiln(settings))

    for name in ("uvicorn.access", "uvicorn.error"):
        filters = logging.getLogger(name).filters
        assert sum(isinstance(f, RedactAccessToken) for f in filters) == 1
