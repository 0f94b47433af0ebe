"""POST /v1/tasks: new tasks, replays, dedup hits, and every way a submission is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from api_support import (
    TASK_FIELDS,
    ApiUnderTest,
    assert_error,
    image_body,
    raw_request,
    running_api,
)

from kiln import canonical
from kiln.api import tasks
from kiln.api.recent import RecentContent
from kiln.api.schemas import TaskOut
from kiln.api.singleflight import SingleFlight
from kiln.config import Settings


async def test_new_task_is_201_with_location_and_the_task_json(api: ApiUnderTest) -> None:
    response = await api.submit(image_body(metadata={"user": "u1"}))

    assert response.status_code == 201
    task = response.json()
    assert response.headers["location"] == f"/v1/tasks/{task['id']}"
    assert "idempotent-replayed" not in response.headers
    assert set(task) == TASK_FIELDS
    TaskOut.model_validate(task)
    assert task["status"] == "PENDING" and task["final"] is False
    assert task["queue_position"] == 1
    assert task["attempt"] == 0 and task["max_attempts"] == 3 and task["priority"] == 0
    assert task["metadata"] == {"user": "u1"}
    assert task["inputs"] == [] and task["result"] is None and task["error"] is None
    assert task["deduplicated"] is False
    assert task["created_at"].endswith("Z")


async def test_a_new_task_is_answered_with_its_position_from_the_submit_alone(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store whose separate position reads fail
    store = api.kiln.engine.store

    async def no_read(*_: Any, **__: Any) -> Any:
        raise AssertionError("the position was read after the submit")

    monkeypatch.setattr(store, "queue_position", no_read)
    monkeypatch.setattr(store, "read_standing", no_read)
    await api.submit(image_body("first"))
    # When a task is submitted, with and without an Idempotency-Key, and replayed
    new = await api.submit(image_body("second"))
    keyed = await api.submit(image_body("third"), headers={"Idempotency-Key": "k-1"})
    replayed = await api.submit(image_body("third"), headers={"Idempotency-Key": "k-1"})
    # Then each answer's queue position came with the submit (one store call)
    assert (new.status_code, new.json()["queue_position"]) == (201, 2)
    assert (keyed.status_code, keyed.json()["queue_position"]) == (201, 3)
    assert (replayed.status_code, replayed.json()["queue_position"]) == (200, 3)


async def test_defaults_are_applied_and_timeouts_merge_with_defaults(api: ApiUnderTest) -> None:
    response = await api.submit(image_body(timeouts={"generating_s": 30}))

    assert response.status_code == 201
    stored = await api.kiln.get(response.json()["id"])
    assert stored.timeouts.waiting_s == 600
    assert stored.timeouts.generating_s == 30
    assert stored.timeouts.uploading_s == 120
    assert stored.deadline_s == 86_400
    assert stored.dedup_key is not None


async def test_same_idempotency_key_and_body_replays_the_original(api: ApiUnderTest) -> None:
    first = await api.submit(headers={"Idempotency-Key": "order-1"})

    again = await api.submit(headers={"Idempotency-Key": "order-1"})

    assert first.status_code == 201
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["idempotency_key"] == "order-1"
    assert await api.task_count() == 1


async def test_same_idempotency_key_with_another_body_is_refused(api: ApiUnderTest) -> None:
    await api.submit(image_body("first"), headers={"Idempotency-Key": "order-2"})

    response = await api.submit(image_body("second"), headers={"Idempotency-Key": "order-2"})

    assert_error(response, 422, "idempotency_key_reused")
    assert await api.task_count() == 1


async def test_identical_content_is_deduplicated_without_replay_header(api: ApiUnderTest) -> None:
    first = await api.submit(image_body(priority=1))

    again = await api.submit(image_body(priority=5))

    assert again.status_code == 200
    assert "idempotent-replayed" not in again.headers
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["deduplicated"] is True
    fetched = await api.client.get(f"/v1/tasks/{first.json()['id']}")
    assert fetched.json()["deduplicated"] is False


async def test_dedup_false_makes_a_new_task(api: ApiUnderTest) -> None:
    first = await api.submit(image_body(dedup=False))

    again = await api.submit(image_body(dedup=False))

    assert again.status_code == 201
    assert again.json()["id"] != first.json()["id"]


async def test_new_key_on_a_dedup_hit_then_replays_that_task(api: ApiUnderTest) -> None:
    first = await api.submit()
    hit = await api.submit(headers={"Idempotency-Key": "k-new"})

    replay = await api.submit(headers={"Idempotency-Key": "k-new"})

    assert hit.status_code == 200 and hit.json()["deduplicated"] is True
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.json()["id"] == first.json()["id"]


async def test_fifty_concurrent_identical_submissions_make_one_task(api: ApiUnderTest) -> None:
    responses = await asyncio.gather(*(api.submit() for _ in range(50)))

    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 49 + [201]
    assert {r.json()["id"] for r in responses} == {responses[0].json()["id"]}
    assert all(r.json()["deduplicated"] for r in responses if r.status_code == 200)
    assert not any("idempotent-replayed" in r.headers for r in responses)
    assert await api.task_count() == 1


async def test_fifty_concurrent_requests_with_one_key_make_one_task(api: ApiUnderTest) -> None:
    responses = await asyncio.gather(
        *(api.submit(headers={"Idempotency-Key": "burst"}) for _ in range(50))
    )

    created = [r for r in responses if r.status_code == 201]
    replayed = [r for r in responses if r.headers.get("idempotent-replayed") == "true"]
    assert len(created) == 1 and len(replayed) == 49
    assert await api.task_count() == 1


async def test_concurrent_answers_count_as_dedup_hits_in_the_store(api: ApiUnderTest) -> None:
    await asyncio.gather(*(api.submit() for _ in range(20)))

    counters = await api.kiln.engine.store.counters()

    assert counters.get(("dedup_hits", "content"), 0) == 19


async def test_a_bursts_copies_count_their_hits_in_a_few_writes_not_one_each(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given every write of the store counted
    store = api.kiln.engine.store
    writes: list[object] = []
    write = store._write

    async def counted(op: Any) -> Any:
        writes.append(op)
        return await write(op)

    monkeypatch.setattr(store, "_write", counted)
    # When 200 identical submissions arrive at once
    responses = await asyncio.gather(*(api.submit() for _ in range(200)))
    # Then one task answers them all and each copy is a dedup hit in the store
    assert {r.json()["id"] for r in responses} == {responses[0].json()["id"]}
    counters = await store.counters()
    assert counters[("dedup_hits", "content")] == 199
    # And the 199 hits took a handful of writes (those in flight together share one)
    assert len(writes) < 20


async def test_single_flight_shares_one_call_among_concurrent_callers() -> None:
    flights: SingleFlight[int] = SingleFlight()
    release = asyncio.Event()
    calls = 0

    async def call() -> int:
        nonlocal calls
        calls += 1
        await release.wait()
        return 42

    waiting = [asyncio.ensure_future(flights.run("k", call)) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    outcomes = await asyncio.gather(*waiting)

    assert calls == 1
    assert sorted(led for _, led in outcomes) == [False] * 4 + [True]
    assert {value for value, _ in outcomes} == {42}
    assert len(flights) == 0


async def test_single_flight_gives_every_caller_the_error() -> None:
    flights: SingleFlight[int] = SingleFlight()
    release = asyncio.Event()

    async def call() -> int:
        await release.wait()
        raise ValueError("nope")

    waiting = [asyncio.ensure_future(flights.run("k", call)) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)

    assert all(isinstance(o, ValueError) for o in outcomes)


async def test_single_flight_runs_the_call_in_the_first_callers_own_task() -> None:
    flights: SingleFlight[object] = SingleFlight()

    async def call() -> object:
        return asyncio.current_task()

    async def caller() -> tuple[object, object]:
        ran_in, led = await flights.run("k", call)
        assert led
        return ran_in, asyncio.current_task()

    ran_in, caller_task = await asyncio.ensure_future(caller())

    assert ran_in is caller_task  # no task of its own: no extra turns of the loop
    assert len(flights) == 0


async def test_single_flight_callers_run_the_call_again_when_the_first_is_cancelled() -> None:
    flights: SingleFlight[int] = SingleFlight()
    first_started, release = asyncio.Event(), asyncio.Event()
    calls = 0

    async def call() -> int:
        nonlocal calls
        calls += 1
        first_started.set()
        await release.wait()
        return 42

    first = asyncio.ensure_future(flights.run("k", call))
    await first_started.wait()
    waiting = [asyncio.ensure_future(flights.run("k", call)) for _ in range(3)]
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    outcomes = await asyncio.gather(*waiting)

    assert first.cancelled()
    assert {value for value, _ in outcomes} == {42}
    assert sum(led for _, led in outcomes) == calls - 1  # one of them ran it again, or none
    assert len(flights) == 0


# Refusals: each answers the envelope and stores nothing -------------------------------

INVALID_BODIES: list[tuple[str, Any]] = [
    ("missing kind", {"params": {"prompt": "x"}}),
    ("missing params", {"kind": "image.generate"}),
    ("params not an object", {"kind": "image.generate", "params": [1]}),
    ("unknown top-level field", image_body(colour="red")),
    ("priority too high", image_body(priority=101)),
    ("priority too low", image_body(priority=-101)),
    ("priority not an integer", image_body(priority="5")),
    ("max_attempts zero", image_body(max_attempts=0)),
    ("max_attempts too high", image_body(max_attempts=21)),
    ("deadline too short", image_body(deadline_s=0.5)),
    ("deadline too long", image_body(deadline_s=604_801)),
    ("timeout too short", image_body(timeouts={"waiting_s": 0})),
    ("timeout too long", image_body(timeouts={"uploading_s": 86_401})),
    ("unknown timeout", image_body(timeouts={"queued_s": 5})),
    ("dedup not a boolean", image_body(dedup="yes")),
    ("metadata not an object", image_body(metadata=[1, 2])),
    ("body not an object", [image_body()]),
    ("bad params", {"kind": "image.generate", "params": {"prompt": "x", "width": 7}}),
    ("missing prompt", {"kind": "image.generate", "params": {"steps": 3}}),
    ("model a path", {"kind": "image.generate", "params": {"prompt": "x", "model": "../sd"}}),
    ("model empty", {"kind": "image.generate", "params": {"prompt": "x", "model": ""}}),
]


@pytest.mark.parametrize(("case", "body"), INVALID_BODIES, ids=[c for c, _ in INVALID_BODIES])
async def test_invalid_body_is_422_invalid_request(api: ApiUnderTest, case: str, body: Any) -> None:
    response = await api.submit(body)

    error = assert_error(response, 422, "invalid_request")
    assert error["details"], case
    assert all({"loc", "msg", "type"} <= set(d) for d in error["details"])
    assert await api.task_count() == 0


async def test_unknown_kind_is_422_unknown_kind(api: ApiUnderTest) -> None:
    response = await api.submit({"kind": "video.render", "params": {}})

    assert_error(response, 422, "unknown_kind")
    assert await api.task_count() == 0


@pytest.mark.parametrize(
    "key", ["x" * 256, "tab\there", "caf\u00e9"], ids=["too long", "control", "non-ascii"]
)
async def test_bad_idempotency_key_is_422(api: ApiUnderTest, key: str) -> None:
    response = await api.client.post(
        "/v1/tasks",
        content=json.dumps(image_body()).encode(),
        headers=[(b"content-type", b"application/json"), (b"idempotency-key", key.encode())],
    )

    assert_error(response, 422, "invalid_request")
    assert await api.task_count() == 0


async def test_longest_idempotency_key_is_accepted(api: ApiUnderTest) -> None:
    response = await api.submit(headers={"Idempotency-Key": "~" * 255})

    assert response.status_code == 201


@pytest.mark.parametrize(
    "raw",
    [b'{"kind": "image.generate"', b"", b"  ", b'{"kind": NaN}', b'{"a": "\\ud800"}', b"\xff\xfe"],
    ids=["truncated", "empty", "blank", "nan", "lone surrogate", "not utf-8"],
)
async def test_malformed_json_is_422(api: ApiUnderTest, raw: bytes) -> None:
    response = await api.client.post(
        "/v1/tasks", content=raw, headers={"content-type": "application/json"}
    )

    assert_error(response, 422, "invalid_request")
    assert await api.task_count() == 0


async def test_deeply_nested_json_is_422(api: ApiUnderTest) -> None:
    raw = b'{"kind": "image.generate", "params": {}, "metadata": {"a": ' + b"[" * 100_000

    response = await api.client.post(
        "/v1/tasks",
        content=raw + b"]" * 100_000 + b"}}",
        headers={"content-type": "application/json"},
    )

    assert_error(response, 422, "invalid_request")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
async def test_body_that_is_not_json_is_415(api: ApiUnderTest, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}

    response = await api.client.post(
        "/v1/tasks", content=json.dumps(image_body()).encode(), headers=headers
    )

    assert_error(response, 415, "unsupported_media_type")
    assert await api.task_count() == 0


async def test_json_with_charset_and_suffix_types_are_accepted(api: ApiUnderTest) -> None:
    response = await api.client.post(
        "/v1/tasks",
        content=json.dumps(image_body()).encode(),
        headers={"content-type": "application/vnd.kiln+json; charset=utf-8"},
    )

    assert response.status_code == 201


def _oversized_body(limit: int) -> bytes:
    return json.dumps(image_body("x" * (limit + 10))).encode()


async def test_body_over_the_limit_is_413(api: ApiUnderTest) -> None:
    raw = _oversized_body(api.kiln.settings.max_body_bytes)

    response = await api.client.post(
        "/v1/tasks", content=raw, headers={"content-type": "application/json"}
    )

    assert_error(response, 413, "payload_too_large")
    assert await api.task_count() == 0


async def test_body_over_the_limit_without_content_length_is_413(api: ApiUnderTest) -> None:
    raw = _oversized_body(api.kiln.settings.max_body_bytes)

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(raw), 65_536):
            yield raw[start : start + 65_536]

    response = await api.client.post(
        "/v1/tasks", content=chunks(), headers={"content-type": "application/json"}
    )

    assert "content-length" not in response.request.headers
    assert_error(response, 413, "payload_too_large")
    assert await api.task_count() == 0


async def test_body_longer_than_its_content_length_is_413(api: ApiUnderTest) -> None:
    raw = _oversized_body(api.kiln.settings.max_body_bytes)
    parts = [raw[i : i + 65_536] for i in range(0, len(raw), 65_536)]

    status, body = await raw_request(
        api.http,
        "POST",
        "/v1/tasks",
        headers={"content-type": "application/json", "content-length": "100"},
        body_parts=parts,
    )

    assert status == 413
    assert json.loads(body)["error"]["code"] == "payload_too_large"
    assert await api.task_count() == 0


async def test_unknown_route_and_method_answer_the_envelope(api: ApiUnderTest) -> None:
    missing = await api.client.get("/v1/nothing-here")
    wrong_method = await api.client.delete("/v1/tasks")

    assert_error(missing, 404, "not_found")
    assert_error(wrong_method, 405, "method_not_allowed")
    assert "allow" in wrong_method.headers


async def test_unexpected_exception_is_500_without_details(settings: Settings) -> None:
    async with running_api(settings) as under_test:

        @under_test.http.get("/v1/boom")
        async def boom() -> None:
            raise RuntimeError("secret internals")

        transport = httpx.ASGITransport(app=under_test.http, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln.test") as client:
            response = await client.get("/v1/boom")

    error = assert_error(response, 500, "internal_error")
    assert "secret" not in response.text and error["details"] == []


async def test_a_task_shows_the_model_it_needs(api: ApiUnderTest) -> None:
    named = (await api.submit(image_body(params_model="sdxl-base"))).json()
    plain = (await api.submit(image_body("a plain fox"))).json()
    assert named["model"] == "sdxl-base" and named["params"]["model"] == "sdxl-base"
    assert plain["model"] is None and "model" not in plain["params"]


async def test_a_content_dedup_hit_is_read_not_inserted(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a task, and every insert-or-get of the store counted from now on
    first = await api.submit(image_body("a held fox"))
    store = api.kiln.engine.store
    inserts: list[object] = []
    submit = store.submit

    async def counted(new: Any, **options: Any) -> Any:
        inserts.append(new)
        return await submit(new, **options)

    monkeypatch.setattr(store, "submit", counted)
    # When the same content comes again, one request after another
    again = [await api.submit(image_body("a held fox")) for _ in range(3)]
    # Then each is answered with the task, its position and the dedup flag, from a read
    for hit in again:
        assert hit.status_code == 200
        assert hit.json() == {**first.json(), "deduplicated": True}
    assert inserts == []
    counters = await store.counters()
    assert counters[("dedup_hits", "content")] == 3
    # While new content is still inserted, and a key still goes through the store
    await api.submit(image_body("a new fox"))
    await api.submit(image_body("a held fox"), headers={"Idempotency-Key": "k-1"})
    assert len(inserts) == 2


async def test_a_new_submission_is_digested_once_per_stored_key(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given every canonical text counted
    made: list[Any] = []
    canonical_json = canonical.canonical_json

    def counted(value: Any) -> str:
        made.append(value)
        return canonical_json(value)

    monkeypatch.setattr(canonical, "canonical_json", counted)
    # When a new task is submitted with content dedup on
    answer = await api.submit(image_body("digested"))
    # Then its params went into two texts: the fingerprint's body and the dedup key's
    # (the single-flight key is the dedup key, not a third digest)
    assert answer.status_code == 201
    assert len([v for v in made if isinstance(v, dict) and "params" in v]) == 2
    # And a content-dedup hit needs only its dedup key
    made.clear()
    again = await api.submit(image_body("digested"))
    assert again.json()["deduplicated"] is True
    assert len([v for v in made if isinstance(v, dict) and "params" in v]) == 1


def _dedup_reads(api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The content keys of the store's dedup reads from now on."""
    store = api.kiln.engine.store
    reads: list[str] = []
    read_dedup = store.read_dedup

    async def counted(tenant: str, key: str, *args: Any) -> Any:
        reads.append(key)
        return await read_dedup(tenant, key, *args)

    monkeypatch.setattr(store, "read_dedup", counted)
    return reads


