"""POST /v1/tasks/batch: many submissions, each answered on its own; on both stores."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pydantic
import pytest
from api_support import (
    ADMIN_KEY,
    BOB_KEY,
    ApiUnderTest,
    assert_error,
    bearer,
    image_body,
    running_api,
    threaded_server,
)

import kiln
from kiln import canonical, demo
from kiln.api import create_app
from kiln.api.schemas import BatchOut
from kiln.config import Settings
from kiln.limits import Rate
from kiln.models import NewTask, Timeouts
from kiln.store.postgres import PostgresStore


@contextlib.asynccontextmanager
async def api_on(
    backend: str, request: pytest.FixtureRequest, settings: Settings, workers: int = 0
) -> AsyncIterator[ApiUnderTest]:
    """The API (no keys) on a fresh SQLite file or PostgreSQL database."""
    if backend == "sqlite":
        async with running_api(settings, workers=workers) as api:
            yield api
        return
    server = request.getfixturevalue("postgres_server")
    app = kiln.App(settings=settings, store=PostgresStore(server.new_database(), clock=time.time))
    demo.register(app)
    async with app, running_api(settings, kiln_app=app, workers=workers) as api:
        yield api


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
async def store_api(
    request: pytest.FixtureRequest, settings: Settings
) -> AsyncIterator[ApiUnderTest]:
    """The API with no workers, on SQLite, then on PostgreSQL."""
    async with api_on(request.param, request, settings) as api:
        yield api


@pytest.fixture(params=BACKENDS)
async def worked_api(
    request: pytest.FixtureRequest, settings: Settings
) -> AsyncIterator[ApiUnderTest]:
    """The API with one worker, on SQLite, then on PostgreSQL."""
    async with api_on(request.param, request, settings, workers=1) as api:
        yield api


async def batch(api: ApiUnderTest, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    response = await api.client.post("/v1/tasks/batch", json={"tasks": items})
    assert response.status_code == 200, response.text
    BatchOut.model_validate(response.json())
    answers: list[dict[str, Any]] = response.json()["items"]
    assert [a["index"] for a in answers] == list(range(len(items)))
    return answers


def too_narrow(prompt: str) -> dict[str, Any]:
    """A submission whose params are refused (a width not a multiple of 8)."""
    body = image_body(prompt)
    body["params"]["width"] = 13
    return body


def mixed_items(n: int) -> list[dict[str, Any]]:
    """n items; every 10th refused (7th of each ten: bad params, 9th: unknown kind)."""
    items: list[dict[str, Any]] = []
    for i in range(n):
        if i % 10 == 7:
            items.append(too_narrow(f"fox {i}"))
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
        items = [image_body("a"), too_narrow("b"), *(image_body(p) for p in "cde")]
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


# Rerun ----------------------------------------------------------------------------------


async def rerun(api: ApiUnderTest, task_id: str, body: dict[str, Any] | None = None) -> Any:
    return await api.client.post(f"/v1/tasks/{task_id}/rerun", json=body)


async def test_rerun_makes_a_linked_task_with_the_params_changed(worked_api: ApiUnderTest) -> None:
    # Given a task that succeeded
    first = await worked_api.submit(image_body("a fox", priority=5))
    original = first.json()
    await worked_api.kiln.wait(original["id"], timeout_s=20)
    # When it is run again with another seed
    response = await rerun(worked_api, original["id"], {"params": {"seed": 9}})
    # Then a new task of the same kind is made, linked to the original
    assert response.status_code == 201, response.text
    task = response.json()
    assert task["id"] != original["id"] and task["rerun_of"] == original["id"]
    assert task["params"] == {**original["params"], "seed": 9}
    assert task["priority"] == 5 and task["kind"] == original["kind"]
    assert response.headers["location"] == f"/v1/tasks/{task['id']}"
    stored = await worked_api.kiln.get(task["id"])
    assert stored.rerun_of == original["id"] and "rerun_of" not in stored.metadata
    assert (await worked_api.client.get(f"/v1/tasks/{task['id']}")).json()["rerun_of"] == (
        original["id"]
    )
    assert original["rerun_of"] is None


async def test_an_identical_rerun_of_a_success_is_deduplicated_unless_a_new_variation(
    worked_api: ApiUnderTest,
) -> None:
    # Given a task that succeeded
    original = (await worked_api.submit(image_body("a fox"))).json()
    done = await worked_api.kiln.wait(original["id"], timeout_s=20)
    assert done.status == "SUCCESS"
    # When it is rerun unchanged (no body at all), then as a new variation
    same = await worked_api.client.post(f"/v1/tasks/{original['id']}/rerun")
    fresh = await rerun(worked_api, original["id"], {"dedup": False})
    # Then the first answers the existing task, the second makes a new one
    assert same.status_code == 200 and same.json()["deduplicated"] is True
    assert same.json()["id"] == original["id"]
    assert fresh.status_code == 201 and fresh.json()["rerun_of"] == original["id"]
    assert await worked_api.task_count() == 2


async def test_a_rerun_is_validated_like_a_submission(store_api: ApiUnderTest) -> None:
    original = (await store_api.submit(image_body("a fox"))).json()

    bad = await rerun(store_api, original["id"], {"params": {"width": 13}})
    unknown_field = await rerun(store_api, original["id"], {"params": {}, "colour": 1})
    missing = await rerun(store_api, "tsk_nope", {})

    assert_error(bad, 422, "invalid_request")
    assert_error(unknown_field, 422, "invalid_request")
    assert_error(missing, 404, "not_found")
    assert await store_api.task_count() == 1


async def test_a_tenant_can_rerun_only_its_own_tasks(keyed_api: ApiUnderTest) -> None:
    # Given a task of alice
    original = (await keyed_api.submit(image_body("a fox"))).json()
    # When bob asks to rerun it
    response = await keyed_api.client.post(
        f"/v1/tasks/{original['id']}/rerun", json={}, headers=bearer(BOB_KEY)
    )
    # Then it is not found for him, and nothing is made
    assert_error(response, 404, "not_found")
    assert await keyed_api.task_count() == 1


async def test_the_admin_reruns_any_task_for_its_tenant(keyed_api: ApiUnderTest) -> None:
    original = (await keyed_api.submit(image_body("a fox"))).json()

    response = await keyed_api.client.post(
        f"/v1/tasks/{original['id']}/rerun", json={"dedup": False}, headers=bearer(ADMIN_KEY)
    )

    assert response.status_code == 201
    made = await keyed_api.kiln.get(response.json()["id"])
    assert made.tenant == "alice" and made.rerun_of == original["id"]


async def test_a_rerun_counts_against_the_rate_limit(settings: Settings) -> None:
    limited = settings.with_(tenant_rate=Rate(per_s=0.01, burst=2))
    async with running_api(limited) as api:
        original = (await api.submit(image_body("a fox"))).json()
        first = await rerun(api, original["id"], {"params": {"seed": 1}})
        second = await rerun(api, original["id"], {"params": {"seed": 2}})
        assert first.status_code == 201
        assert_error(second, 429, "rate_limited")
        assert await api.task_count() == 2


# Idempotency keys across POST /v1/tasks and batch items


async def test_a_key_replays_between_a_submit_and_a_batch_item(store_api: ApiUnderTest) -> None:
    # Given a task submitted with a key, and another submitted as a batch item with a key
    first = await store_api.submit(image_body("single"), headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 201
    [made] = await batch(store_api, [{**image_body("in a batch"), "idempotency_key": "k-2"}])
    assert made["status"] == "created"

    # When each key comes again with the same body the other way
    [again] = await batch(store_api, [{**image_body("single"), "idempotency_key": "k-1"}])
    back = await store_api.submit(image_body("in a batch"), headers={"Idempotency-Key": "k-2"})

    # Then each is a replay of its original task, and nothing new is stored
    assert again["status"] == "replayed" and again["task"]["id"] == first.json()["id"]
    assert back.status_code == 200 and back.headers["Idempotent-Replayed"] == "true"
    assert back.json()["id"] == made["task"]["id"]
    assert await store_api.task_count() == 2


async def test_an_explicit_default_deadline_replays_as_one_left_out(
    store_api: ApiUnderTest,
) -> None:
    omitted = await store_api.submit(image_body("fox"), headers={"Idempotency-Key": "k-1"})
    given = await store_api.submit(
        image_body("fox", deadline_s=86400), headers={"Idempotency-Key": "k-1"}
    )
    assert given.status_code == 200, given.text
    assert given.headers["Idempotent-Replayed"] == "true"
    assert given.json()["id"] == omitted.json()["id"]
    # The other way round too, and another deadline is still another request
    first = await store_api.submit(
        image_body("owl", deadline_s=86400.0), headers={"Idempotency-Key": "k-2"}
    )
    again = await store_api.submit(image_body("owl"), headers={"Idempotency-Key": "k-2"})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = await store_api.submit(
        image_body("owl", deadline_s=3600), headers={"Idempotency-Key": "k-2"}
    )
    assert_error(other, 422, "idempotency_key_reused")


async def test_a_key_stored_with_an_older_fingerprint_still_replays(
    store_api: ApiUnderTest,
) -> None:
    # Given a key stored as earlier versions fingerprinted a body that left deadline_s out
    # (the default as the integer 86400)
    app = store_api.kiln
    params = app.kind("image.generate").validate(image_body("fox")["params"])
    body = {
        "kind": "image.generate", "params": params, "priority": 0, "max_attempts": 3,
        "deadline_s": 86400, "dedup": True, "timeouts": [600.0, 600.0, 120.0],
        "metadata": {}, "inputs": [],
    }  # fmt: skip
    stored = await app.engine.store.submit(
        NewTask(
            id=canonical.new_task_id(), tenant="default", kind="image.generate", params=params,
            fingerprint=canonical.digest(body), idempotency_key="k-old", dedup_key=None,
            priority=0, max_attempts=3, deadline_s=86400, timeouts=Timeouts(),
        )
    )  # fmt: skip

    # When the same request comes again, alone and as a batch item
    again = await store_api.submit(image_body("fox"), headers={"Idempotency-Key": "k-old"})
    [item] = await batch(store_api, [{**image_body("fox"), "idempotency_key": "k-old"}])

    # Then both replay the stored task
    assert again.status_code == 200 and again.json()["id"] == stored.task.id
    assert item["status"] == "replayed" and item["task"]["id"] == stored.task.id


async def test_a_batch_refuses_an_idempotency_key_header(store_api: ApiUnderTest) -> None:
    response = await store_api.client.post(
        "/v1/tasks/batch", json={"tasks": [image_body("fox")]}, headers={"Idempotency-Key": "k"}
    )
    error = assert_error(response, 422, "invalid_request")
    assert "idempotency_key" in error["message"]
    assert error["details"][0]["loc"] == ["header", "Idempotency-Key"]
    assert await store_api.task_count() == 0


class Gate:
    """Holds the check of one batch item until the test says so, at most ``limit_s``."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.reached = threading.Event()
        self.go = threading.Event()
        self.opened_in_time: bool | None = None

    def hold(self) -> None:
        if self.reached.is_set():  # once: the item is checked again when it is submitted
            return
        self.reached.set()
        self.opened_in_time = self.go.wait(self.limit_s)


