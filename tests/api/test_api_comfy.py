"""The Comfy API v2 face, driven by the official client (`comfy-sdk`, unmodified) against a
real kiln server (uvicorn on a loopback port), every answer validated against the client's
own generated models (`comfy_low.models`).

Jobs run through the real `comfy.workflow` worker driver on a stand-in ComfyUI process
(tests/services/comfyui_standin.py, shared by the module): see comfy_support.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from api_support import BOB_KEY, ApiUnderTest, bearer, image_body, wait_until
from blake3 import blake3
from comfy_low.errors import ApiError
from comfy_low.models import (
    Asset,
    ErrorEnvelope,
    Job,
    JobWorkflowResponse,
    Output,
    PreviewEvent,
    Progress,
    StatusEvent,
)
from comfy_low.sse import SSEDecoder
from comfy_sdk import (
    AsyncComfy,
    IdempotencyKeyReuse,
    NotFound,
    Preview,
    StatusChange,
    WorkflowFormatUi,
)
from comfy_sdk import Progress as ProgressEvent
from comfy_sdk.events import OutputReady
from comfy_support import (
    CKPT,
    IMAGE_NODE,
    OUTPUT_NODE,
    STEPS,
    comfy_server,
    gate_of,
    graph,
    png,
    scaled,
)
from tests.services.comfyui_standin import Process

from kiln import inputs
from kiln.config import Settings
from kiln.limits import Rate

pytestmark = pytest.mark.timeout(120)
SEEDS = itertools.count(1000)


@pytest.fixture(params=["sqlite", "postgres"])
def each_store(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return settings.with_(database_url=server.new_database())
    return settings


@pytest.fixture(scope="module")
def comfyui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """A stand-in ComfyUI process for the module's jobs."""
    instance = Process(tmp_path_factory.mktemp("comfyui"), "--step-s", "0.02", "--load-s", "0")
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture
def comfyui_url(comfyui: Process) -> str:
    """The stand-in's URL, its faults cleared."""
    assert comfyui.alive(), comfyui.output()
    httpx.post(f"{comfyui.url}/standin/faults", json={}).raise_for_status()
    return comfyui.url


@pytest.fixture
async def served(
    each_store: Settings, comfyui_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[str, ApiUnderTest]]:
    """The server with one in-process worker driving the stand-in ComfyUI, on each store."""
    async with comfy_server(each_store, comfyui=comfyui_url) as found:
        monkeypatch.setenv("COMFY_BASE_URL", found[0])
        yield found


@pytest.fixture
async def queued_only(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[str, ApiUnderTest]]:
    """The server with no worker: jobs stay queued."""
    async with comfy_server(settings) as found:
        monkeypatch.setenv("COMFY_BASE_URL", found[0])
        yield found


def alice() -> AsyncComfy:
    return AsyncComfy(api_key="key-alice-0123456789")


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    envelope = ErrorEnvelope.model_validate(response.json())
    assert envelope.error.code == code
    assert envelope.error.message
    return response.json()["error"]


async def jobs_of(api: ApiUnderTest) -> int:
    tasks, _ = await api.kiln.engine.store.list_tasks(
        tenant=None, kind="comfy.workflow", limit=1000
    )
    return len(tasks)


# Submission -----------------------------------------------------------------------------


async def test_the_same_idempotency_key_and_body_make_one_job(
    queued_only: tuple[str, ApiUnderTest],
) -> None:
    _, api = queued_only
    async with alice() as comfy:
        workflow = comfy.workflows.from_json(graph(1))
        first = await comfy.submit(workflow, idempotency_key="order-1")
        again = await comfy.submit(comfy.workflows.from_json(graph(1)), idempotency_key="order-1")
        assert again.id == first.id
        assert first.status == "queued"
        assert await jobs_of(api) == 1
        with pytest.raises(IdempotencyKeyReuse):
            await comfy.submit(comfy.workflows.from_json(graph(2)), idempotency_key="order-1")
    raw = await api.client.post(
        "/api/v2/jobs", json={"workflow": graph(1)}, headers={"Idempotency-Key": "order-1"}
    )
    assert raw.status_code == 201 and raw.headers["Idempotent-Replayed"] == "true"
    Job.model_validate(raw.json())
    reused = await api.client.post(
        "/api/v2/jobs", json={"workflow": graph(3)}, headers={"Idempotency-Key": "order-1"}
    )
    error_of(reused, 422, "idempotency_key_reuse")
    assert await jobs_of(api) == 1


