"""The GPU usage panel in Chromium: the ledger of the last 24 hours, by kind and model."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from .conftest import Server, unique_prompt

pytestmark = pytest.mark.browser


def test_the_overview_shows_the_gpu_seconds_by_kind_and_model(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given a task that ran to SUCCESS
    task = server.submit(unique_prompt("a heron"), width=64, height=64, steps=3,
                         simulate={"step_ms": 20})  # fmt: skip
    server.wait_status(task["id"], "SUCCESS")
    # When the overview opens
    page.goto(f"{server.url}/")
    # Then the usage panel has a row for image.generate with its GPU-seconds and attempts
    panel = page.get_by_test_id("usage")
    expect(panel).to_be_visible(timeout=10_000)
    row = panel.locator('[data-testid="usage-row"][data-kind="image.generate"]')
    expect(row.first).to_be_visible(timeout=10_000)
    expect(row.first).to_contain_text("image.generate · no model")
    expect(row.first.get_by_test_id("usage-gpu")).to_contain_text(" GPU")
    expect(row.first).to_contain_text("attempt")
    assert int(panel.get_attribute("data-count") or "0") >= 1
    assert console_errors == []


def test_a_tenant_key_sees_its_own_usage(page: Page, secured_server: Server) -> None:
    # Given the dashboard of a server with tenant keys, opened with a tenant's key
    page.goto(f"{secured_server.url}/")
    key_input = page.get_by_test_id("api-key")
    expect(key_input).to_be_visible(timeout=10_000)
    key_input.fill(secured_server.key or "")
    page.get_by_test_id("api-key-save").click()
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
    # Then the usage panel is shown (the tenant's own ledger) without an error
    expect(page.get_by_test_id("usage")).to_be_visible(timeout=10_000)
    expect(page.get_by_test_id("error-banner")).to_be_hidden()
