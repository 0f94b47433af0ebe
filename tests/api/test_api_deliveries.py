"""GET /v1/tasks/{id}/webhooks and POST .../webhooks/{delivery_id}/redeliver, on SQLite and
PostgreSQL: a tenant sees its own task's deliveries (404 for another's), the admin alone
sends one again, with the same webhook-id, to a real receiver on 127.0.0.1; a refusal
changes nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from api_support import (
    ADMIN_KEY,
    ALICE_KEY,
    BOB_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    running_api,
    with_keys,
)
from standardwebhooks import Webhook

from integration.webhook_receiver import Receiver, receiving
from kiln.api.schemas import DeliveriesOut, DeliveryOut
from kiln.config import Settings
from kiln.store.outbox import WebhookDelivery
from kiln.webhooks import Dispatcher
from services.postgres import PostgresServer

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """Keys for alice, bob and the admin; receivers on 127.0.0.1; fast retries; the store
    on SQLite or on a fresh PostgreSQL database."""
    settings = with_keys(settings).with_(
        webhook_secret=SECRET, webhook_allow_private=True, webhook_retry_base_s=0.01,
        webhook_retry_max_s=0.02, webhook_timeout_s=5.0,
    )  # fmt: skip
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        settings = settings.with_(database_url=server.new_database())
    return settings


@pytest.fixture
async def api(store_settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API (no workers, no supervisor), called as alice."""
    async with running_api(store_settings, key=ALICE_KEY) as under_test:
        yield under_test


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A receiver that answers 503 once, then 200."""
    with receiving(503) as found:
        yield found


async def dispatch(dispatcher: Dispatcher) -> None:
    """One round of the dispatcher, its deliveries awaited."""
    await dispatcher.step()
    await asyncio.gather(*dispatcher.inflight.values())


async def rows(api: ApiUnderTest, task_id: str) -> list[WebhookDelivery]:
    return await api.kiln.engine.store.outbox.deliveries(task_id=task_id)


async def a_task_with_a_tried_delivery(api: ApiUnderTest, receiver: Receiver) -> str:
    """Alice's task whose submit event was sent once and answered 503 (pending again)."""
    submitted = await api.submit(image_body(webhook_url=receiver.url, webhook_events=["submit"]))
    assert submitted.status_code == 201, submitted.text
    await dispatch(Dispatcher(api.kiln, owner="first"))
    await receiver.wait_for(1)
    return str(submitted.json()["id"])


async def test_a_tenant_sees_its_tasks_deliveries_and_how_they_went(
    api: ApiUnderTest, receiver: Receiver
) -> None:
    # Given a task whose delivery was answered 503 once
    task_id = await a_task_with_a_tried_delivery(api, receiver)
    # When alice lists the task's deliveries
    response = await api.client.get(f"/v1/tasks/{task_id}/webhooks")
    # Then she sees the one delivery, pending, one attempt, its answer and next try
    assert response.status_code == 200, response.text
    body = DeliveriesOut.model_validate(response.json())
    assert body.task_id == task_id and body.webhook is not None
    [item] = body.items
    [row] = await rows(api, task_id)
    assert (item.id, item.event_id, item.task_id, item.event) == (
        row.event_id, row.event_id, task_id, "submit",
    )  # fmt: skip
    assert (item.status, item.attempts, item.last_response_status) == ("pending", 1, 503)
    assert item.last_error == "the receiver answered 503"
    assert item.url == receiver.url and item.seq == row.seq
    assert item.next_attempt_at is not None
    assert abs(item.next_attempt_at.timestamp() - row.next_attempt_at) < 0.002
    # And the id is the one the receiver got as webhook-id
    assert receiver.received[0].headers["webhook-id"] == item.id


async def test_a_task_without_a_webhook_lists_no_deliveries(api: ApiUnderTest) -> None:
    task_id = (await api.submit(image_body())).json()["id"]
    response = await api.client.get(f"/v1/tasks/{task_id}/webhooks")
    assert response.json() == {"task_id": task_id, "webhook": None, "items": []}


