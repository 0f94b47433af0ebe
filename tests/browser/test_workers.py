"""The workers panel in Chromium: the live worker processes of the deployment, for the
admin (or anyone when auth is off), each with when it started; hidden from a tenant's
key."""

from __future__ import annotations

import re
from datetime import datetime

import httpx
import pytest
from playwright.sync_api import Page, expect

from .conftest import Server

pytestmark = pytest.mark.browser


def test_the_overview_lists_the_live_workers(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # When the overview opens on a server with in-process workers
    page.goto(f"{server.url}/")
    # Then the workers panel lists them: this server's process, its kinds, its slots
    panel = page.get_by_test_id("workers")
    expect(panel).to_be_visible(timeout=10_000)
    mine = panel.locator(f'[data-testid="worker"][data-pid="{server.popen.pid}"]')
    expect(mine.first).to_be_visible(timeout=10_000)
    expect(mine.first).to_contain_text("image.generate")
    expect(mine.first).to_contain_text(" running")
    # And the models it holds as the API lists them (other tests on this shared server may
    # have had a model loaded), or that it holds none
    answer = httpx.get(f"{server.url}/v1/workers", headers=server.headers()).json()
    held = [", ".join(w["models"]) or "no model loaded"
            for w in answer["workers"] if w["pid"] == server.popen.pid]  # fmt: skip
    assert held, answer
    shown = re.compile("^(" + "|".join(re.escape(text) for text in held) + ")$")
    expect(mine.first.get_by_test_id("worker-models")).to_have_text(shown)
    # And when it started, from the API's RFC 3339 `started_at`
    (started_at,) = {w["started_at"] for w in answer["workers"] if w["pid"] == server.popen.pid}
    assert started_at.endswith("Z") and datetime.fromisoformat(started_at)
    started = mine.first.get_by_test_id("worker-started")
    expect(started).to_have_attribute("datetime", started_at)
    expect(started).to_have_text(re.compile(r"^started (just now|\d+ (s|min|h|d) ago)$"))
    assert int(panel.get_attribute("data-count") or "0") >= 1
    assert console_errors == []


def test_a_tenant_key_sees_no_workers_panel(page: Page, secured_server: Server) -> None:
    # Given the dashboard of a server with tenant keys, opened with a tenant's key
    page.goto(f"{secured_server.url}/")
    key_input = page.get_by_test_id("api-key")
    expect(key_input).to_be_visible(timeout=10_000)
    key_input.fill(secured_server.key or "")
    page.get_by_test_id("api-key-save").click()
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
    # Then the overview shows no workers panel (the API answers 403 to that key)
    expect(page.get_by_test_id("workers")).to_be_hidden(timeout=10_000)
    expect(page.get_by_test_id("error-banner")).to_be_hidden()