async def test_a_submission_without_a_key_is_a_new_job_and_dedup_is_opt_in(
    queued_only: tuple[str, ApiUnderTest],
) -> None:
    _, api = queued_only
    answers = [await api.client.post("/api/v2/jobs", json={"workflow": graph(7)}) for _ in range(2)]
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[0].json()["id"] != answers[1].json()["id"]
    deduped = [
        await api.client.post("/api/v2/jobs", json={"workflow": graph(8), "dedup": True})
        for _ in range(2)
    ]
    assert deduped[1].json()["id"] == deduped[0].json()["id"]
    assert deduped[1].json()["deduplicated"] is True
    assert deduped[1].headers["Idempotent-Replayed"] == "false"
    assert await jobs_of(api) == 3


async def test_submission_errors_in_the_v2_envelope(queued_only: tuple[str, ApiUnderTest]) -> None:
    base, api = queued_only
    post = api.client.post
    error_of(
        await post("/api/v2/jobs", json={"nodes": [], "links": [], "last_node_id": 1}),
        400,
        "invalid_request",
    )
    ui = {"workflow": {"nodes": [], "links": [], "last_node_id": 1}}
    error_of(await post("/api/v2/jobs", json=ui), 422, "workflow_format_ui")
    bad = await post("/api/v2/jobs", json={"workflow": {"3": {"inputs": {}}}})
    assert error_of(bad, 422, "invalid_workflow")["details"]["node_errors"]["3"]
    missing = {"__type": "core/ASSET", "info": {"id": "9f8a1c0d-2b3e-4f56-8a7b-1c2d3e4f5a6b"}}
    gone = await post("/api/v2/jobs", json={"workflow": graph(image=missing)})
    assert error_of(gone, 422, "missing_asset")["details"]["missing_ids"] == [missing["info"]["id"]]
    error_of(
        await post("/api/v2/jobs", content=b"{", headers={"content-type": "application/json"}),
        400,
        "invalid_request",
    )
    error_of(
        await post(
            "/api/v2/jobs", json={"workflow": graph()}, headers={"Idempotency-Key": "x" * 256}
        ),
        400,
        "invalid_request",
    )
    async with httpx.AsyncClient(base_url=base) as anonymous:
        error_of(await anonymous.get("/api/v2/jobs"), 401, "unauthorized")
        assert (await anonymous.get("/api/v2/health")).json() == {"status": "healthy"}
    error_of(await api.client.get("/api/v2/jobs/tsk_0000000000000000000000000a"), 404, "not_found")
    async with alice() as comfy:
        with pytest.raises(WorkflowFormatUi):
            await comfy.submit(
                comfy.workflows.from_json({"nodes": [], "links": [], "last_node_id": 1})
            )
    assert await jobs_of(api) == 0
    assert (await api.client.get("/readyz")).status_code == 200  # still serving


async def test_a_v1_task_is_no_v2_job(queued_only: tuple[str, ApiUnderTest]) -> None:
    _, api = queued_only
    task = (await api.client.post("/v1/tasks", json=image_body())).json()
    error_of(await api.client.get(f"/api/v2/jobs/{task['id']}"), 404, "not_found")


# Assets ---------------------------------------------------------------------------------


async def test_an_asset_uploaded_twice_is_one_asset(queued_only: tuple[str, ApiUnderTest]) -> None:
    base, api = queued_only
    photo = png((1, 2, 3))
    digest = "blake3:" + blake3(photo).hexdigest()
    async with alice() as comfy:
        first = comfy.assets.from_bytes(photo, filename="photo.png", content_type="image/png")
        asset_id = await first.commit()
        assert first.created_new is True and first.hash == digest
        second = comfy.assets.from_bytes(photo, filename="again.png", content_type="image/png")
        assert await second.commit() == asset_id  # found by hash: HEAD, then from-hash
        assert second.created_new is False
    files = {"file": ("photo.png", photo, "image/png")}
    upload = await api.client.post("/api/v2/assets", files=files, data={"file_path": "photo.png"})
    assert upload.status_code == 200, upload.text
    body = Asset.model_validate(upload.json())
    assert (body.id, body.created_new, body.size_bytes) == (asset_id, False, len(photo))
    assert upload.json()["sha256"] == hashlib.sha256(photo).hexdigest()
    assert str(body.url) == f"{base}/api/v2/assets/{asset_id}/content"
    assert (await api.client.head(f"/api/v2/assets/by-hash/{digest}")).status_code == 200
    content = await api.client.get(f"/api/v2/assets/{asset_id}/content")
    assert content.content == photo and content.headers["content-type"] == "image/png"
    part = await api.client.get(
        f"/api/v2/assets/{asset_id}/content", headers={"Range": "bytes=2-9"}
    )
    assert part.status_code == 206 and part.content == photo[2:10]
    assert part.headers["content-range"] == f"bytes 2-9/{len(photo)}"
    over = await api.client.get(
        f"/api/v2/assets/{asset_id}/content", headers={"Range": f"bytes={len(photo)}-"}
    )
    error_of(over, 416, "range_not_satisfiable")
    mismatch = await api.client.post(
        "/api/v2/assets",
        files=files,
        data={"file_path": "x.png", "expected_hash": "blake3:" + "0" * 64},
    )
    error_of(mismatch, 409, "hash_mismatch")


