"""`kiln reconcile`: storage against the store, on a data dir written by a real worker."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from typer.testing import CliRunner

import kiln
from kiln import demo
from kiln.app import running
from kiln.cli import cli
from kiln.config import Settings
from kiln.models import Task

runner = CliRunner()


def settings_for(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, retry_base_s=0.01, retry_max_s=0.02)


async def _submit(data_dir: Path, params: dict[str, object]) -> Task:
    app = kiln.App(settings=settings_for(data_dir))
    demo.register(app)
    async with app:
        return (await app.submit("image.generate", params)).task


async def _run_tasks(data_dir: Path, params: list[dict[str, object]]) -> list[Task]:
    app = kiln.App(settings=settings_for(data_dir))
    demo.register(app)
    async with app:
        worker = app.worker(concurrency=2, resources={"gpu": 2})
        async with running(worker.run()):
            ids = [(await app.submit("image.generate", p)).task.id for p in params]
            return [await app.wait(task_id, timeout_s=30) for task_id in ids]


def run_tasks(data_dir: Path, *params: dict[str, object]) -> list[Task]:
    """Real tasks run to their end by an in-process worker on ``data_dir``."""
    return asyncio.run(_run_tasks(data_dir, list(params)))


def fox(prompt: str, **simulate: object) -> dict[str, object]:
    return {"prompt": prompt, "width": 64, "height": 64, "steps": 2,
            "simulate": {"step_ms": 0, **simulate}}  # fmt: skip


def reconcile(data_dir: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(cli, ["reconcile", "--data-dir", str(data_dir), *args])
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout


def output_path(data_dir: Path, task: Task) -> Path:
    assert task.result is not None
    key: str = task.result["outputs"][0]["key"]
    return data_dir / "results" / key


def test_reconcile_of_a_clean_data_dir_exits_0(tmp_path: Path) -> None:
    run_tasks(tmp_path, fox("a red fox"), fox("a grey wolf"))

    code, out = reconcile(tmp_path)

    assert code == 0, out
    assert "checked 2 SUCCESS tasks (2 outputs)" in out
    assert "clean" in out


def test_reconcile_names_the_task_whose_output_was_deleted(tmp_path: Path) -> None:
    kept, lost = run_tasks(tmp_path, fox("a red fox"), fox("a grey wolf"))
    output_path(tmp_path, lost).unlink()

    code, out = reconcile(tmp_path)
    json_code, raw = reconcile(tmp_path, "--json")

    assert code == 1
    assert f"missing: task {lost.id}" in out
    assert kept.id not in out
    report = json.loads(raw)
    assert json_code == 1
    assert [m["task_id"] for m in report["missing"]] == [lost.id]
    assert report["missing"][0]["problem"] == "missing"
    assert report["clean"] is False


def test_reconcile_reports_a_corrupt_output(tmp_path: Path) -> None:
    [task] = run_tasks(tmp_path, fox("a red fox"))
    path = output_path(tmp_path, task)
    path.write_bytes(b"x" * path.stat().st_size)

    code, out = reconcile(tmp_path)

    assert code == 1
    assert f"corrupt: task {task.id}" in out


def test_reconcile_finds_orphans_and_repairs_only_old_ones(tmp_path: Path) -> None:
    [task] = run_tasks(tmp_path, fox("a red fox"))
    results = tmp_path / "results" / "tasks"
    old = results / "tsk_gone" / "1-1" / "image.png"
    young = results / "tsk_gone" / "2-2" / "image.png"
    for path in (old, young):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"leftover")
    an_hour_ago = time.time() - 7200
    os.utime(old, (an_hour_ago, an_hour_ago))

    found_code, found = reconcile(tmp_path)
    repair_code, repaired = reconcile(tmp_path, "--repair", "--grace-s", "3600")
    after_code, after = reconcile(tmp_path)

    assert found_code == 1
    assert "orphan: tasks/tsk_gone/1-1/image.png (task tsk_gone (not in the store)" in found
    assert "orphan: tasks/tsk_gone/2-2/image.png" in found
    assert repair_code == 1
    assert "deleted 1 orphan objects older than 3600 s, kept 1 younger ones" in repaired
    assert "no task was changed" in repaired
    assert not old.exists()
    assert young.exists()
    assert output_path(tmp_path, task).exists()
    assert after_code == 1
    assert "tasks/tsk_gone/1-1/image.png" not in after


def test_reconcile_repairs_a_failed_tasks_leftover_but_not_a_live_tasks_upload(
    tmp_path: Path,
) -> None:
    [failed] = run_tasks(tmp_path, fox("a red fox", permanent=True))
    pending = asyncio.run(_submit(tmp_path, fox("a grey wolf")))
    stale = tmp_path / "results" / "tasks" / failed.id / "1-1" / "image.png"
    in_use = tmp_path / "results" / "tasks" / pending.id / "1-1" / "image.png"
    for path in (stale, in_use):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"half")

    code, out = reconcile(tmp_path, "--repair", "--grace-s", "0")
    then_code, _ = reconcile(tmp_path)

    assert failed.status == kiln.Status.FAILED
    assert pending.status == kiln.Status.PENDING
    assert code == 0, out
    assert f"orphan: tasks/{failed.id}/1-1/image.png (task {failed.id} FAILED" in out
    assert pending.id not in out
    assert "deleted 1 orphan objects" in out
    assert not stale.exists()
    assert in_use.exists()
    assert then_code == 0
