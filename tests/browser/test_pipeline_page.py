"""A pipeline's task page in Chromium (docs/pipelines.md): the chain of its steps, each
with its status, progress and output thumbnail, updated live; a step's page links back to
its pipeline."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import Page, expect

from .conftest import Server, unique_prompt

pytestmark = pytest.mark.browser


def test_a_pipeline_page_shows_its_chain_of_steps_live(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given a generate -> thumbnail pipeline whose first step takes a moment
    steps = [
        {"name": "generate", "kind": "image.generate",
         "params": {"prompt": unique_prompt("a lighthouse"), "width": 64, "height": 64,
                    "steps": 8, "simulate": {"step_ms": 150}}},
        {"name": "thumbnail", "kind": "image.transform",
         "params": {"op": "thumbnail", "width": 32, "height": 32},
         "inputs": {"image": "step:generate/image.png"}},
    ]  # fmt: skip
    body = {"kind": "pipeline", "params": {"steps": steps}}
    created = httpx.post(f"{server.url}/v1/tasks", json=body, headers=server.headers())
    assert created.status_code == 201, created.text
    pipeline_id = created.json()["id"]
    # When its page is open while it runs
    page.goto(f"/#/tasks/{pipeline_id}")
    chain = page.get_by_test_id("pipeline-steps")
    first = chain.locator('[data-step="generate/0"]')
    last = chain.locator('[data-step="thumbnail/0"]')
    # Then the chain shows both steps, the second waiting for its input at first
    expect(page.locator(".task-title")).to_have_text("pipeline: generate → thumbnail")
    expect(first).to_be_visible()
    expect(last).to_have_attribute("data-status", "NOT_MADE")
    # And both end SUCCESS with their output thumbnails, and the pipeline with them
    expect(last).to_have_attribute("data-status", "SUCCESS", timeout=20_000)
    expect(first).to_have_attribute("data-status", "SUCCESS")
    expect(first.get_by_test_id("step-output")).to_be_visible()
    expect(last.get_by_test_id("step-output")).to_be_visible()
    expect(page.get_by_test_id("task-page")).to_have_attribute("data-status", "SUCCESS")
    # When a step's link is followed, its page names the pipeline
    last.locator("a.chain-name").click()
    expect(page.get_by_test_id("pipeline-of")).to_contain_text(pipeline_id)
    expect(page.get_by_test_id("pipeline-of")).to_contain_text("thumbnail")
    assert console_errors == []
