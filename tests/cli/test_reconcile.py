"""`kiln reconcile`: storage against the store, on a data dir written by a real worker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
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
    assert "0 tasks rerun, 0 marked FAILED" in repaired
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


def test_repair_marks_a_task_whose_output_is_gone_failed_result_lost(tmp_path: Path) -> None:
    # Given a SUCCESS task whose output was deleted behind the store's back
    [lost] = run_tasks(tmp_path, fox("a red fox"))
    output_path(tmp_path, lost).unlink()

    # When reconcile repairs with the fail policy
    code, raw = reconcile(tmp_path, "--repair", "--result-lost", "fail", "--json")
    after = asyncio.run(_get(tmp_path, lost.id))

    # Then the task is FAILED result_lost with no result, and the pass counts it repaired
    report = json.loads(raw)
    assert code == 0, raw
    assert (report["lost_tasks"], report["failed_count"], report["rerun_count"]) == (1, 1, 0)
    assert report["repaired"] == [{"task_id": lost.id, "action": "failed"}]
    assert after.status is kiln.Status.FAILED
    assert after.result is None
    assert after.error is not None and after.error["code"] == "result_lost"
    assert after.epoch == lost.epoch + 1
    # And the same request now makes a new task: a FAILED task is no dedup answer
    again = asyncio.run(_submit(tmp_path, fox("a red fox")))
    assert again.id != lost.id


def test_repair_reruns_a_corrupt_output_by_the_policy_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a SUCCESS task whose output was overwritten, and the rerun policy in the env
    [task] = run_tasks(tmp_path, fox("a red fox"))
    path = output_path(tmp_path, task)
    path.write_bytes(b"x" * path.stat().st_size)
    monkeypatch.setenv("KILN_RESULT_LOST_POLICY", "rerun")

    # When reconcile repairs, then a worker runs what is due
    code, out = reconcile(tmp_path, "--repair")
    retried = asyncio.run(_get(tmp_path, task.id))
    lost_attempt = [f.name for f in path.parent.iterdir()]  # the lost attempt's files
    [done] = asyncio.run(_run_existing(tmp_path, [task.id]))
    last_code, last = reconcile(tmp_path)

    # Then the task went back to RETRYING with one more attempt, and ran to a new output
    assert code == 0, out
    assert f"repaired: task {task.id} rerun (result_lost)" in out
    assert "1 tasks rerun, 0 marked FAILED" in out
    assert retried.status is kiln.Status.RETRYING
    assert retried.result is None and retried.finished_at is None
    assert retried.max_attempts == task.max_attempts + 1
    assert done.status is kiln.Status.SUCCESS
    assert done.attempt == task.attempt + 1
    new_output = output_path(tmp_path, done)
    assert new_output != path and new_output.exists()
    # And the lost attempt's objects went with the repair, so storage and store agree
    assert lost_attempt == []
    assert last_code == 0 and "clean" in last, last


def test_the_report_keeps_exact_counts_and_at_most_the_asked_examples(tmp_path: Path) -> None:
    # Given five orphan objects
    for n in range(5):
        leftover = tmp_path / "results" / "tasks" / f"tsk_gone{n}" / "1-1" / "image.png"
        leftover.parent.mkdir(parents=True)
        leftover.write_bytes(b"leftover")

    # When the report may show two examples
    code, raw = reconcile(tmp_path, "--json", "--examples", "2")
    text_code, text = reconcile(tmp_path, "--examples", "2")

    # Then the counts are exact, the lists short, and the report says so
    report = json.loads(raw)
    assert code == text_code == 1
    assert (report["orphan_count"], report["orphan_bytes"]) == (5, 40)
    assert len(report["orphans"]) == 2
    assert report["truncated"] is True
    assert text.count("orphan: ") == 2
    assert "lists show at most 2 items each; the counts are exact" in text
    assert "5 orphans (40 bytes)" in text


async def _get(data_dir: Path, task_id: str) -> Task:
    app = kiln.App(settings=settings_for(data_dir))
    async with app:
        return await app.get(task_id)


async def _run_existing(data_dir: Path, ids: list[str]) -> list[Task]:
    app = kiln.App(settings=settings_for(data_dir))
    demo.register(app)
    async with app, running(app.worker(concurrency=2, resources={"gpu": 2}).run()):
        return [await app.wait(task_id, timeout_s=30) for task_id in ids]


def test_reconcile_of_a_damaged_database_exits_2_with_one_line(tmp_path: Path) -> None:
    # Given a data dir whose database file is not a SQLite database
    (tmp_path / "kiln.db").write_bytes(b"not a database\n" * 500)
    # When `kiln reconcile` runs as a real process
    done = subprocess.run(
        [sys.executable, "-m", "kiln", "reconcile", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    # Then it exits 2 with one line naming the file and what to do, and no traceback
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "kiln.db" in lines[0] and "KILN_DATABASE_URL" in lines[0]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
