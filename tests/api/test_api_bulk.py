"""POST /v1/tasks/batch: many submissions, each answered on its own; on both stores."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import ApiUnderTest, assert_error, image_body, running_api

import kiln
from kiln import demo
from kiln.api.schemas import BatchOut
from kiln.config import Settings
from kiln.limits import Rate
from kiln.store.postgres import PostgresStore


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store_api(
    request: pytest.FixtureRequest, settings: Settings
) -> AsyncIterator[ApiUnderTest]:
    """The API (no keys, no workers) on SQLite, then on PostgreSQL."""
    if request.param == "sqlite":
        async with running_api(settings) as api:
            yield api
        return
    server = request.getfixturevalue("postgres_server")
    store = PostgresStore(server.new_database(), clock=time.time)
    app = kiln.App(settings=settings, store=store)
    demo.register(app)
    async with app, running_api(settings, kiln_app=app) as api:
        yield api


async def batch(api: ApiUnderTest, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    response = await api.client.post("/v1/tasks/batch", json={"tasks": items})
    assert response.status_code == 200, response.text
    BatchOut.model_validate(response.json())
    answers: list[dict[str, Any]] = response.json()["items"]
    assert [a["index"] for a in answers] == list(range(len(items)))
    return answers


def mixed_items(n: int) -> list[dict[str, Any]]:
    """n items; every 10th refused (7th of each ten: bad params, 9th: unknown kind)."""
    items: list[dict[str, Any]] = []
    for i in range(n):
        if i % 10 == 7:
            items.append(image_body(f"fox {i}", width=13))
        elif i % 10 == 9:
            items.append({"kind": "no.such.kind", "params": {}})
        else:
            items.append({**image_body(f"fox {i}"), "idempotency_key": f"k-{i}"})
    return items


async def test_a_thousand_items_with_refusals_store_the_others_exactly_once(
    store_api: ApiUnderTest,
) -> None:
    # Given 1,000 submissions, 200 of them not valid
    items = mixed_items(1000)
    # When they are sent in one batch
    started = time.perf_counter()
    answers = await batch(store_api, items)
    elapsed_s = time.perf_counter() - started
    print(f"1000-item batch: {elapsed_s:.2f} s")
    # Then the refused ones say why and store nothing, the others are created once
    statuses = [a["status"] for a in answers]
    assert statuses.count("refused") == 200 and statuses.count("created") == 800
    for answer in answers:
        if answer["index"] % 10 == 7:
            assert answer["error"]["code"] == "invalid_request" and answer["task"] is None
        elif answer["index"] % 10 == 9:
            assert answer["error"]["code"] == "unknown_kind"
        else:
            assert answer["error"] is None and answer["task"]["status"] == "PENDING"
    ids = {a["task"]["id"] for a in answers if a["task"]}
    assert len(ids) == 800 and await store_api.task_count() == 800
    # And replaying the same batch creates nothing new
    again = await batch(store_api, items)
    assert [a["status"] for a in again if a["task"]] == ["replayed"] * 800
    assert {a["task"]["id"] for a in again if a["task"]} == ids
    assert await store_api.task_count() == 800


async def test_content_dedup_and_key_reuse_are_answered_per_item(store_api: ApiUnderTest) -> None:
    # Given a task already submitted under a key
    first = await store_api.submit(image_body("a heron"), headers={"Idempotency-Key": "h"})
    assert first.status_code == 201
    # When a batch repeats its content without a key, reuses the key with another body,
    # and holds the same new submission twice
    answers = await batch(store_api, [
        image_body("a heron"),
        {**image_body("an egret"), "idempotency_key": "h"},
        image_body("a crane"),
        image_body("a crane"),
    ])  # fmt: skip
    # Then each item is answered as POST /v1/tasks would answer it
    assert answers[0]["status"] == "deduplicated"
    assert answers[0]["task"]["id"] == first.json()["id"] and answers[0]["task"]["deduplicated"]
    assert answers[1]["status"] == "refused"
    assert answers[1]["error"]["code"] == "idempotency_key_reused"
    assert sorted(a["status"] for a in answers[2:]) == ["created", "deduplicated"]
    assert answers[2]["task"]["id"] == answers[3]["task"]["id"]
    assert await store_api.task_count() == 2


@pytest.mark.parametrize("count", [0, 1001])
async def test_an_empty_or_oversized_batch_is_422_and_stores_nothing(
    api: ApiUnderTest, count: int
) -> None:
    items = [image_body(f"fox {i}") for i in range(count)]

    response = await api.client.post("/v1/tasks/batch", json={"tasks": items})

    assert_error(response, 422, "invalid_request")
    assert await api.task_count() == 0


async def test_a_rate_limit_refuses_the_remaining_items(settings: Settings) -> None:
    # Given a tenant that may submit 3 tasks in a burst
    limited = settings.with_(tenant_rate=Rate(per_s=0.01, burst=3))
    async with running_api(limited) as api:
        # When it sends a batch of 5, one of them not valid
        items = [image_body("a"), image_body("b", width=3), *(image_body(p) for p in "cde")]
        answers = await batch(api, items)
        # Then each valid item takes a token, and those past the limit are refused
        assert [a["status"] for a in answers] == [
            "created",
            "refused",
            "created",
            "created",
            "refused",
        ]
        assert answers[1]["error"]["code"] == "invalid_request"
        assert answers[4]["error"]["code"] == "rate_limited"
        assert await api.task_count() == 3


async def test_a_batch_that_is_not_a_list_of_objects_is_422(api: ApiUnderTest) -> None:
    for body in ({}, {"tasks": "x"}, {"tasks": [1]}, {"tasks": [], "extra": 1}):
        response = await api.client.post("/v1/tasks/batch", json=body)
        assert_error(response, 422, "invalid_request")
