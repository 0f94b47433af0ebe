"""The dashboard of a server with API keys, in Chromium: it asks for a key, then shows the
tenant's tasks and their protected output images."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from .conftest import Server, unique_prompt

pytestmark = pytest.mark.browser


def test_dashboard_asks_for_a_key_then_shows_that_tenants_tasks(
    page: Page, secured_server: Server
) -> None:
    # Given a task that tenant acme submitted with its key, and done
    task = secured_server.submit(unique_prompt("a locked vault"), steps=2, width=96, height=64,
                                 simulate={"step_ms": 5})  # fmt: skip
    secured_server.wait_status(task["id"], "SUCCESS")
    row = page.locator(f'[data-testid="task-row"][data-task-id="{task["id"]}"]')

    # When the dashboard opens without a key
    page.goto(f"{secured_server.url}/")

    # Then it asks for one and shows no task
    key_input = page.get_by_test_id("api-key")
    expect(key_input).to_be_visible(timeout=10_000)
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "closed")
    expect(page.get_by_test_id("connection")).to_have_text("key needed")
    expect(page.get_by_test_id("task-row")).to_have_count(0)

    # When the key is entered
    key_input.fill(secured_server.key or "")
    page.get_by_test_id("api-key-save").click()

    # Then the form goes away, the feed is live and acme's task is listed
    expect(key_input).to_be_hidden()
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
    expect(row).to_be_visible(timeout=10_000)
    expect(row).to_have_attribute("data-status", "SUCCESS")

    # And its page shows the output image, fetched with the key
    row.get_by_role("link").click()
    task_page = page.get_by_test_id("task-page")
    expect(task_page).to_have_attribute("data-status", "SUCCESS")
    expect(task_page.get_by_test_id("output-image")).to_have_js_property("naturalWidth", 96)
    expect(page.get_by_test_id("error-banner")).to_be_hidden()
