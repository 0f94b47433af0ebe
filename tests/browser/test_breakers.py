"""The circuit breaker panel in Chromium: a breaker tripped by upstream errors shows up
open, highlighted, on the overview without a reload."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from .conftest import Server, launch, unique_prompt, wait_until

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def tripping_server(
    tmp_path_factory: pytest.TempPathFactory, chromium_path: str
) -> Iterator[Server]:
    """A `kiln serve` of its own whose breakers open after two failures, for ten minutes."""
    root = tmp_path_factory.mktemp("kiln-breakers")
    server = launch(root, "breakers", KILN_BREAKER_MIN_CALLS="2", KILN_BREAKER_OPEN_S="600")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def fail_upstream(server: Server) -> str:
    """A task whose only attempt fails with an upstream error (the demo's simulate)."""
    body = {
        "kind": "image.generate",
        "max_attempts": 1,
        "params": {
            "prompt": unique_prompt("a storm"),
            "width": 64,
            "height": 64,
            "steps": 2,
            "simulate": {"fail_attempts": 1, "fail_code": "upstream_unavailable"},
        },
    }
    response = httpx.post(f"{server.url}/v1/tasks", json=body)
    assert response.status_code == 201, response.text
    task_id: str = response.json()["id"]
    return task_id


def breakers(server: Server) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{server.url}/v1/stats").json()["breakers"]
    return found


def test_a_tripped_breaker_shows_open_on_the_overview(
    page: Page, tripping_server: Server, console_errors: list[str]
) -> None:
    # Given the overview, with no breaker tripped yet
    page.goto(f"{tripping_server.url}/")
    panel = page.get_by_test_id("breakers")
    expect(panel).to_contain_text("None has tripped")
    expect(panel).to_have_attribute("data-open", "0")

    # When two tasks fail on their upstream
    for _ in range(2):
        tripping_server.wait_status(fail_upstream(tripping_server), "FAILED")
    wait_until(lambda: breakers(tripping_server).get("demo", {}).get("state") == "open",
               10, "the demo breaker to open")  # fmt: skip

    # Then the panel shows the demo generator's breaker open, highlighted, with its probe time
    row = panel.locator('[data-testid="breaker"][data-breaker="demo"]')
    expect(row).to_have_attribute("data-state", "open", timeout=20_000)
    expect(row).to_contain_text("open")
    expect(row).to_contain_text("next probe at")
    expect(panel).to_have_attribute("data-open", "1")
    expect(panel).to_have_class("card breakers-card has-open")
    background = row.evaluate("el => getComputedStyle(el).backgroundColor")
    assert background == "rgb(254, 226, 226)"  # the open highlight
    # And a new task waits, PENDING, while the breaker is open
    waiting = tripping_server.submit(unique_prompt("after the storm"), width=64, height=64)
    assert tripping_server.task(waiting["id"])["status"] == "PENDING"
    assert console_errors == []