def test_the_loop_answers_a_request_while_a_large_batch_is_checked(settings: Settings) -> None:
    # Given a kind whose check of the batch's last item waits until /healthz is answered
    gate = Gate(limit_s=10)

    class Gated(pydantic.BaseModel):
        n: int

        @pydantic.field_validator("n")
        @classmethod
        def _gated(cls, n: int) -> int:
            if n == 999:
                gate.hold()
            return n

    app = kiln.App(settings=settings)

    @app.task("test.gated", params=Gated)
    async def gated(ctx: Any, params: Gated) -> None:
        return None

    answered: list[str] = []
    items = [{"kind": "test.gated", "params": {"n": n}} for n in range(1000)]
    with threaded_server(create_app(app, workers=0, supervisor=False)) as url:

        def post_batch() -> None:
            response = httpx.post(f"{url}/v1/tasks/batch", json={"tasks": items}, timeout=60)
            assert response.status_code == 200, response.text
            answered.append("batch")

        batch = threading.Thread(target=post_batch)
        batch.start()
        # When /healthz is asked while the batch is being checked
        assert gate.reached.wait(30)
        assert httpx.get(f"{url}/healthz", timeout=60).status_code == 200
        answered.append("healthz")
        gate.go.set()
        batch.join(timeout=60)
    # Then it was answered then, before the batch's answer (the loop was free)
    assert gate.opened_in_time is True
    assert answered == ["healthz", "batch"]
