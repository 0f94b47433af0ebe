"""The chaos run's checks of its comfy.workflow jobs (benchmarks/chaos_comfy.py) catch
what they claim to: they pass on jobs that kept their promises and fail on a job left
running, a failing node that succeeded, an output not in storage or not the image an
instance saved, and a graph run to its end more often than its job was attempted."""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kiln.states import Status
from kiln.storage import Storage, open_storage

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
IMAGE = b"\x89PNG a picture of job 0"


@pytest.fixture
def comfy(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the chaos modules import each other
    return importlib.import_module("chaos_comfy")


def task(status: Status, attempt: int = 1, **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(
        **{"status": status, "attempt": attempt, "error": None, "result": None, **fields}
    )


class Jobs:
    """Two jobs as a run leaves them: ``ok`` (job 0) SUCCESS with its image stored and
    saved by instance 0, ``bad`` (job 1, a failing node) FAILED by node 10."""

    def __init__(self, comfy: ModuleType, tmp_path: Path) -> None:
        self.comfy = comfy
        self.roots = [tmp_path / "comfy-0", tmp_path / "comfy-1"]
        for root in self.roots:
            (root / "output").mkdir(parents=True)
        self.storage: Storage = open_storage((tmp_path / "results").as_uri())
        self.save(0, 1, IMAGE)
        key = "tasks/ok/1-1/9-chaos-c0_00001_.png"
        self.output = {
            "name": "9-chaos-c0_00001_.png",
            "key": key,
            "content_type": "image/png",
            "size": len(IMAGE),
            "sha256": hashlib.sha256(IMAGE).hexdigest(),
        }
        error = {"code": "node_execution_error", "details": [{"node_id": "10"}]}
        self.tasks = {
            "ok": task(Status.SUCCESS, result={"outputs": [self.output]}),
            "bad": task(Status.FAILED, error=error),
        }
        self.made = {"ok": (0, False), "bad": (1, True)}

    def save(self, root: int, counter: int, data: bytes, n: int = 0) -> None:
        (self.roots[root] / "output" / f"chaos-c{n}_{counter:05}_.png").write_bytes(data)

    async def failed(self) -> set[str]:
        snap = SimpleNamespace(tasks=self.tasks)
        found = [
            self.comfy.check_final(snap, self.made),
            await self.comfy.check_outputs(snap, self.storage, self.made, self.roots),
            self.comfy.check_runs(snap, self.made, self.roots),
        ]
        self.checked = {check.key: check.checked for check in found}
        return {check.key for check in found if not check.ok}


@pytest.fixture
async def jobs(comfy: ModuleType, tmp_path: Path) -> Jobs:
    made = Jobs(comfy, tmp_path)
    await made.storage.put(made.output["key"], IMAGE)
    return made


async def test_jobs_that_kept_their_promises_pass(jobs: Jobs) -> None:
    assert await jobs.failed() == set()
    assert jobs.checked == {"CF1": 2, "CF2": 1, "CF3": 2}


async def test_a_job_left_running_fails_cf1(jobs: Jobs) -> None:
    jobs.tasks["ok"] = task(Status.GENERATING)
    assert await jobs.failed() == {"CF1"}


async def test_a_failing_node_that_succeeded_or_failed_otherwise_fails_cf1(jobs: Jobs) -> None:
    jobs.tasks["bad"] = task(Status.FAILED, error={"code": "comfyui_unavailable"})
    assert await jobs.failed() == {"CF1"}
    jobs.tasks["bad"] = task(Status.SUCCESS, result={"outputs": []})
    assert "CF1" in await jobs.failed()


async def test_an_output_not_stored_or_not_the_saved_image_fails_cf2(jobs: Jobs) -> None:
    await jobs.storage.put(jobs.output["key"], IMAGE[:-1] + b"!")
    assert await jobs.failed() == {"CF2"}
    await jobs.storage.put(jobs.output["key"], IMAGE)
    jobs.save(0, 1, b"another picture")
    assert await jobs.failed() == {"CF2"}


async def test_a_graph_run_more_often_than_attempted_fails_cf3(jobs: Jobs) -> None:
    jobs.save(1, 1, IMAGE)  # job 0 ran to its end on both instances, in one attempt
    assert await jobs.failed() == {"CF3"}
    jobs.tasks["ok"].attempt = 2  # two attempts: one run each is allowed
    assert await jobs.failed() == set()
    jobs.save(0, 1, IMAGE, n=1)  # the failing job's graph ran to its end
    assert await jobs.failed() == {"CF3"}


def test_a_run_whose_instances_were_never_killed_fails_ch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    chaos = importlib.import_module("chaos")
    figures: dict[str, Any] = {
        "worker_kills": 3,
        "storage_faults": 9,
        "cancelled_pending": 2,
        "cancelled_running": 1,
        "tasks_retried": 5,
        "permanent": 2,
        "supervisor_restarts": 1,
        "finished_in_time": True,
        "exited_by_themselves": [],
        "batched_calls": 4,
        "sqlite": False,
        "comfy_jobs": 10,
        "comfy_failing": 2,
        "comfy_instance_kills": 3,
        "comfy_exited_by_themselves": [],
    }
    assert chaos.chaos_happened(figures).ok
    assert not chaos.chaos_happened({**figures, "comfy_instance_kills": 0}).ok
    assert not chaos.chaos_happened({**figures, "comfy_exited_by_themselves": ["pid 1"]}).ok