async def test_new_content_goes_straight_to_the_insert_without_a_dedup_read(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given every content-dedup read of the store counted
    reads = _dedup_reads(api, monkeypatch)
    # When new content is submitted
    first = await api.submit(image_body("a fox never seen"))
    # Then the store inserted it without a read before (it would have missed)
    assert first.status_code == 201 and reads == []
    # And the same content again is answered from one read, as a dedup hit
    again = await api.submit(image_body("a fox never seen"))
    assert again.status_code == 200 and len(reads) == 1
    assert again.json() == {**first.json(), "deduplicated": True}


async def test_content_another_process_submitted_is_a_dedup_hit_without_a_read(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a task submitted through the same store but not through this API
    held = await api.kiln.submit("image.generate", image_body("made elsewhere")["params"])
    reads = _dedup_reads(api, monkeypatch)
    # When the API gets the same content
    answer = await api.submit(image_body("made elsewhere"))
    # Then the store's insert-or-get answers with that task, its position and the flag
    assert answer.status_code == 200 and "location" not in answer.headers
    body = answer.json()
    assert body["id"] == held.task.id and body["deduplicated"] is True
    assert body["queue_position"] == 1
    assert reads == [] and await api.task_count() == 1
    counters = await api.kiln.engine.store.counters()
    assert counters[("dedup_hits", "content")] == 1


def test_recent_content_keeps_the_most_recently_seen_keys() -> None:
    # Given room for two content keys, a and b seen, then a seen again
    recent = RecentContent(size=2)
    recent.add("t", "a")
    recent.add("t", "b")
    assert recent.seen("t", "a") and not recent.seen("other", "a")
    # When a third comes
    recent.add("t", "c")
    # Then the least recently seen (b) went, and the others stay
    assert not recent.seen("t", "b")
    assert recent.seen("t", "a") and recent.seen("t", "c") and len(recent) == 2


async def test_copies_answered_together_share_one_rendering_of_the_answer(
    api: ApiUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a task, and every rendering of a task's JSON counted from now on
    first = await api.submit(image_body("a shared fox"))
    rendered: list[str] = []
    render = tasks.task_json

    def counted(task: Any, **fields: Any) -> Any:
        rendered.append(task.id)
        return render(task, **fields)

    monkeypatch.setattr(tasks, "task_json", counted)
    # When fifty copies of its content arrive at once
    copies = await asyncio.gather(*(api.submit(image_body("a shared fox")) for _ in range(50)))
    # Then each is answered alike: 200, the task, the dedup flag, the same bytes
    assert {c.status_code for c in copies} == {200}
    assert all(c.json() == {**first.json(), "deduplicated": True} for c in copies)
    assert len({c.content for c in copies}) == 1
    assert {c.headers["content-type"] for c in copies} == {"application/json"}
    # And those answered together were rendered once, not once each
    assert len(rendered) < len(copies)