async def test_assets_are_per_tenant(queued_only: tuple[str, ApiUnderTest]) -> None:
    base, api = queued_only
    photo = png((4, 5, 6))
    digest = "blake3:" + blake3(photo).hexdigest()
    async with alice() as comfy:
        asset_id = await comfy.assets.from_bytes(photo, filename="p.png").commit()
    async with httpx.AsyncClient(base_url=base, headers=bearer(BOB_KEY)) as bob:
        assert (await bob.head(f"/api/v2/assets/by-hash/{digest}")).status_code == 404
        error_of(await bob.get(f"/api/v2/assets/{asset_id}"), 404, "not_found")
        error_of(await bob.get(f"/api/v2/assets/{asset_id}/content"), 404, "not_found")
        error_of(await bob.delete(f"/api/v2/assets/{asset_id}"), 404, "not_found")
        error_of(
            await bob.post("/api/v2/assets/from-hash", json={"hash": digest}), 404, "blob_not_found"
        )
        ref = {"__type": "core/ASSET", "info": {"id": asset_id}}
        error_of(
            await bob.post("/api/v2/jobs", json={"workflow": graph(image=ref)}),
            422,
            "missing_asset",
        )
    async with AsyncComfy(api_key=BOB_KEY) as comfy:
        with pytest.raises(ApiError) as refused:
            await comfy._low.asset_from_hash(digest)
        assert refused.value.code == "blob_not_found"
    Asset.model_validate((await api.client.get(f"/api/v2/assets/{asset_id}")).json())
    assert (await api.client.delete(f"/api/v2/assets/{asset_id}")).status_code == 204
    error_of(await api.client.get(f"/api/v2/assets/{asset_id}"), 404, "not_found")
    assert (await api.client.head(f"/api/v2/assets/by-hash/{digest}")).status_code == 404


# Jobs that run --------------------------------------------------------------------------


