"""The busiest requests answered before the router (kiln/api/hot_paths.py): a task read and
a JSON submission skip FastAPI's routing and answer as the routes do; everything else, and
every case those answers do not cover, goes through the full stack."""

from __future__ import annotations

from typing import Any

import pytest
from api_support import ALICE_KEY, ApiUnderTest, assert_error, bearer, image_body
from opentelemetry import metrics, trace
from starlette.routing import Router


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the requests that reached the router."""
    seen: list[str] = []
    call = Router.__call__

    async def counting(self: Router, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(scope["path"])
        await call(self, scope, receive, send)

    monkeypatch.setattr(Router, "__call__", counting)
    return seen


async def test_a_task_read_and_a_json_submission_skip_the_router(
    keyed_api: ApiUnderTest, routed: list[str]
) -> None:
    # When a task is submitted as JSON, submitted again (a dedup hit) and read
    made = await keyed_api.submit(image_body("a fox"))
    again = await keyed_api.submit(image_body("a fox"))
    read = await keyed_api.client.get(f"/v1/tasks/{made.json()['id']}")
    # Then each is answered as the routes answer
    assert made.status_code == 201 and made.headers["location"].endswith(made.json()["id"])
    assert again.status_code == 200 and again.json()["deduplicated"] is True
    assert read.status_code == 200 and read.json()["queue_position"] == 1
    # And none of them went through the router
    assert routed == []
    # While other routes do
    await keyed_api.client.get("/v1/tasks")
    assert routed == ["/v1/tasks"]


async def test_what_the_hot_paths_do_not_answer_the_router_does(
    keyed_api: ApiUnderTest, routed: list[str]
) -> None:
    # A missing key, an unknown one, an unknown task, another media type, a bad
    # Idempotency-Key: the full stack answers each, in the envelope
    client = keyed_api.client
    no_key = await client.get("/v1/tasks/tsk_x", headers={"Authorization": ""})
    assert_error(no_key, 401, "unauthorized")
    wrong = await client.post("/v1/tasks", json=image_body(), headers=bearer("key-nobody-1234"))
    assert_error(wrong, 401, "unauthorized")
    assert_error(await client.get("/v1/tasks/tsk_nope"), 404, "not_found")
    form = await client.post("/v1/tasks", content=b"kind=x", headers={"Content-Type": "text/plain"})
    assert_error(form, 415, "unsupported_media_type")
    bad_key = await keyed_api.submit(image_body(), headers={"Idempotency-Key": "tab\there"})
    assert_error(bad_key, 422, "invalid_request")
    assert len(routed) == 5
    # And the hot paths answer kiln's own errors in the envelope themselves
    invalid = await keyed_api.submit({"kind": "image.generate", "params": {"prompt": ""}})
    assert_error(invalid, 422, "invalid_request")
    not_json = await client.post(
        "/v1/tasks",
        content=b"{nope",
        headers={**bearer(ALICE_KEY), "Content-Type": "application/json"},
    )
    assert_error(not_json, 422, "invalid_request")
    assert len(routed) == 5


async def test_a_request_looks_up_no_opentelemetry_provider(
    keyed_api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given every lookup of a global OpenTelemetry provider counted
    looked: list[str] = []
    for module, name in ((trace, "get_tracer_provider"), (metrics, "get_meter_provider")):
        lookup = getattr(module, name)

        def counted(*args: Any, _name: str = name, _lookup: Any = lookup) -> Any:
            looked.append(_name)
            return _lookup(*args)

        monkeypatch.setattr(module, name, counted)
    # When requests of the hot paths and of the router are answered
    made = await keyed_api.submit(image_body("an untraced fox"))
    await keyed_api.client.get(f"/v1/tasks/{made.json()['id']}")
    await keyed_api.client.get("/healthz")
    # Then none looked for a provider (kiln traces with its own, KILN_TRACING)
    assert made.status_code == 201 and looked == []
