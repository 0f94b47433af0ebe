"""The Comfy API v2 end to end, every part a real process: `kiln serve --no-workers` (the
API and the supervisor), two stand-in ComfyUI processes (tests/services/comfyui_standin.py)
and two `kiln worker --kinds comfy.workflow` processes, each driving its own instance.
The caller is the official, unmodified `comfy-sdk` (raw HTTP where the client has no call,
as for `Last-Event-ID`); every answer is validated against the client's own generated
models (`comfy_low.models`). The processes are shared by the module's SQLite tests (a test
that kills one starts it again); the lifecycle also runs on PostgreSQL with S3 storage.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from blake3 import blake3
from comfy_low.models import (
    Asset,
    ErrorEnvelope,
    Job,
    LogEvent,
    Output,
    PreviewEvent,
    Progress,
    StatusEvent,
)
from comfy_low.sse import SSEDecoder
from comfy_sdk import AsyncComfy, JobFailed, NotFound
from tests.services.comfyui_nodes import txt2img
from tests.services.comfyui_standin import DEFAULT_CHECKPOINTS, Process
from tests.services.seaweed import CREDENTIALS

from .cli_workers import CliWorkers
from .conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
KIND = "comfy.workflow"
CKPTS = DEFAULT_CHECKPOINTS
ALICE = "key-alice-0123456789"
BOB = "key-bob-0123456789"
EVENT_MODELS: dict[str, Any] = {
    "status": StatusEvent,
    "progress": Progress,
    "preview": PreviewEvent,
    "output": Output,
    "log": LogEvent,
}
SEED = iter(range(1000, 100_000))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Cluster:
    """`kiln serve --no-workers`, two stand-in ComfyUI instances and a `kiln worker
    --kinds comfy.workflow` for each, on one database and one storage."""

    def __init__(self, root: Path, database_url: str, **env: str) -> None:
        self.group = CliWorkers(
            root / "kiln",
            database_url,
            KILN_API_KEYS=f"alice:{ALICE},bob:{BOB}",
            KILN_LEASE_TTL_S="2",
            KILN_RETRY_BASE_S="0.05",
            KILN_RETRY_MAX_S="0.2",
            KILN_SUPERVISOR_INTERVAL_S="0.2",
            KILN_BREAKER_OPEN_S="120",
            **env,
        )
        self.instances = [self._instance(root / f"comfy-{n}") for n in range(2)]
        #: every worker process started, with the instance it drives
        self.started: list[tuple[int, subprocess.Popen[bytes]]] = []
        #: the worker process of each instance (replaced when a test kills one)
        self.workers = [self.start_worker(n) for n in range(2)]
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve = self.start_serve()

    @staticmethod
    def _instance(root: Path, *port: str) -> Process:
        return Process(root, "--step-s", "0.05", "--load-s", "0.3", *port)

    def start_worker(self, index: int) -> subprocess.Popen[bytes]:
        self.group.env["KILN_COMFYUI_URL"] = self.instances[index].url
        proc = self.group.start("--kinds", KIND)
        self.started.append((index, proc))
        return proc

    def start_serve(self) -> subprocess.Popen[bytes]:
        log = self.group.root / f"serve-{len(self.group.procs)}.log"
        with log.open("wb") as out:
            args = ["serve", "--no-workers", "--port", str(self.port)]
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.group.env,
                cwd=self.group.root,
            )
        self.group.procs.append((proc, log))
        deadline = time.monotonic() + 30
        while not _healthy(self.url):
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, f"kiln serve on {self.url} did not start"
            time.sleep(0.05)
        return proc

    def restart_instance(self, index: int) -> None:
        """Start instance ``index`` again on its port, and a fresh worker for it."""
        old = self.instances[index]
        port = old.url.rsplit(":", 1)[1]
        old.stop()
        self.instances[index] = self._instance(old.root, "--port", port)
        self.group.kill(self.workers[index])
        self.workers[index] = self.start_worker(index)

    def log(self, index: int) -> dict[str, Any]:
        """Instance ``index``'s ``/standin/log``: prompts run, interrupts, loads."""
        answer: dict[str, Any] = httpx.get(f"{self.instances[index].url}/standin/log").json()
        return answer

    def prompts(self) -> int:
        return sum(len(self.log(n)["prompts"]) for n in (0, 1))

    def ran(self, task_id: str) -> list[int]:
        """The instances whose workers stored the job's outputs (``uploaded`` log lines)."""
        return [n for n in (0, 1) if task_id in self.logged(n, "uploaded")]

    def logged(self, index: int, event: str) -> list[str]:
        """The task ids of ``event`` lines in the logs of instance ``index``'s workers."""
        found = []
        mine = [proc for n, proc in self.started if n == index]
        for proc, log in self.group.procs:
            if proc not in mine:
                continue
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("{") and f'"{event}"' in line:
                    record = json.loads(line)
                    if record.get("event") == event:
                        found.append(str(record.get("task_id")))
        return found

    def stop(self) -> None:
        self.group.stop()
        for instance in self.instances:
            instance.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The processes on SQLite and local storage, shared by the module's tests."""
    root = tmp_path_factory.mktemp("comfy-api")
    made = Cluster(root, f"sqlite:///{root / 'kiln.db'}")
    try:
        yield made
    finally:
        made.stop()
        sys.stderr.write(made.group.tail())