@pytest.mark.parametrize(
    "path",
    ["/v1/tasks/tsk_00000000000000000000000000/webhooks", "/v1/tasks/not-a-task/webhooks",
     "/v1/tasks/%20/webhooks"],
    ids=["unknown", "malformed", "blank"],
)  # fmt: skip
async def test_an_unknown_task_is_404_in_the_error_envelope(api: ApiUnderTest, path: str) -> None:
    assert_error(await api.client.get(path), 404, "not_found")


async def test_another_tenant_gets_404_and_the_admin_sees_every_tenants(
    api: ApiUnderTest, receiver: Receiver
) -> None:
    task_id = await a_task_with_a_tried_delivery(api, receiver)
    path = f"/v1/tasks/{task_id}/webhooks"
    assert_error(await api.client.get(path, headers=bearer(BOB_KEY)), 404, "not_found")
    assert_error(await api.client.get(path, headers=bearer("nope")), 401, "unauthorized")
    admin = await api.client.get(path, headers=bearer(ADMIN_KEY))
    assert admin.status_code == 200 and len(admin.json()["items"]) == 1


async def test_refused_redeliveries_change_nothing(api: ApiUnderTest, receiver: Receiver) -> None:
    # Given a task whose delivery was tried once, and bob's task
    task_id = await a_task_with_a_tried_delivery(api, receiver)
    [before] = await rows(api, task_id)
    bobs = (await api.submit(image_body("bob's fox"), key=BOB_KEY)).json()["id"]
    redeliver = f"/v1/tasks/{task_id}/webhooks/{before.event_id}/redeliver"
    # When alice (not the admin) asks, or the admin names a wrong task or delivery
    refusals = [
        (await api.client.post(redeliver), 403, "forbidden"),
        (await api.client.post(redeliver, headers=bearer(BOB_KEY)), 403, "forbidden"),
        (await api.client.post(redeliver, headers={"Authorization": ""}), 401, "unauthorized"),
        (
            await api.client.post(
                f"/v1/tasks/{bobs}/webhooks/{before.event_id}/redeliver", headers=bearer(ADMIN_KEY)
            ),
            404, "not_found",
        ),
        (
            await api.client.post(
                f"/v1/tasks/{task_id}/webhooks/{task_id}:99/redeliver", headers=bearer(ADMIN_KEY)
            ),
            404, "not_found",
        ),
        (
            await api.client.post(
                "/v1/tasks/tsk_00000000000000000000000000/webhooks/x:1/redeliver",
                headers=bearer(ADMIN_KEY),
            ),
            404, "not_found",
        ),
    ]  # fmt: skip
    # Then each is refused in the envelope, and the delivery is as it was
    for response, status, code in refusals:
        assert_error(response, status, code)
    assert await rows(api, task_id) == [before]
    assert await api.kiln.engine.store.outbox.deliveries(task_id=bobs) == []


