"""A task waiting for a shared pool's slot shows its place in that pool's line, on the
overview and on its page (a `kiln serve` with `KILN_POOLS=gpu-a100:1`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from .conftest import FAST_ENV, Server, launch, unique_prompt, wait_until

pytestmark = pytest.mark.browser


POOL_ENV = {"KILN_POOLS": "gpu-a100:1", "KILN_KIND_RESOURCES": "image.generate=gpu-a100:1"}


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory, chromium_path: str) -> Iterator[Server]:
    """`kiln serve` plus a second worker process on the same data: a process keeps no more
    of a pool's tasks than the pool has slots, so a task waits in the pool's line when
    another process holds the slot."""
    root = tmp_path_factory.mktemp("kiln-pooled")
    server = launch(root, "pooled", None, KILN_GPUS="2", **POOL_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(FAST_ENV, **POOL_ENV)
    with (root / "worker.log").open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "kiln", "worker", "--data-dir", str(root / "pooled"),
             "--concurrency", "2", "--gpus", "2"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
        )  # fmt: skip
    try:
        yield server.wait_healthy()
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)
        server.stop()


@pytest.fixture
def pooled_page(page: Page, pooled: Server) -> Page:
    page.goto(pooled.url + "/")
    return page


def test_a_task_waiting_for_a_pool_slot_shows_its_place_in_line(
    pooled_page: Page, pooled: Server, console_errors: list[str], tmp_path: Path
) -> None:
    page = pooled_page
    # Given the only gpu-a100 slot busy with a slow task, and a second task waiting for it
    busy = pooled.submit(unique_prompt("a slow heron"), steps=100, simulate={"step_ms": 100})
    pooled.wait_status(busy["id"], "GENERATING")
    waiting = pooled.submit(unique_prompt("a waiting owl"), steps=2, simulate={"step_ms": 1})

    def first_in_line() -> dict[str, Any] | None:
        task = pooled.task(waiting["id"])
        wait = task.get("resource_wait")
        return task if wait and wait["position"] == 1 else None

    wait_until(first_in_line, 20, "the owl first in the gpu-a100 line")

    # Then its row says where it stands
    row = page.locator(f'[data-testid="task-row"][data-task-id="{waiting["id"]}"]')
    expect(row).to_contain_text("#1 for gpu-a100", timeout=15_000)
    # And so does its page
    page.goto(f"{pooled.url}/#/tasks/{waiting['id']}")
    expect(page.get_by_test_id("task-page")).to_contain_text(
        "Waiting for gpu-a100 — #1 in line (1 of 1 slots busy)"
    )
    # When the slow task is cancelled, the owl gets the slot and finishes
    cancelled = page.request.post(f"{pooled.url}/v1/tasks/{busy['id']}/cancel")
    assert cancelled.ok
    pooled.wait_status(waiting["id"], "SUCCESS", timeout_s=30)
    expect(page.get_by_test_id("task-page")).not_to_contain_text("Waiting for gpu-a100")
    assert console_errors == []
