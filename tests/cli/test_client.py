"""kiln.Client and kiln.AsyncClient against a real `kiln serve` process."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import httpx
import pytest

import kiln
from images import opened, png
from kiln import errors
from kiln.client import ConnectionFailed, SSEDecoder, error_from_response

from .conftest import Server, free_port
from .proxy import cuttable_proxy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fox(steps: int = 3, step_ms: int = 5, **simulate: Any) -> dict[str, Any]:
    """Params of a small, unique image.generate task (unique, so no dedup across tests)."""
    return {
        "prompt": f"a red fox {uuid.uuid4().hex[:8]}",
        "width": 64,
        "height": 64,
        "steps": steps,
        "simulate": {"step_ms": step_ms, **simulate},
    }


def statuses(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["type"] == "status"]


# submit, get, wait, download


def test_submitted_task_succeeds_and_its_output_downloads(server: Server) -> None:
    with kiln.Client(server.url) as client:
        submitted = client.submit(params=fox())
        done = client.wait(submitted["id"], timeout_s=30)
        [output] = done["result"]["outputs"]
        data = client.download(done["id"], output["name"])

    assert submitted["created"] is True
    assert submitted["replayed"] is False
    assert submitted["deduplicated"] is False
    assert submitted["status"] == "PENDING"
    assert done["status"] == "SUCCESS"
    assert done["final"] is True
    assert data.startswith(PNG_MAGIC)
    assert len(data) == output["size"]
    assert hashlib.sha256(data).hexdigest() == output["sha256"]
    assert client.output_url(output) == f"{server.url}/v1/tasks/{done['id']}/outputs/image.png"


def test_resubmission_reports_replay_and_deduplication(server: Server) -> None:
    params = fox()
    key = uuid.uuid4().hex
    with kiln.Client(server.url) as client:
        first = client.submit(params=params, idempotency_key=key)
        replay = client.submit(params=params, idempotency_key=key)
        duplicate = client.submit(params=params)

    assert (first["created"], first["replayed"], first["deduplicated"]) == (True, False, False)
    assert (replay["created"], replay["replayed"]) == (False, True)
    assert replay["id"] == first["id"]
    assert (duplicate["created"], duplicate["replayed"], duplicate["deduplicated"]) == (
        False,
        False,
        True,
    )
    assert duplicate["id"] == first["id"]


def test_an_upload_runs_and_the_same_file_again_is_the_same_task(server: Server) -> None:
    # Given a picture no other test uploads
    width = 20 + uuid.uuid4().int % 200
    data = png(width, 30)
    params = {"op": "resize", "width": 10, "height": 10, "format": "webp"}
    with kiln.Client(server.url) as client:
        # When it is uploaded, the task waited for, and the same file uploaded again
        submitted = client.submit("image.transform", params, files={"image": ("a.png", data)})
        done = client.wait(submitted["id"], timeout_s=30)
        again = client.submit("image.transform", params, files={"image": ("b.png", data)})
        output = client.download(done["id"], "image.webp")

    # Then the first made the task, the second got it back finished, result included
    assert submitted["created"] is True and submitted["inputs"][0]["size"] == len(data)
    assert done["status"] == "SUCCESS"
    assert (again["created"], again["deduplicated"], again["id"]) == (False, True, done["id"])
    assert again["result"] == done["result"]
    assert opened(output).size == (10, 10)


def test_get_and_list_show_the_task(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.submit(params=fox(), metadata={"owner": "test"})
        got = client.get(task["id"])
        page = client.list(limit=200)
        one = client.list(limit=1)

    assert got["id"] == task["id"]
    assert got["metadata"] == {"owner": "test"}
    assert task["id"] in [t["id"] for t in page["items"]]
    assert len(one["items"]) == 1
    assert one["next_cursor"] is not None


def test_stats_count_tasks_by_status(server: Server) -> None:
    with kiln.Client(server.url) as client:
        client.wait(client.submit(params=fox())["id"], timeout_s=30)
        stats = client.stats()

    assert stats["counts"]["SUCCESS"] >= 1


# event streams


def test_stream_replays_history_and_follows_live_progress_until_final(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.submit(params=fox(steps=10, step_ms=30))
        messages = list(client.stream(task["id"]))

    status_events = statuses(messages)
    assert [m["status"] for m in status_events] == [
        "PENDING",
        "WAITING_FOR_RESOURCE",
        "GENERATING",
        "UPLOADING",
        "SUCCESS",
    ]
    seqs = [m["seq"] for m in status_events]
    assert seqs == sorted(set(seqs))
    assert status_events[-1]["final"] is True
    progress = [m for m in messages if m["type"] == "progress"]
    assert progress, "live progress events were expected while the task generated"
    assert {m["task_id"] for m in messages} == {task["id"]}
    assert all(m["progress"]["total"] == 10 for m in progress if m["progress"])


def test_stream_after_sends_only_later_events(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.submit(params=fox())
        client.wait(task["id"], timeout_s=30)
        full = statuses(list(client.stream(task["id"])))
        rest = list(client.stream(task["id"], after=full[1]["seq"]))

    assert [m["seq"] for m in rest] == [m["seq"] for m in full[2:]]


def test_stream_resumes_after_a_dropped_connection_without_loss_or_repeat(
    server: Server,
) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with cuttable_proxy(port) as proxy, kiln.Client(proxy.url) as client:
        task = client.submit(params=fox(steps=20, step_ms=40))
        seen: list[dict[str, Any]] = []
        cut_at: int | None = None
        for message in client.stream(task["id"]):
            seen.append(message)
            if cut_at is None and message["type"] == "status" and message["status"] == "GENERATING":
                cut_at = proxy.accepted
                proxy.cut()
        history = statuses(list(client.stream(task["id"])))

    assert cut_at is not None
    assert proxy.accepted > cut_at, "the client was expected to reconnect"
    assert [m["seq"] for m in statuses(seen)] == [m["seq"] for m in history]
    assert history[-1]["status"] == "SUCCESS"


def test_wait_times_out_on_a_task_that_does_not_finish(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.submit(params=fox(steps=10, stall_attempts=1))
        try:
            with pytest.raises(TimeoutError):
                client.wait(task["id"], timeout_s=0.3)
        finally:
            client.cancel(task["id"])


# cancel and retry


def test_cancel_then_retry_runs_the_task_again(server: Server) -> None:
    with kiln.Client(server.url) as client:
        task = client.submit(params=fox(steps=10, stall_attempts=1))
        answered = client.cancel(task["id"])
        cancelled = client.wait(task["id"], timeout_s=30)
        with pytest.raises(errors.AlreadyFinal) as again:
            client.cancel(task["id"])
        retried = client.retry(task["id"])
        done = client.wait(task["id"], timeout_s=30)

    assert answered["status"] == "CANCELLED" or answered["cancel_requested"] is True
    assert cancelled["status"] == "CANCELLED"
    assert again.value.status_code == 409  # type: ignore[attr-defined]
    assert retried["status"] == "RETRYING"
    assert retried["max_attempts"] == cancelled["max_attempts"] + 1
    assert done["status"] == "SUCCESS"


# errors


def test_api_errors_raise_the_matching_kiln_error(server: Server) -> None:
    with kiln.Client(server.url) as client:
        done = client.wait(client.submit(params=fox())["id"], timeout_s=30)
        cases: list[tuple[type[errors.KilnError], int, Any]] = [
            (errors.NotFound, 404, lambda: client.get("tsk_missing")),
            (errors.NotFound, 404, lambda: client.download(done["id"], "nothing.png")),
            (errors.NotRetryable, 409, lambda: client.retry(done["id"])),
            (errors.NotInReview, 409, lambda: client.review(done["id"], "approve")),
            (errors.InvalidRequest, 422, lambda: client.submit(params={"prompt": ""})),
            (errors.UnknownKind, 422, lambda: client.submit("video.nope", params={})),
        ]
        for cls, status, call in cases:
            with pytest.raises(cls) as raised:
                call()
            assert raised.value.status_code == status  # type: ignore[attr-defined]
            assert raised.value.code == cls.code
            assert raised.value.message


def test_invalid_params_carry_the_details(server: Server) -> None:
    with kiln.Client(server.url) as client, pytest.raises(errors.InvalidRequest) as raised:
        client.submit(params={"prompt": "a fox", "width": 65})

    assert raised.value.details
    assert "width" in str(raised.value.details)


def test_unreachable_server_raises_connection_failed() -> None:
    server = f"http://127.0.0.1:{free_port()}"
    with kiln.Client(server) as client, pytest.raises(ConnectionFailed) as raised:
        client.get("tsk_x")

    assert raised.value.message == f"cannot reach {server}: connection refused"


def _response(status: int, body: Any = None, **headers: str) -> httpx.Response:
    request = httpx.Request("GET", "http://kiln.test/v1/tasks")
    if body is None:
        return httpx.Response(status, headers=headers, request=request, text="Bad Gateway")
    return httpx.Response(status, headers=headers, json=body, request=request)


def test_error_envelope_maps_to_class_and_keeps_unknown_codes() -> None:
    def envelope(code: str) -> dict[str, Any]:
        return {"error": {"code": code, "message": "m", "details": [{"loc": ["x"]}]}}

    known = error_from_response(_response(409, envelope("already_final")))
    unknown = error_from_response(_response(409, envelope("brand_new_code")))
    limited = error_from_response(_response(429, envelope("rate_limited"), **{"Retry-After": "7"}))
    bare = error_from_response(_response(502))

    assert type(known) is errors.AlreadyFinal
    assert known.details == [{"loc": ["x"]}]
    assert type(unknown) is errors.KilnError
    assert unknown.code == "brand_new_code"
    assert isinstance(limited, errors.RateLimited)
    assert limited.retry_after_s == 7.0
    assert bare.status_code == 502  # type: ignore[attr-defined]
    assert bare.message == "Bad Gateway"


def test_sse_decoder_parses_events_ids_comments_and_multiline_data() -> None:
    lines = [
        ": keep-alive",
        "",
        "id: 42",
        "event: status",
        'data: {"seq": 42,',
        'data:  "status": "PENDING"}',
        "",
        "event: progress",
        'data: {"task_id": "tsk_1"}',
        "",
    ]
    decoder = SSEDecoder()

    messages = [m for m in map(decoder.feed, lines) if m is not None]

    assert messages == [
        {"seq": 42, "status": "PENDING", "type": "status"},
        {"task_id": "tsk_1", "type": "progress"},
    ]
    assert decoder.last_id == "42"


# the async face


async def test_async_client_submits_waits_streams_and_downloads(server: Server) -> None:
    async with kiln.AsyncClient(server.url) as client:
        task = await client.submit(params=fox())
        done = await client.wait(task["id"], timeout_s=30)
        messages = [m async for m in client.stream(task["id"])]
        [output] = done["result"]["outputs"]
        data = await client.download(task["id"], output["name"])
        with pytest.raises(errors.NotFound):
            await client.get("tsk_missing")

    assert done["status"] == "SUCCESS"
    assert statuses(messages)[-1]["status"] == "SUCCESS"
    assert hashlib.sha256(data).hexdigest() == output["sha256"]


async def test_async_wait_times_out(server: Server) -> None:
    async with kiln.AsyncClient(server.url) as client:
        task = await client.submit(params=fox(steps=10, stall_attempts=1))
        try:
            with pytest.raises(TimeoutError):
                await client.wait(task["id"], timeout_s=0.3)
        finally:
            await client.cancel(task["id"])