async def test_the_admin_redelivers_a_delivered_webhook_with_the_same_id(
    api: ApiUnderTest, receiver: Receiver
) -> None:
    # Given a delivery answered 503, then delivered on its retry
    task_id = await a_task_with_a_tried_delivery(api, receiver)
    dispatcher = Dispatcher(api.kiln, owner="first")
    deadline = time.monotonic() + 10
    while (await rows(api, task_id))[0].status != "delivered":
        assert time.monotonic() < deadline, "the retry was not delivered"
        await dispatch(dispatcher)
        await asyncio.sleep(0.01)
    [delivered] = await rows(api, task_id)
    assert delivered.attempts == 2
    # When the admin redelivers it
    response = await api.client.post(
        f"/v1/tasks/{task_id}/webhooks/{delivered.event_id}/redeliver", headers=bearer(ADMIN_KEY)
    )
    # Then the answer is the delivery, pending and due now, its history kept
    assert response.status_code == 200, response.text
    item = DeliveryOut.model_validate(response.json())
    assert (item.id, item.status, item.attempts, item.last_response_status) == (
        delivered.event_id, "pending", 2, 200,
    )  # fmt: skip
    assert item.next_attempt_at is not None
    assert abs(item.next_attempt_at.timestamp() - time.time()) < 60
    # When the dispatcher runs
    await dispatch(dispatcher)
    requests = await receiver.wait_for(3)
    # Then the receiver gets the same message again: same webhook-id, same body, verified
    assert len(requests) == 3
    assert len({r.headers["webhook-id"] for r in requests}) == 1
    assert len({r.body for r in requests}) == 1
    assert Webhook(SECRET).verify(requests[-1].body, requests[-1].headers)["task_id"] == task_id
    listed = (await api.client.get(f"/v1/tasks/{task_id}/webhooks")).json()["items"]
    assert [(i["status"], i["attempts"], i["next_attempt_at"]) for i in listed] == [
        ("delivered", 3, None)
    ]


async def test_a_redelivery_past_the_last_attempt_gets_one_more_attempt(
    store_settings: Settings,
) -> None:
    # Given a delivery that failed its 2 allowed attempts
    settings = store_settings.with_(webhook_max_attempts=2)
    with receiving(500, 500, 500) as receiver:
        async with running_api(settings, key=ALICE_KEY) as api:
            task_id = await a_task_with_a_tried_delivery(api, receiver)
            dispatcher = Dispatcher(api.kiln, owner="first")
            deadline = time.monotonic() + 10
            while (await rows(api, task_id))[0].status != "failed":
                assert time.monotonic() < deadline, "the delivery did not fail"
                await dispatch(dispatcher)
                await asyncio.sleep(0.01)
            [failed] = await rows(api, task_id)
            assert failed.attempts == 2 and "attempt 2 of 2: gave up" in str(failed.last_error)
            redeliver = f"/v1/tasks/{task_id}/webhooks/{failed.event_id}/redeliver"
            # When the admin redelivers it and the receiver fails it again
            again = await api.client.post(redeliver, headers=bearer(ADMIN_KEY))
            assert again.json()["status"] == "pending"
            await dispatch(dispatcher)
            # Then that one attempt is all it gets: failed again, no retry planned
            [row] = await rows(api, task_id)
            assert (row.status, row.attempts) == ("failed", 3)
            assert "attempt 3 past the 2 allowed: gave up" in str(row.last_error)
            # And a redelivery the receiver takes is delivered
            await api.client.post(redeliver, headers=bearer(ADMIN_KEY))
            await dispatch(dispatcher)
            [row] = await rows(api, task_id)
            assert (row.status, row.attempts, row.response_status) == ("delivered", 4, 200)
            assert len(receiver.received) == 4


async def test_without_keys_anyone_may_list_and_redeliver(
    settings: Settings, receiver: Receiver
) -> None:
    open_settings = settings.with_(webhook_allow_private=True)
    async with running_api(open_settings) as api:
        task_id = await a_task_with_a_tried_delivery(api, receiver)
        [row] = await rows(api, task_id)
        listed = await api.client.get(f"/v1/tasks/{task_id}/webhooks")
        again = await api.client.post(f"/v1/tasks/{task_id}/webhooks/{row.event_id}/redeliver")
    assert listed.status_code == 200 and again.status_code == 200, again.text


async def test_the_routes_are_in_the_openapi_document(api: ApiUnderTest) -> None:
    paths = (await api.client.get("/openapi.json")).json()["paths"]
    listing = paths["/v1/tasks/{task_id}/webhooks"]["get"]
    redeliver = paths["/v1/tasks/{task_id}/webhooks/{delivery_id}/redeliver"]["post"]
    assert listing["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/DeliveriesOut"
    }
    assert {"403", "404"} <= set(redeliver["responses"])