async def _sse(
    client: httpx.AsyncClient, job_id: str, last: str | None = None
) -> list[dict[str, Any]]:
    """Every event of one connection (until the server ends the stream): event, id, data."""
    headers = {"Accept": "text/event-stream"}
    if last is not None:
        headers["Last-Event-ID"] = last
    found: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    async with client.stream("GET", f"/api/v2/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                if "data" in current:
                    found.append(current)
                current = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                current[field] = value.removeprefix(" ")
    return found


async def test_a_job_runs_to_succeeded_with_outputs_as_assets(
    each_store: Settings, comfyui: Process, comfyui_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    photo = png((9, 9, 9))
    async with comfy_server(each_store, comfyui=comfyui_url, gated=True) as (base, api):
        monkeypatch.setenv("COMFY_BASE_URL", base)
        job, done, data = await _run_with_the_client(api, photo)
        [output] = done.outputs
        raw = (await api.client.get(f"/api/v2/jobs/{job.id}")).json()
        model = Job.model_validate(raw)
        [out] = raw["outputs"]
        assert out["hash"] == "blake3:" + blake3(data).hexdigest()
        assert out["sha256"] == hashlib.sha256(data).hexdigest()
        assert str(model.outputs[0].url) == f"{base}/api/v2/assets/{out['id']}/content"
        assert model.urls.self == f"{base}/api/v2/jobs/{job.id}"
        assert model.progress is not None and model.progress.value == 1.0
        Asset.model_validate((await api.client.get(f"/api/v2/assets/{out['id']}")).json())
        error_of(await api.client.delete(f"/api/v2/assets/{out['id']}"), 422, "invalid_request")
        JobWorkflowResponse.model_validate(
            (await api.client.get(f"/api/v2/jobs/{job.id}/workflow")).json()
        )
        task = await api.kiln.get(job.id)
    assert task.kind == "comfy.workflow" and task.model == CKPT
    sha = hashlib.sha256(photo).hexdigest()
    assert [i["sha256"] for i in task.inputs] == [sha]
    # the stand-in ComfyUI got the asset's bytes and saved the very image served
    assert (comfyui.root / "input" / f"kiln-{sha}.png").read_bytes() == photo
    assert (comfyui.root / "output" / output.name).read_bytes() == data


async def _run_with_the_client(api: ApiUnderTest, photo: bytes) -> tuple[Any, Any, bytes]:
    """Upload ``photo``, submit a graph that loads it, follow the job's events from before
    it runs to its end, and check what the client reads: (job, result, output bytes)."""
    async with alice() as comfy:
        asset = comfy.assets.from_bytes(photo, filename="photo.png", content_type="image/png")
        # a seed of its own: ComfyUI (and the stand-in) would serve a graph it just ran from
        # its cache, without steps or previews
        workflow = comfy.workflows.from_json(graph(next(SEEDS), image="placeholder.png"))
        workflow.set_input(IMAGE_NODE, "image", asset)
        job = await comfy.submit(workflow, metadata={"project": "fox"})
        events = job.events()
        seen = [await anext(events)]  # the stream is open: let the worker take the job
        gate_of(api.kiln).set()
        seen += [event async for event in events]
        done = await job.result()
        assert done.status == "succeeded" and done.metadata == {"project": "fox"}
        assert isinstance(seen[-1], StatusChange) and seen[-1].status == "succeeded"
        steps = [e for e in seen if isinstance(e, ProgressEvent) and e.step is not None]
        assert steps and steps[-1].steps == STEPS and steps[-1].current_node == "3"
        assert any(isinstance(e, OutputReady) for e in seen)
        previews = [e for e in seen if isinstance(e, Preview)]
        assert previews and previews[0].node_id == "3"
        assert previews[0].content_type == "image/jpeg" and previews[0].data[:2] == b"\xff\xd8"
        [output] = done.get_outputs(OUTPUT_NODE)
        data = await output.to_bytes()
        assert re.fullmatch(r"kiln_\d{5}_\.png", output.name), output.name
        assert output.size_bytes == len(data)
        assert data.startswith(b"\x89PNG") and await output.to_bytes(range=(0, 3)) == data[:4]
        wf = await job.get_workflow()
        assert wf.format == "api"
        assert wf.graph[IMAGE_NODE]["inputs"]["image"]["info"]["id"] == asset.id
    return job, done, data


async def test_events_replay_the_history_and_resume_after_last_event_id(
    served: tuple[str, ApiUnderTest],
) -> None:
    _, api = served
    answer = await api.client.post("/api/v2/jobs", json={"workflow": graph(6)})
    job_id = answer.json()["id"]
    await wait_until(lambda: _is(api, job_id, "succeeded"), 30)
    history = await _sse(api.client, job_id)
    assert all(e.get("id") for e in history)
    statuses = [json.loads(e["data"])["status"] for e in history if e["event"] == "status"]
    assert statuses[0] == "queued" and statuses[-1] == "succeeded" and "running" in statuses
    for event in history:
        data = json.loads(event["data"])
        {"status": StatusEvent, "progress": Progress, "preview": PreviewEvent, "output": Output}[
            event["event"]
        ].model_validate(data)
    first_id = history[0]["id"]
    resumed = await _sse(api.client, job_id, last=first_id)
    assert [e["id"] for e in resumed] == [
        e["id"] for e in history[1:] if e["event"] != "progress" and e["event"] != "preview"
    ]
    assert json.loads(resumed[-1]["data"])["status"] == "succeeded"
    decoder = SSEDecoder()  # the client's own decoder reads the stream too
    frames = [
        f
        for e in history
        for f in decoder.push(f"event: {e['event']}")
        + decoder.push(f"data: {e['data']}")
        + decoder.push("")
    ]
    assert frames[-1].event == "status" and frames[-1].data["status"] == "succeeded"


async def _is(api: ApiUnderTest, job_id: str, status: str) -> bool:
    return (await api.client.get(f"/api/v2/jobs/{job_id}")).json()["status"] == status


async def test_a_node_failure_names_the_node(
    served: tuple[str, ApiUnderTest], comfyui_url: str
) -> None:
    _, api = served
    fault = {
        "class_type": "ImageScale",
        "exception_type": "ValueError",
        "exception_message": "width must be positive",
    }
    httpx.post(f"{comfyui_url}/standin/faults", json={"raise": fault}).raise_for_status()
    job_id = (await api.client.post("/api/v2/jobs", json={"workflow": scaled(4)})).json()["id"]
    await wait_until(lambda: _is(api, job_id, "failed"), 30)
    job = Job.model_validate((await api.client.get(f"/api/v2/jobs/{job_id}")).json())
    assert job.error is not None
    assert (job.error.code, job.error.node_id, job.error.class_type) == (
        "node_execution_error",
        "12",
        "ImageScale",
    )
    assert job.error.message and "width must be positive" in job.error.message
    events = await _sse(api.client, job_id)
    assert [e["event"] for e in events[-2:]] == ["log", "status"]


async def test_a_workflow_comfyui_refuses_names_the_node(served: tuple[str, ApiUnderTest]) -> None:
    _, api = served
    nodes = graph(next(SEEDS))
    nodes["4"]["inputs"]["ckpt_name"] = "missing.safetensors"  # not on the instance
    job_id = (await api.client.post("/api/v2/jobs", json={"workflow": nodes})).json()["id"]
    await wait_until(lambda: _is(api, job_id, "failed"), 30)
    job = Job.model_validate((await api.client.get(f"/api/v2/jobs/{job_id}")).json())
    assert job.error is not None
    assert (job.error.code, job.error.node_id, job.error.class_type) == (
        "invalid_prompt",
        "4",
        "CheckpointLoaderSimple",
    )
    assert job.error.message and "ckpt_name: 'missing.safetensors' not in" in job.error.message


async def test_cancel_a_queued_a_running_and_a_finished_job(
    served: tuple[str, ApiUnderTest],
) -> None:
    _, api = served
    waiting = graph(11, steps=5000)  # runs until the cancel interrupts it
    running = (await api.client.post("/api/v2/jobs", json={"workflow": waiting})).json()["id"]
    await wait_until(lambda: _is(api, running, "running"), 30)
    queued = (await api.client.post("/api/v2/jobs", json={"workflow": waiting})).json()["id"]
    assert (await api.client.get(f"/api/v2/jobs/{queued}")).json()["queue_position"] == 1
    async with alice() as comfy:
        handle = await comfy.jobs.get(queued)
        await handle.cancel()
        assert handle.status == "canceled"
        running_handle = await comfy.jobs.get(running)
        await running_handle.cancel()
        assert running_handle.status == "canceling"
        await running_handle.wait(timeout=30)
        assert running_handle.status == "canceled"
        again = await running_handle.cancel()
        assert again.status == "canceled"


@pytest.mark.usefixtures("served")
async def test_a_stream_open_on_a_running_job_sees_canceling_then_canceled() -> None:
    # Given a running job (a KSampler that runs until the cancel interrupts it), and its
    # stream open in the official client
    waiting = graph(next(SEEDS), steps=5000)
    async with alice() as comfy:
        job = await comfy.submit(comfy.workflows.from_json(waiting))
        events = job.events()
        seen = []
        async for event in events:  # until the stream says its KSampler steps
            seen.append(event)
            if isinstance(event, ProgressEvent) and event.step is not None:
                break
        # When its cancel is asked
        await job.cancel()
        seen += [event async for event in events]
    # Then the stream says canceling, then canceled, and nothing runs after that
    statuses = [e.status for e in seen if isinstance(e, StatusChange)]
    assert statuses[-2:] == ["canceling", "canceled"], statuses
    assert statuses.count("canceling") == 1


async def test_a_cancel_asked_through_another_api_node_reaches_an_open_stream(
    queued_only: tuple[str, ApiUnderTest],
) -> None:
    # Given a job a worker elsewhere runs (claimed on the shared store), its stream open
    _, api = queued_only
    job_id = (await api.client.post("/api/v2/jobs", json={"workflow": graph(14)})).json()["id"]
    [claimed] = await api.kiln.engine.store.claim(
        worker_id="gpu-node-2", kinds=["comfy.workflow"], limit=1, lease_ttl_s=600
    )
    assert claimed.id == job_id
    async with alice() as comfy:
        job = await comfy.jobs.get(job_id)
        events = job.events()
        seen = [await anext(events)]
        # When another API node asks the cancel (written to the store: this process's
        # engine hears nothing of it)
        await api.kiln.engine.store.request_cancel(job_id)
        async with asyncio.timeout(30):
            async for event in events:
                seen.append(event)
                if isinstance(event, StatusChange) and event.status == "canceling":
                    break
        await events.aclose()
    # Then the stream says canceling (the worker elsewhere has yet to stop)
    assert [e.status for e in seen if isinstance(e, StatusChange)][-1] == "canceling"
    # And a new connection says it too, its id derived from the last status change
    history = await _sse_until(api.client, job_id, _says("canceling"))
    seq, dot, n = history[-1]["id"].partition(".")
    last_seq = max(e.seq for e in await api.kiln.engine.store.events(task_id=job_id))
    assert (int(seq), dot) == (last_seq, ".") and n.isdigit()


async def _sse_until(
    client: httpx.AsyncClient,
    job_id: str,
    until: Callable[[list[dict[str, Any]]], bool],
    last: str | None = None,
) -> list[dict[str, Any]]:
    """A new connection's events (event, id, data) up to the first one where ``until``
    holds of those read so far; then the connection is dropped."""
    found: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    headers = {"Accept": "text/event-stream"}
    if last is not None:
        headers["Last-Event-ID"] = last
    async with client.stream("GET", f"/api/v2/jobs/{job_id}/events", headers=headers) as response:
        async for line in response.aiter_lines():
            if line.startswith(":"):
                continue
            if line:
                field, _, value = line.partition(":")
                current[field] = value.removeprefix(" ")
                continue
            if "data" in current:
                found.append(current)
                if until(found):
                    return found
            current = {}
    raise AssertionError(f"the stream ended first: {found}")


def _says(status: str) -> Callable[[list[dict[str, Any]]], bool]:
    """Whether the last event read is the status event ``status``."""
    return lambda found: (
        found[-1]["event"] == "status" and json.loads(found[-1]["data"]) == {"status": status}
    )


def _steps(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    """Whether ``count`` progress events with a step were read."""
    return lambda found: (
        sum(e["event"] == "progress" and bool(json.loads(e["data"]).get("step")) for e in found)
        >= count
    )


def _order(event_id: str) -> tuple[int, int]:
    seq, _, n = event_id.partition(".")
    return int(seq), int(n or 0)


async def test_a_stream_resumed_from_a_derived_id_sends_no_id_twice(
    served: tuple[str, ApiUnderTest],
) -> None:
    # Given a running job whose stream was dropped after two steps (ids <seq>.<n>)
    _, api = served
    waiting = graph(next(SEEDS), steps=5000)  # runs until the cancel interrupts it
    job_id = (await api.client.post("/api/v2/jobs", json={"workflow": waiting})).json()["id"]
    first = await asyncio.wait_for(_sse_until(api.client, job_id, _steps(2)), 30)
    last = first[-1]["id"]
    assert "." in last, first
    # When it is resumed from that id, and the job's cancel is asked after a step more
    stepped = asyncio.Event()

    def canceled(found: list[dict[str, Any]]) -> bool:
        if _steps(1)(found):
            stepped.set()
        return _says("canceled")(found)

    reading = asyncio.create_task(_sse_until(api.client, job_id, canceled, last=last))
    await asyncio.wait_for(stepped.wait(), 30)
    assert (await api.client.post(f"/api/v2/jobs/{job_id}/cancel")).status_code == 200
    resumed = await asyncio.wait_for(reading, 30)
    # Then every id goes on after the one resumed from: progress and canceling alike
    assert [json.loads(e["data"]) for e in resumed if e["event"] == "status"][-2:] == [
        {"status": "canceling"},
        {"status": "canceled"},
    ]
    ids = [_order(e["id"]) for e in first + resumed]
    assert ids == sorted(set(ids)), ids
    assert all(_order(e["id"]) > _order(last) for e in resumed), (last, resumed)


async def test_other_tenants_jobs_are_not_found(served: tuple[str, ApiUnderTest]) -> None:
    base, api = served
    job_id = (await api.client.post("/api/v2/jobs", json={"workflow": graph(12)})).json()["id"]
    async with httpx.AsyncClient(base_url=base, headers=bearer(BOB_KEY)) as bob:
        for path in ("", "/workflow", "/events"):
            error_of(await bob.get(f"/api/v2/jobs/{job_id}{path}"), 404, "not_found")
        error_of(await bob.post(f"/api/v2/jobs/{job_id}/cancel"), 404, "not_found")
        assert (await bob.get("/api/v2/jobs")).json() == {"jobs": []}
    async with AsyncComfy(api_key=BOB_KEY) as comfy:
        with pytest.raises(NotFound):
            await comfy.jobs.get(job_id)


async def test_lists_page_with_next_cursor(queued_only: tuple[str, ApiUnderTest]) -> None:
    _, api = queued_only
    made = []
    for n in range(5):
        labels = {"batch": "even" if n % 2 == 0 else "odd"}
        answer = await api.client.post(
            "/api/v2/jobs", json={"workflow": graph(100 + n), "metadata": labels}
        )
        made.append(answer.json()["id"])
    pages: list[list[str]] = []
    cursor = None
    while True:
        query = {"limit": 2} if cursor is None else {"limit": 2, "cursor": cursor}
        page = (await api.client.get("/api/v2/jobs", params=query)).json()
        for item in page["jobs"]:
            Job.model_validate(item)
        pages.append([item["id"] for item in page["jobs"]])
        cursor = page.get("next_cursor")
        if cursor is None:
            break
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [i for p in pages for i in p] == made[::-1]
    evens = (await api.client.get("/api/v2/jobs", params={"metadata[batch]": "even"})).json()
    assert [i["id"] for i in evens["jobs"]] == [made[4], made[2], made[0]]
    queued = (await api.client.get("/api/v2/jobs", params={"status": "queued,running"})).json()
    assert len(queued["jobs"]) == 5 and "next_cursor" not in queued
    done = (await api.client.get("/api/v2/jobs", params={"status": "succeeded"})).json()
    assert done == {"jobs": []}
    error_of(
        await api.client.get("/api/v2/jobs", params={"status": "done"}), 400, "invalid_request"
    )
    error_of(await api.client.get("/api/v2/jobs", params={"cursor": "x"}), 400, "invalid_request")
    error_of(await api.client.get("/api/v2/jobs", params={"limit": 0}), 400, "invalid_request")
    async with alice() as comfy:
        listed = [summary async for summary in comfy.list_jobs(limit=2)]
        assert [s.id for s in listed] == made[::-1]
        odd = [s.id async for s in comfy.list_jobs(metadata={"batch": "odd"}, limit=1)]
        assert odd == [made[3], made[1]]


async def test_a_full_queue_is_429_queue_full_with_retry_after(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    limited = settings.with_(tenant_rate=Rate(per_s=0.01, burst=1))
    async with comfy_server(limited) as (_, api):
        first = await api.client.post("/api/v2/jobs", json={"workflow": graph(1)})
        assert first.status_code == 201
        refused = await api.client.post("/api/v2/jobs", json={"workflow": graph(2)})
        error_of(refused, 429, "queue_full")
        assert int(refused.headers["Retry-After"]) >= 1
        assert await jobs_of(api) == 1


async def test_any_file_is_an_asset_and_lost_bytes_are_output_unavailable(
    queued_only: tuple[str, ApiUnderTest],
) -> None:
    _, api = queued_only
    notes = b"a text asset, not an image"
    files = {"file": ("notes.txt", notes, "text/plain")}
    made = await api.client.post("/api/v2/assets", files=files, data={"file_path": "notes.txt"})
    assert made.status_code == 201, made.text
    asset = Asset.model_validate(made.json())
    assert (asset.content_type, asset.size_bytes) == ("text/plain", len(notes))
    await api.kiln.storage.delete(inputs.input_key(hashlib.sha256(notes).hexdigest()))
    error_of(await api.client.get(f"/api/v2/assets/{asset.id}/content"), 404, "output_unavailable")
    assert (await api.client.head(f"/api/v2/assets/by-hash/{asset.hash}")).status_code == 404
    ref = {"__type": "core/ASSET", "info": {"id": asset.id}}
    gone = await api.client.post("/api/v2/jobs", json={"workflow": graph(image=ref)})
    error_of(gone, 422, "missing_asset")
    again = await api.client.post("/api/v2/assets", files=files, data={"file_path": "notes.txt"})
    assert again.status_code == 201 and again.json()["created_new"] is True
    content = await api.client.get(f"/api/v2/assets/{again.json()['id']}/content")
    assert content.content == notes
