"""Exact answers to bad input: strict params, finite and shallow JSON, cursors, filters.

Every refusal is the error envelope, names the field (or the setting that would allow
it), stores nothing, and leaves the server serving.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from api_support import (
    ADMIN_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    live_server,
    running_api,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from kiln.config import Settings
from kiln.errors import InvalidRequest
from kiln.models import NewTask, Timeouts


async def assert_still_serving(api: ApiUnderTest, stored: int = 0) -> None:
    assert await api.task_count() == stored
    assert (await api.client.get("/healthz")).status_code == 200
    assert (await api.client.get("/v1/tasks")).status_code == 200


def raw_body(text: str) -> dict[str, Any]:
    return {"content": text.encode(), "headers": {"Content-Type": "application/json"}}


# Strict params ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", True),
        ("steps", "30"),
        ("width", "512"),
        ("seed", False),
        ("prompt", 7),
    ],
)
async def test_params_are_validated_strictly_and_the_error_names_the_field(
    api: ApiUnderTest, field: str, value: Any
) -> None:
    # Given a params object with a value of the wrong JSON type
    body = image_body()
    body["params"][field] = value

    # When it is submitted
    response = await api.submit(body)

    # Then it is refused, naming params.<field>, and nothing is stored
    error = assert_error(response, 422, "invalid_request")
    assert f"params.{field}" in error["message"]
    assert ["params", field] in [d["loc"] for d in error["details"]]
    await assert_still_serving(api)


async def test_a_nested_param_is_strict_too(api: ApiUnderTest) -> None:
    body = image_body()
    body["params"]["simulate"] = {"step_ms": 0, "review": 1}
    error = assert_error(await api.submit(body), 422, "invalid_request")
    assert "params.simulate.review" in error["message"]
    await assert_still_serving(api)


async def test_an_integral_number_still_counts_as_an_integer(api: ApiUnderTest) -> None:
    body = image_body()
    body["params"]["steps"] = 4.0
    response = await api.submit(body)
    assert response.status_code == 201, response.text
    assert response.json()["params"]["steps"] == 4


# Finite numbers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"kind": "image.generate", "params": {"prompt": "fox"}, "metadata": {"a": 1e400}}',
        '{"kind": "image.generate", "params": {"prompt": "fox"}, "metadata": {"a": -1e400}}',
        '{"kind": "image.generate", "params": {"prompt": "fox"}, "metadata": {"a": NaN}}',
        '{"kind": "image.generate", "params": {"prompt": "fox"}, "metadata": [Infinity]}',
        '{"kind": "image.generate", "params": {"prompt": "fox", "steps": 1e999}}',
        '{"kind": "image.generate", "params": {"prompt": "fox"}, "deadline_s": 1e400}',
    ],
)
async def test_a_non_finite_number_anywhere_is_422_and_nothing_is_stored(
    api: ApiUnderTest, text: str
) -> None:
    response = await api.client.post("/v1/tasks", **raw_body(text))
    error = assert_error(response, 422, "invalid_request")
    assert "finite" in error["message"] or "not valid JSON" in error["message"]
    await assert_still_serving(api)


async def test_admin_listing_survives_a_stored_task_that_cannot_be_rendered(
    keyed_api: ApiUnderTest,
) -> None:
    # Given a task stored (past the API) with a non-finite number in its metadata
    good = await keyed_api.submit(image_body("a good fox"))
    assert good.status_code == 201
    bad = NewTask(
        id="tsk_0000000000000000000000000b", tenant="alice", kind="image.generate",
        params={"prompt": "fox"}, fingerprint="x", idempotency_key=None, dedup_key=None,
        priority=0, max_attempts=3, deadline_s=3600, timeouts=Timeouts(),
        metadata={"a": float("inf"), "b": float("nan")}, inputs=[], webhook=None,
    )  # fmt: skip
    await keyed_api.kiln.engine.store.submit(bad)

    # When the tenant, and the admin, list tasks and read the task
    mine = await keyed_api.client.get("/v1/tasks")
    everyone = await keyed_api.client.get("/v1/tasks", headers=bearer(ADMIN_KEY))
    one = await keyed_api.client.get(f"/v1/tasks/{bad.id}")

    # Then every answer renders, the bad numbers as null
    assert mine.status_code == 200, mine.text
    assert everyone.status_code == 200, everyone.text
    assert len(mine.json()["items"]) == 2
    assert one.status_code == 200, one.text
    assert one.json()["metadata"] == {"a": None, "b": None}


# Nesting depth ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [65, 900, 950, 5000])
async def test_metadata_nested_too_deep_is_422_naming_the_limit(
    api: ApiUnderTest, depth: int
) -> None:
    nested = "[" * depth + "]" * depth
    start = '{"kind": "image.generate", "params": {"prompt": "fox"}, "metadata": {"a": '
    text = f"{start}{nested}}}}}"
    response = await api.client.post("/v1/tasks", **raw_body(text))
    error = assert_error(response, 422, "invalid_request")
    assert "deep" in error["message"] or "nest" in error["message"]
    await assert_still_serving(api)


async def test_metadata_nested_within_the_limit_is_taken(api: ApiUnderTest) -> None:
    metadata: Any = {"leaf": 1}
    for _ in range(40):
        metadata = {"a": metadata}
    response = await api.submit({**image_body(), "metadata": metadata})
    assert response.status_code == 201, response.text


# Cursors and filters ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "cursor", ["garbage", "tsk_", "tsk_0000000000000000000000000!", "x" * 300, "tsk_ILOU" * 7]
)
async def test_a_malformed_cursor_is_422_invalid_cursor(api: ApiUnderTest, cursor: str) -> None:
    response = await api.client.get("/v1/tasks", params={"cursor": cursor})
    error = assert_error(response, 422, "invalid_cursor")
    assert "cursor" in error["message"]


async def test_a_cursor_from_a_page_still_pages(api: ApiUnderTest) -> None:
    for i in range(3):
        assert (await api.submit(image_body(f"fox {i}"))).status_code == 201
    first = (await api.client.get("/v1/tasks", params={"limit": 2})).json()
    assert first["next_cursor"]
    second = await api.client.get("/v1/tasks", params={"limit": 2, "cursor": first["next_cursor"]})
    assert second.status_code == 200
    assert len(second.json()["items"]) == 1


@pytest.mark.parametrize("status", ["pending", "Pending", "PENDING", " pending "])
async def test_the_status_filter_takes_any_case(api: ApiUnderTest, status: str) -> None:
    assert (await api.submit()).status_code == 201
    response = await api.client.get("/v1/tasks", params={"status": status})
    assert response.status_code == 200, response.text
    assert [t["status"] for t in response.json()["items"]] == ["PENDING"]


async def test_an_unknown_status_is_still_422(api: ApiUnderTest) -> None:
    response = await api.client.get("/v1/tasks", params={"status": "sleeping"})
    assert_error(response, 422, "invalid_request")


async def test_the_library_refuses_metadata_that_would_not_render(api: ApiUnderTest) -> None:
    with pytest.raises(InvalidRequest, match="metadata"):
        await api.kiln.submit("image.generate", {"prompt": "fox"}, metadata={"a": math.inf})
    with pytest.raises(InvalidRequest, match="params"):
        await api.kiln.submit("image.generate", {"prompt": "fox", "steps": math.nan})
    assert await api.task_count() == 0


# Resume points ---------------------------------------------------------------------------

TOO_BIG = [str(2**63), str(2**64), "9" * 40]


@pytest.mark.parametrize("value", TOO_BIG)
async def test_a_resume_point_past_64_bits_is_422_before_the_store(
    api: ApiUnderTest, value: str
) -> None:
    task = (await api.submit()).json()
    for url in (f"/v1/tasks/{task['id']}/events", "/v1/events"):
        by_query = await api.client.get(url, params={"after": value})
        by_header = await api.client.get(url, headers={"Last-Event-ID": value})
        assert "after" in assert_error(by_query, 422, "invalid_request")["details"][0]["loc"]
        assert "Last-Event-ID" in assert_error(by_header, 422, "invalid_request")["message"]
    assert (await api.client.get("/healthz")).status_code == 200


async def test_the_largest_resume_point_is_taken(api: ApiUnderTest) -> None:
    task = (await api.submit()).json()
    await api.client.post(f"/v1/tasks/{task['id']}/cancel")
    response = await api.client.get(
        f"/v1/tasks/{task['id']}/events", params={"after": str(2**63 - 1)}
    )
    assert response.status_code == 200


async def test_a_websocket_resume_point_past_64_bits_is_closed_4422(settings: Settings) -> None:
    async with running_api(settings) as api, live_server(api.http) as url:
        task = (await api.submit()).json()
        ws_url = url.replace("http", "ws") + f"/v1/tasks/{task['id']}/ws?after={2**64}"
        async with connect(ws_url) as ws:
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 4422


# Limits name their settings --------------------------------------------------------------


async def test_a_body_over_the_limit_is_413_naming_the_setting(settings: Settings) -> None:
    async with running_api(settings.with_(max_body_bytes=1000)) as api:
        body = {**image_body(), "metadata": {"note": "x" * 2000}}
        error = assert_error(await api.submit(body), 413, "payload_too_large")
        assert "KILN_MAX_BODY_BYTES" in error["message"]
        assert await api.task_count() == 0