@pytest.fixture
def sqlite_cluster(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """The shared processes, the client pointed at their `kiln serve`, no faults set."""
    for instance in cluster.instances:
        httpx.post(f"{instance.url}/standin/faults", json={}).raise_for_status()
    deadline = time.monotonic() + 60  # a killed worker's prompt runs on to its end
    while not idle(cluster):
        assert time.monotonic() < deadline, "the instances did not become idle"
        time.sleep(0.05)
    monkeypatch.setenv("COMFY_BASE_URL", cluster.url)
    return cluster


@pytest.fixture
def postgres_cluster(
    tmp_path: Path,
    postgres_server: Any,
    s3_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Cluster]:
    """The processes on PostgreSQL and S3 storage (SeaweedFS)."""
    storage = s3_server.url("comfy-api")
    database = str(postgres_server.new_database())
    made = Cluster(tmp_path, database, KILN_STORAGE_URL=storage, **CREDENTIALS)
    monkeypatch.setenv("COMFY_BASE_URL", made.url)
    try:
        yield made
    finally:
        made.stop()
        sys.stderr.write(made.group.tail())


def alice() -> AsyncComfy:
    return AsyncComfy(api_key=ALICE)


def bearer(key: str = ALICE) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def job_json(cluster: Cluster, job_id: str, key: str = ALICE) -> dict[str, Any]:
    """``GET /api/v2/jobs/{id}``, validated as the client's Job."""
    answer = httpx.get(f"{cluster.url}/api/v2/jobs/{job_id}", headers=bearer(key))
    assert answer.status_code == 200, answer.text
    Job.model_validate(answer.json())
    body: dict[str, Any] = answer.json()
    return body


def refused(answer: httpx.Response, status: int, code: str) -> None:
    assert answer.status_code == status, answer.text
    assert ErrorEnvelope.model_validate(answer.json()).error.code == code


def png(color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buffer, format="PNG")
    return buffer.getvalue()


def graph(ckpt: str = CKPTS[0], *, steps: int = 3, image: bool = False) -> dict[str, Any]:
    """ComfyUI's text-to-image graph (a seed no other job of the module has: ComfyUI
    would serve a graph it just ran from its cache); with ``image``, a LoadImage node
    ``10`` (its file set by the test) shown by a PreviewImage node ``11``."""
    nodes = txt2img(ckpt, seed=next(SEED), steps=steps, size=32)
    if image:
        nodes["10"] = {"class_type": "LoadImage", "inputs": {"image": "placeholder.png"}}
        nodes["11"] = {"class_type": "PreviewImage", "inputs": {"images": ["10", 0]}}
    return nodes


async def running_on(cluster: Cluster, job_id: str, nodes: dict[str, Any]) -> tuple[int, str]:
    """Wait until the job runs and its prompt (the graph ``nodes``: its seed is its own)
    runs on an instance: (the instance's index, the prompt id)."""
    found: list[tuple[int, str]] = []
    seed = nodes["3"]["inputs"]["seed"]

    async def runs() -> bool:
        if job_json(cluster, job_id)["status"] != "running":
            return False
        for index, instance in enumerate(cluster.instances):
            for row in httpx.get(f"{instance.url}/queue").json()["queue_running"]:
                if row[2]["3"]["inputs"]["seed"] == seed:
                    found[:] = [(index, row[1])]
        return bool(found)

    await wait_until(runs, timeout_s=60, interval_s=0.05, what=f"{job_id} running")
    return found[0]


def idle(cluster: Cluster) -> bool:
    """Whether no instance runs or holds a prompt."""
    empty = {"queue_running": [], "queue_pending": []}
    return all(httpx.get(f"{i.url}/queue").json() == empty for i in cluster.instances)


def attempt_of(cluster: Cluster, job_id: str) -> int:
    answer = httpx.get(f"{cluster.url}/v1/tasks/{job_id}", headers=bearer())
    assert answer.status_code == 200, answer.text
    attempt: int = answer.json()["attempt"]
    return attempt


# Events ---------------------------------------------------------------------------------


def _order(event_id: str) -> tuple[int, int]:
    seq, _, n = event_id.partition(".")
    return int(seq), int(n or 0)


async def sse(
    cluster: Cluster,
    job_id: str,
    *,
    last: str | None = None,
    until: Callable[[list[dict[str, Any]]], bool] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """One connection's events (``id``, ``event``, ``data``), decoded by the client's own
    decoder and validated against its models; read until ``until`` holds (then the
    connection is dropped) or the server ends the stream: (events, ended by the server)."""
    headers = {**bearer(), "Accept": "text/event-stream"}
    if last is not None:
        headers["Last-Event-ID"] = last
    found: list[dict[str, Any]] = []
    decoder, event_id = SSEDecoder(), None
    url = f"{cluster.url}/api/v2/jobs/{job_id}/events"
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("GET", url, headers=headers) as answer,
    ):
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("id:"):
                event_id = line.partition(":")[2].strip()
            for frame in decoder.push(line):
                EVENT_MODELS[frame.event].model_validate(frame.data)
                found.append({"id": event_id, "event": frame.event, "data": frame.data})
            if until is not None and not line and until(found):
                return found, False
    return found, True


def _has_progress(events: list[dict[str, Any]]) -> bool:
    return any(e["event"] == "progress" and e["data"].get("step") for e in events)


async def events_resume(
    cluster: Cluster, job_id: str, nodes: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Open the job's stream while it runs, drop it after the first step, resume with
    ``Last-Event-ID``: the history comes first, the ids go on from the status change
    resumed after, the stream ends itself after the terminal status. The two
    connections' events."""
    await running_on(cluster, job_id, nodes)
    first, ended = await sse(cluster, job_id, until=_has_progress)
    assert not ended
    assert [(e["event"], e["data"]) for e in first[:2]] == [
        ("status", {"status": "queued"}),
        ("status", {"status": "running"}),
    ]  # the history, before anything live
    last = first[-1]["id"]
    resumed, ended = await sse(cluster, job_id, last=last)
    assert ended  # the server closed the stream after the terminal status
    assert resumed[-1]["event"] == "status" and resumed[-1]["data"] == {"status": "succeeded"}
    for events in (first, resumed):
        ids = [_order(e["id"]) for e in events]
        assert ids == sorted(set(ids)), ids  # unique and increasing within a connection
    after = _order(last)[0]  # on from the status change resumed after, nothing before it
    assert all(_order(e["id"])[0] >= after for e in resumed), (last, resumed)
    statuses = [e["data"]["status"] for e in first + resumed if e["event"] == "status"]
    assert statuses == ["queued", "running", "succeeded"]  # nothing sent twice
    assert any(e["event"] == "output" for e in resumed)
    return first, resumed


# The lifecycle ----------------------------------------------------------------------------


async def lifecycle(cluster: Cluster) -> None:
    photo = png((9, 99, 199))
    async with alice() as comfy:
        asset = await uploaded_twice(cluster, comfy, photo)
        nodes = graph(steps=30, image=True)
        workflow = comfy.workflows.from_json(nodes)
        workflow.set_input("10", "image", asset)
        job = await comfy.submit(workflow, metadata={"suite": "e2e"})
        await events_resume(cluster, job.id, nodes)
        done = await job.result()
        assert done.metadata == {"suite": "e2e"}
        [output] = done.get_outputs("9")
        data = await output.to_bytes()
    body = job_json(cluster, job.id)
    [out] = body["outputs"]
    # the output's size and hashes are those of the bytes its absolute url serves
    assert out["url"] == f"{cluster.url}/api/v2/assets/{out['id']}/content"
    served = httpx.get(out["url"], headers=bearer())
    assert served.status_code == 200 and served.content == data
    assert out["size_bytes"] == len(data) == output.size_bytes
    assert out["sha256"] == hashlib.sha256(data).hexdigest()
    assert out["hash"] == "blake3:" + blake3(data).hexdigest()
    assert (
        Asset.model_validate(
            httpx.get(f"{cluster.url}/api/v2/assets/{out['id']}", headers=bearer()).json()
        ).hash
        == out["hash"]
    )

    # the image is the one its instance saved; the instance loaded the asset's bytes
    async def logged() -> bool:  # the worker logs the upload as it ends the job
        return bool(cluster.ran(job.id))

    await wait_until(logged, timeout_s=10, what="the worker's uploaded line")
    [index] = cluster.ran(job.id)
    root = cluster.instances[index].root
    assert (root / "output" / out["name"]).read_bytes() == data
    sha = hashlib.sha256(photo).hexdigest()
    assert (root / "input" / f"kiln-{sha}.png").read_bytes() == photo


async def uploaded_twice(cluster: Cluster, comfy: AsyncComfy, photo: bytes) -> Any:
    """The same bytes uploaded twice (by the client, then by hand) are one asset."""
    first = comfy.assets.from_bytes(photo, filename="photo.png", content_type="image/png")
    asset_id = await first.commit()
    second = comfy.assets.from_bytes(photo, filename="again.png", content_type="image/png")
    assert await second.commit() == asset_id and second.created_new is False
    by_hand = httpx.post(
        f"{cluster.url}/api/v2/assets",
        headers=bearer(),
        files={"file": ("third.png", photo, "image/png")},
        data={"file_path": "third.png"},
    )
    assert by_hand.status_code == 200, by_hand.text
    again = Asset.model_validate(by_hand.json())
    assert (again.id, again.created_new, again.size_bytes) == (asset_id, False, len(photo))
    assert again.hash == "blake3:" + blake3(photo).hexdigest()
    content = httpx.get(str(again.url), headers=bearer())
    assert content.content == photo
    return first


async def test_the_lifecycle_on_sqlite_and_local_storage(sqlite_cluster: Cluster) -> None:
    await lifecycle(sqlite_cluster)


async def test_the_lifecycle_on_postgres_and_s3(postgres_cluster: Cluster) -> None:
    await lifecycle(postgres_cluster)


async def test_a_resumed_stream_sends_no_id_twice(sqlite_cluster: Cluster) -> None:
    async with alice() as comfy:
        nodes = graph(steps=40)
        job = await comfy.submit(comfy.workflows.from_json(nodes))
        first, resumed = await events_resume(sqlite_cluster, job.id, nodes)
        await job.result()
    ids = [_order(e["id"]) for e in first + resumed]
    assert ids == sorted(set(ids)), ids


# One process each -------------------------------------------------------------------------


async def test_the_same_idempotency_key_twice_is_one_execution(sqlite_cluster: Cluster) -> None:
    cluster = sqlite_cluster
    before = cluster.prompts()
    nodes = graph(steps=4)
    async with alice() as comfy:
        first = await comfy.submit(comfy.workflows.from_json(nodes), idempotency_key="e2e-1")
        again = await comfy.submit(comfy.workflows.from_json(nodes), idempotency_key="e2e-1")
        assert again.id == first.id
        await first.result()
        replay = httpx.post(
            f"{cluster.url}/api/v2/jobs",
            headers={**bearer(), "Idempotency-Key": "e2e-1"},
            json={"workflow": nodes},
        )
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert Job.model_validate(replay.json()).id == first.id
    assert replay.json()["status"] == "succeeded"
    # ONE execution: one prompt more on the instances, in all
    assert cluster.prompts() - before == 1


async def test_a_cancel_interrupts_the_running_prompt(sqlite_cluster: Cluster) -> None:
    cluster = sqlite_cluster
    async with alice() as comfy:
        nodes = graph(steps=2000)
        job = await comfy.submit(comfy.workflows.from_json(nodes))
        index, prompt_id = await running_on(cluster, job.id, nodes)
        await job.cancel()
        assert job.status == "canceling"
        await job.wait(timeout=60)
        assert job.status == "canceled"
    assert job_json(cluster, job.id)["status"] == "canceled"
    # its instance was told to interrupt that very prompt, and stopped it
    interrupt = {"prompt_id": prompt_id, "running": prompt_id}

    async def interrupted() -> bool:
        return interrupt in cluster.log(index)["interrupts"] and idle(cluster)

    await wait_until(interrupted, timeout_s=10, what="the instance's interrupt")
    history = httpx.get(f"{cluster.instances[index].url}/history/{prompt_id}").json()
    assert history[prompt_id]["status"]["status_str"] == "error"
    events, ended = await sse(cluster, job.id)
    assert ended and events[-1]["data"] == {"status": "canceled"}


async def test_a_failing_node_fails_the_job_with_the_node(sqlite_cluster: Cluster) -> None:
    cluster = sqlite_cluster
    fault = {
        "class_type": "ImageScale",
        "exception_type": "ValueError",
        "exception_message": "width must be positive",
    }
    for instance in cluster.instances:
        httpx.post(f"{instance.url}/standin/faults", json={"raise": fault}).raise_for_status()
    nodes = graph()
    nodes["12"] = {
        "class_type": "ImageScale",
        "inputs": {
            "image": ["8", 0],
            "upscale_method": "bilinear",
            "width": 16,
            "height": 16,
            "crop": "disabled",
        },
    }
    nodes["9"]["inputs"]["images"] = ["12", 0]
    async with alice() as comfy:
        job = await comfy.submit(comfy.workflows.from_json(nodes))
        with pytest.raises(JobFailed):
            await job.result()
    error = Job.model_validate(job_json(cluster, job.id)).error
    assert error is not None
    assert (error.code, error.node_id, error.class_type) == (
        "node_execution_error",
        "12",
        "ImageScale",
    )
    assert error.message is not None and "width must be positive" in error.message
    events, ended = await sse(cluster, job.id)
    assert ended and [e["event"] for e in events[-2:]] == ["log", "status"]
    assert attempt_of(cluster, job.id) == 1  # not retried


async def test_another_tenants_job_and_asset_are_not_found(sqlite_cluster: Cluster) -> None:
    cluster = sqlite_cluster
    async with alice() as comfy:
        asset_id = await comfy.assets.from_bytes(png((1, 2, 3)), filename="a.png").commit()
        job = await comfy.submit(comfy.workflows.from_json(graph()))
        await job.result()
    base = f"{cluster.url}/api/v2"
    paths = [f"jobs/{job.id}", f"jobs/{job.id}/workflow", f"jobs/{job.id}/events"]
    paths += [f"assets/{asset_id}", f"assets/{asset_id}/content", f"assets/{job.outputs[0].id}"]
    for path in paths:
        refused(httpx.get(f"{base}/{path}", headers=bearer(BOB)), 404, "not_found")
    refused(httpx.post(f"{base}/jobs/{job.id}/cancel", headers=bearer(BOB)), 404, "not_found")
    async with AsyncComfy(api_key=BOB) as bob:
        with pytest.raises(NotFound):
            await bob.jobs.get(job.id)
        assert job.id not in [s.id async for s in bob.list_jobs()]


async def test_jobs_of_two_checkpoints_go_mostly_to_the_warm_instance(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    rng = random.Random(5)
    loads = [cluster.log(n)["loads"] for n in (0, 1)]
    prompts = cluster.prompts()
    async with alice() as comfy:
        jobs = [
            await comfy.submit(comfy.workflows.from_json(graph(rng.choice(CKPTS), steps=2)))
            for _ in range(20)
        ]
        for job in jobs:
            await job.result()
    # the instances' own logs: 20 prompts ran, and a checkpoint was loaded only a few times
    assert cluster.prompts() - prompts == 20
    loaded = sum(cluster.log(n)["loads"] - loads[n] for n in (0, 1))
    print(f"20 jobs of 2 checkpoints on 2 instances: {loaded} checkpoint loads")
    assert loaded <= 6, loaded  # in a random order with no routing: about 10


# Killed processes ---------------------------------------------------------------------------


async def test_the_job_of_a_killed_worker_succeeds_on_the_other(sqlite_cluster: Cluster) -> None:
    cluster = sqlite_cluster
    async with alice() as comfy:
        nodes = graph(steps=60)
        job = await comfy.submit(comfy.workflows.from_json(nodes))
        index, _ = await running_on(cluster, job.id, nodes)
        cluster.group.kill(cluster.workers[index])  # SIGKILL: it cleans up nothing
        try:
            await job.wait(timeout=90)
        finally:
            cluster.workers[index] = cluster.start_worker(index)
    assert job.status == "succeeded"
    assert cluster.ran(job.id) == [1 - index] and attempt_of(cluster, job.id) == 2


async def test_the_job_of_a_dead_instance_is_retried_on_the_other(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    async with alice() as comfy:
        nodes = graph(steps=60)
        job = await comfy.submit(comfy.workflows.from_json(nodes))
        index, _ = await running_on(cluster, job.id, nodes)
        cluster.instances[index].kill()  # ComfyUI dies mid-run
        try:
            await job.wait(timeout=90)
        finally:
            cluster.restart_instance(index)  # on its port, with a fresh worker
    assert job.status == "succeeded"
    assert cluster.ran(job.id) == [1 - index] and attempt_of(cluster, job.id) == 2
    failed = [
        line for line in cluster.group.lines("attempt_failed") if line.get("task_id") == job.id
    ]
    assert [line["code"] for line in failed] == ["comfyui_unavailable"]


async def test_jobs_queued_when_kiln_serve_is_killed_all_complete(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    async with alice() as comfy:
        jobs = [await comfy.submit(comfy.workflows.from_json(graph(steps=10))) for _ in range(6)]
        queued = [j.id for j in jobs if job_json(cluster, j.id)["status"] == "queued"]
        assert queued  # two instances run one job each at most
        cluster.serve.send_signal(signal.SIGKILL)
        cluster.serve.wait(timeout=10)
        assert not _healthy(cluster.url)
        cluster.serve = cluster.start_serve()  # on the same port and database
    async with alice() as comfy:
        for job in jobs:
            found = await comfy.jobs.get(job.id)
            await found.wait(timeout=90)
            assert found.status == "succeeded", found.error
            assert len(found.outputs) == 1
