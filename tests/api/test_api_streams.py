"""Event streams over a real uvicorn server: SSE task streams, the tenant feed, WebSocket."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from api_support import (
    ALICE_KEY,
    BOB_KEY,
    ApiUnderTest,
    SseEvent,
    assert_error,
    bearer,
    bound_socket,
    image_body,
    live_server,
    make_kiln,
    sse_events,
    uvicorn_server,
    wait_until,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

import kiln
from kiln.api import create_app
from kiln.config import Settings
from kiln.worker import Context

STREAM_TIMEOUT_S = 30.0


@dataclass
class Served:
    kiln: kiln.App
    url: str
    client: httpx.AsyncClient
    gate: asyncio.Event


@contextlib.asynccontextmanager
async def served(
    settings: Settings, *, workers: int = 1, ping_interval_s: float = 15.0
) -> AsyncIterator[Served]:
    """A real server with keys; kind ``test.gate`` holds the worker until the gate opens."""
    settings = settings.with_(api_keys={ALICE_KEY: "alice", BOB_KEY: "bob"})
    app = make_kiln(settings)
    gate = asyncio.Event()

    @app.task("test.gate", resources={"gpu": 1})
    async def hold(ctx: Context, params: Any) -> None:
        await gate.wait()

    http = create_app(app, workers=workers, ping_interval_s=ping_interval_s)
    async with live_server(http) as url:
        async with httpx.AsyncClient(base_url=url, headers=bearer(ALICE_KEY)) as client:
            yield Served(app, url, client, gate)
        gate.set()


async def _submit(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    response = await client.post("/v1/tasks", json=body)
    assert response.status_code == 201, response.text
    task_id: str = response.json()["id"]
    return task_id


async def _status(client: httpx.AsyncClient, task_id: str) -> str:
    status: str = (await client.get(f"/v1/tasks/{task_id}")).json()["status"]
    return status


async def collect(
    client: httpx.AsyncClient,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    until: Callable[[list[SseEvent]], bool] = lambda events: False,
    seen: list[SseEvent] | None = None,
) -> list[SseEvent]:
    """Read a stream until it ends or ``until`` holds; events land in ``seen`` as they come."""
    events = [] if seen is None else seen
    async with asyncio.timeout(STREAM_TIMEOUT_S), client.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for event in sse_events(r):
            events.append(event)
            if until(events):
                break
    return events


def _data(events: list[SseEvent], kind: str) -> list[dict[str, Any]]:
    return [e.json() for e in events if e.event == kind]


def _has_submit(task_id: str) -> Callable[[list[SseEvent]], bool]:
    return lambda events: any(
        e.event == "status" and e.json()["task_id"] == task_id for e in events
    )


def _is_final(task_id: str) -> Callable[[list[SseEvent]], bool]:
    return lambda events: any(
        e.event == "status" and e.json()["task_id"] == task_id and e.json()["final"] for e in events
    )


async def _hold_the_worker(served: Served) -> str:
    gate_id = await _submit(served.client, {"kind": "test.gate", "params": {}})

    async def generating() -> bool:
        return await _status(served.client, gate_id) == "GENERATING"

    await wait_until(generating, STREAM_TIMEOUT_S)
    return gate_id


async def test_task_stream_follows_a_task_to_success_then_resumes(settings: Settings) -> None:
    async with served(settings) as s:
        await _hold_the_worker(s)
        task_id = await _submit(s.client, image_body("followed"))
        stream: list[SseEvent] = []
        feed: list[SseEvent] = []
        following = asyncio.create_task(
            collect(s.client, f"/v1/tasks/{task_id}/events", seen=stream)
        )
        feeding = asyncio.create_task(
            collect(s.client, "/v1/events?after=0", until=_is_final(task_id), seen=feed)
        )
        await wait_until(lambda: _has_submit(task_id)(stream) and _has_submit(task_id)(feed))
        s.gate.set()
        await following
        await feeding

        statuses = _data(stream, "status")
        seqs = [int(e.id or 0) for e in stream if e.event == "status"]
        assert seqs == sorted(set(seqs)) and seqs == [s["seq"] for s in statuses]
        assert statuses[0]["event"] == "submit" and statuses[0]["from"] is None
        assert statuses[-1]["event"] == "uploaded" and statuses[-1]["final"] is True
        assert [e["status"] for e in statuses] == [
            "PENDING", "WAITING_FOR_RESOURCE", "GENERATING", "UPLOADING", "SUCCESS",
        ]  # fmt: skip
        progress = [e for e in stream if e.event == "progress"]
        assert progress and all(e.id is None for e in progress)
        first_progress = stream.index(progress[0])
        generating_at = next(i for i, e in enumerate(stream) if e.event == "status"
                             and e.json()["status"] == "GENERATING")  # fmt: skip
        assert generating_at < first_progress
        assert {p.json()["type"] for p in progress} == {"progress"}
        assert progress[-1].json()["progress"]["step"] == progress[-1].json()["progress"]["total"]

        fed = [e for e in _data(feed, "status") if e["task_id"] == task_id]
        assert fed == statuses
        assert any(e.json()["task_id"] == task_id for e in feed if e.event == "progress")

        acquire = next(e for e in statuses if e["event"] == "acquire")["seq"]
        resumed = await collect(
            s.client, f"/v1/tasks/{task_id}/events", headers={"Last-Event-ID": str(acquire)}
        )
        after = await collect(s.client, f"/v1/tasks/{task_id}/events?after={acquire}")
        later = [e for e in statuses if e["seq"] > acquire]
        assert _data(resumed, "status") == later
        assert _data(after, "status") == later
        assert _data(resumed, "progress") == []

        socket_url = s.url.replace("http", "ws") + f"/v1/tasks/{task_id}/ws"
        async with connect(socket_url, additional_headers=bearer(ALICE_KEY)) as ws:
            messages = [json.loads(m) async for m in ws]
            assert ws.close_code == 1000
        assert messages == statuses


async def test_stream_stays_open_after_a_manual_retry_until_final(settings: Settings) -> None:
    async with served(settings, workers=0) as s:
        task_id = await _submit(s.client, image_body())
        await s.client.post(f"/v1/tasks/{task_id}/cancel")
        await s.client.post(f"/v1/tasks/{task_id}/retry")
        events: list[SseEvent] = []
        following = asyncio.create_task(
            collect(s.client, f"/v1/tasks/{task_id}/events", seen=events)
        )
        await wait_until(lambda: any(e.event == "status" and e.json()["event"] == "retry"
                                     for e in events))  # fmt: skip

        assert not following.done()
        await s.client.post(f"/v1/tasks/{task_id}/cancel")
        await following

    names = [e["event"] for e in _data(events, "status")]
    assert names == ["submit", "cancel", "retry", "cancel"]


async def test_idle_stream_gets_keep_alive_comments(settings: Settings) -> None:
    async with served(settings, workers=0, ping_interval_s=0.05) as s:
        task_id = await _submit(s.client, image_body())

        events = await collect(
            s.client,
            f"/v1/tasks/{task_id}/events",
            until=lambda seen: (
                any("ping" in e.comments for e in seen) and any(e.event == "status" for e in seen)
            ),
        )

    # A keep-alive may come before the replayed history on a busy machine: order is free.
    assert [e.json()["event"] for e in events if e.event == "status"] == ["submit"]
    assert any("ping" in e.comments for e in events)


async def test_tenant_feed_carries_only_the_tenants_tasks(settings: Settings) -> None:
    async with served(settings, workers=0) as s:
        async with httpx.AsyncClient(base_url=s.url, headers=bearer(BOB_KEY)) as bob:
            bobs = await _submit(bob, image_body("bob's"))
        alices = await _submit(s.client, image_body("alice's"))

        feed = await collect(
            s.client, "/v1/events?after=0", until=lambda seen: _has_submit(alices)(seen)
        )

    assert {e["task_id"] for e in _data(feed, "status")} == {alices}
    assert bobs not in {e["task_id"] for e in _data(feed, "status")}


async def test_tenant_feed_starts_live_without_a_resume_point(settings: Settings) -> None:
    async with served(settings, workers=0) as s:
        old = await _submit(s.client, image_body("before"))
        events: list[SseEvent] = []
        feeding = asyncio.create_task(
            collect(s.client, "/v1/events", seen=events, until=lambda seen: bool(seen))
        )

        new = await _submit_until_seen(s, feeding)

    statuses = _data(events, "status")
    assert statuses and old not in {e["task_id"] for e in statuses}
    assert statuses[0]["task_id"] in new


async def _submit_until_seen(s: Served, feeding: asyncio.Task[list[SseEvent]]) -> set[str]:
    """Submit new tasks until the live feed shows one (it may subscribe after the first)."""
    made: set[str] = set()
    for n in range(200):
        made.add(await _submit(s.client, image_body(f"live {n}")))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(feeding), 0.05)
        if feeding.done():
            await feeding
            return made
    raise AssertionError("the live feed never delivered an event")


async def test_websocket_refuses_bad_keys_and_other_tenants(settings: Settings) -> None:
    async with served(settings, workers=0) as s:
        task_id = await _submit(s.client, image_body())
        base = s.url.replace("http", "ws") + f"/v1/tasks/{task_id}/ws"
        codes = []
        for url, headers in [
            (base, {}),
            (base + "?access_token=wrong", {}),
            (base, bearer(BOB_KEY)),
            (base + f"?access_token={BOB_KEY}", {}),
        ]:
            async with connect(url, additional_headers=headers) as ws:
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
                codes.append(ws.close_code)

        async with connect(base + f"?access_token={ALICE_KEY}&after=0") as ws:
            first = json.loads(await ws.recv())

    assert codes == [4401, 4401, 4404, 4404]
    assert first["event"] == "submit" and first["task_id"] == task_id


async def test_bad_resume_points_are_422(api: ApiUnderTest) -> None:
    task = (await api.submit()).json()
    url = f"/v1/tasks/{task['id']}/events"

    bad_header = await api.client.get(url, headers={"Last-Event-ID": "abc"})
    bad_query = await api.client.get(url, params={"after": "-1"})

    assert_error(bad_header, 422, "invalid_request")
    assert_error(bad_query, 422, "invalid_request")


async def test_stream_of_a_final_task_replays_and_ends(api: ApiUnderTest) -> None:
    task = (await api.submit()).json()
    await api.client.post(f"/v1/tasks/{task['id']}/cancel")

    response = await api.client.get(f"/v1/tasks/{task['id']}/events")

    events = [line for line in response.text.splitlines() if line.startswith("event:")]
    assert events == ["event: status", "event: status"]
    assert "id: 1" in response.text.splitlines()


async def test_open_streams_end_cleanly_when_the_server_shuts_down(settings: Settings) -> None:
    app = make_kiln(settings)
    sock = bound_socket()
    server = uvicorn_server(create_app(app))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_until(lambda: server.started, STREAM_TIMEOUT_S)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with httpx.AsyncClient(base_url=url) as client:
        task_id = await _submit(client, image_body())
        events: list[SseEvent] = []
        following = asyncio.create_task(collect(client, f"/v1/tasks/{task_id}/events", seen=events))
        await wait_until(lambda: bool(events))

        server.should_exit = True
        await following
        await serving
    sock.close()

    assert [e.json()["event"] for e in events if e.event == "status"] == ["submit"]


async def test_progress_of_a_worker_elsewhere_reaches_the_stream(api: ApiUnderTest) -> None:
    body = image_body("painted elsewhere")
    body["params"].update(steps=30, simulate={"step_ms": 60})
    task_id = (await api.submit(body)).json()["id"]
    elsewhere = make_kiln(api.kiln.settings)

    async with elsewhere:
        worker = elsewhere.worker(concurrency=1, resources={"gpu": 1})
        async with kiln.app.running(worker.run()):
            response = await api.client.get(f"/v1/tasks/{task_id}/events")

    lines = response.text.splitlines()
    progress = [
        json.loads(lines[n + 1][5:]) for n, line in enumerate(lines) if line == "event: progress"
    ]
    assert lines[-2].startswith("data:") and json.loads(lines[-2][5:])["final"] is True
    assert progress, "no progress event crossed from the other worker"
    assert all(p["task_id"] == task_id and p["status"] == "GENERATING" for p in progress)


async def test_a_client_that_goes_away_leaves_no_subscription(settings: Settings) -> None:
    async with served(settings, workers=0) as s:
        task_id = await _submit(s.client, image_body())
        hub = s.kiln.hub

        for path in (f"/v1/tasks/{task_id}/events", "/v1/events?after=0"):
            await collect(s.client, path, until=lambda seen: bool(seen))
            await wait_until(lambda: not hub.subscribers, STREAM_TIMEOUT_S)
        socket_url = s.url.replace("http", "ws") + f"/v1/tasks/{task_id}/ws"
        async with connect(socket_url, additional_headers=bearer(ALICE_KEY)) as ws:
            await ws.recv()
        await wait_until(lambda: not hub.subscribers, STREAM_TIMEOUT_S)
        metrics = (await s.client.get("/metrics")).text

    assert 'kiln_api_streams_open{transport="sse"} 0.0' in metrics
    assert 'kiln_api_streams_open{transport="websocket"} 0.0' in metrics
