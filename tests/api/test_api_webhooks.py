"""POST /v1/tasks with a webhook: stored and shown with the task, refused with 422 and
nothing stored when bad, part of the idempotency fingerprint; the webhook metrics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import ApiUnderTest, assert_error, image_body, make_kiln, running_api

from images import png
from kiln import transform
from kiln.api.schemas import TaskOut
from kiln.config import Settings
from kiln.webhooks import Dispatcher

HOOK_URL = "https://hooks.example.com/kiln?token=abc"


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API with image.generate and image.transform, no workers."""
    app = make_kiln(settings)
    transform.register(app)
    async with running_api(settings, kiln_app=app) as under_test:
        yield under_test


async def test_a_task_shows_the_webhook_it_was_submitted_with(api: ApiUnderTest) -> None:
    # When a task is submitted with a webhook for two events, and one without
    response = await api.submit(
        image_body(webhook_url=HOOK_URL, webhook_events=["uploaded", "claim"])
    )
    plain = await api.submit(image_body("another fox"))
    # Then the task shows its webhook, events in one order, and reads back the same
    assert response.status_code == 201, response.text
    webhook = {"url": HOOK_URL, "events": ["claim", "uploaded"]}
    assert response.json()["webhook"] == webhook
    TaskOut.model_validate(response.json())
    again = await api.client.get(f"/v1/tasks/{response.json()['id']}")
    assert again.json()["webhook"] == webhook
    # And a task without one shows null
    assert plain.status_code == 201 and plain.json()["webhook"] is None


async def test_final_events_are_the_default(api: ApiUnderTest) -> None:
    response = await api.submit(image_body(webhook_url=HOOK_URL))
    assert response.json()["webhook"] == {"url": HOOK_URL, "events": ["final"]}


@pytest.mark.parametrize(
    "fields",
    [
        {"webhook_url": "ftp://hooks.example.com/"},
        {"webhook_url": "https://hooks.example.com/" + "a" * 2048},
        {"webhook_url": 42},
        {"webhook_url": HOOK_URL, "webhook_events": ["finished"]},
        {"webhook_url": HOOK_URL, "webhook_events": []},
        {"webhook_url": HOOK_URL, "webhook_events": "final"},
        {"webhook_events": ["final"]},
        {"webhook_url": "http://127.0.0.1:9000/hook"},
        {"webhook_url": "http://10.0.0.8/hook"},
        {"webhook_url": "http://169.254.169.254/latest"},
        {"webhook_url": "http://[::1]/hook"},
        {"webhook_url": "http://localhost/hook"},
    ],
    ids=[
        "scheme", "too-long", "not-a-string", "unknown-event", "no-events", "events-string",
        "events-without-url", "loopback", "private", "link-local", "ipv6-loopback", "localhost",
    ],
)  # fmt: skip
async def test_a_bad_webhook_is_422_and_nothing_is_stored(
    api: ApiUnderTest, fields: dict[str, Any]
) -> None:
    # When a submission carries a bad webhook (with an idempotency key)
    response = await api.submit(image_body(**fields), headers={"Idempotency-Key": "k1"})
    # Then it is refused in the error envelope, and nothing was stored
    assert_error(response, 422, "invalid_request")
    assert await api.task_count() == 0
    # And the key is still free: a good request with it makes a new task
    created = await api.submit(image_body(), headers={"Idempotency-Key": "k1"})
    assert created.status_code == 201, created.text


async def test_the_webhook_is_part_of_the_idempotency_fingerprint(api: ApiUnderTest) -> None:
    key = {"Idempotency-Key": "order-7"}
    first = await api.submit(image_body(webhook_url=HOOK_URL), headers=key)
    assert first.status_code == 201
    # The same body again is a replay
    same = await api.submit(image_body(webhook_url=HOOK_URL), headers=key)
    assert same.status_code == 200 and same.headers["Idempotent-Replayed"] == "true"
    # Another webhook, other events, or none is another body
    for other in (
        image_body(webhook_url=HOOK_URL + "&v=2"),
        image_body(webhook_url=HOOK_URL, webhook_events=["*"]),
        image_body(),
    ):
        assert_error(await api.submit(other, headers=key), 422, "idempotency_key_reused")
    assert await api.task_count() == 1


async def test_an_upload_with_a_bad_webhook_stores_neither_task_nor_input(
    api: ApiUnderTest,
) -> None:
    request = {
        "kind": "image.transform",
        "params": {"op": "resize", "width": 20, "height": 10},
        "webhook_url": "http://192.168.0.10/hook",
    }
    response = await api.client.post(
        "/v1/tasks",
        data={"request": json.dumps(request)},
        files={"image": ("fox.png", png(), "image/png")},
    )
    assert_error(response, 422, "invalid_request")
    assert await api.task_count() == 0
    assert [info.key async for info in api.kiln.storage.list("")] == []
    # And the same upload with a good webhook is taken, webhook included
    request["webhook_url"] = HOOK_URL
    taken = await api.client.post(
        "/v1/tasks",
        data={"request": json.dumps(request)},
        files={"image": ("fox.png", png(), "image/png")},
    )
    assert taken.status_code == 201, taken.text
    assert taken.json()["webhook"] == {"url": HOOK_URL, "events": ["final"]}


async def test_metrics_show_webhook_outcomes_and_what_is_pending(api: ApiUnderTest) -> None:
    # Given a task whose submit event is queued for its webhook, and one delivery counted
    await api.submit(image_body(webhook_url=HOOK_URL, webhook_events=["submit"]))
    dispatcher = Dispatcher(api.kiln, owner="metrics")
    assert await dispatcher.lead()
    await dispatcher.enqueue()
    await api.kiln.engine.store.bump("webhook_deliveries", "delivered")
    # When Prometheus scrapes
    text = (await api.client.get("/metrics")).text
    # Then the outcomes and the pending count are there
    assert 'kiln_webhook_deliveries_total{outcome="delivered"} 1.0' in text
    assert 'kiln_webhook_deliveries_total{outcome="refused"} 0.0' in text
    assert "kiln_webhook_pending 1.0" in text
