"""Bulk retry and cancel from the task list in Chromium: the dry run's count in a
confirmation dialog, the pages one by one, the summary, and the tasks really changed."""

from __future__ import annotations

import re
import time
import uuid
from datetime import datetime
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, Route, expect

from .conftest import ACME_KEY, Server, unique_prompt

pytestmark = pytest.mark.browser


def submit(server: Server, prompt: str, simulate: dict[str, Any], **extra: Any) -> str:
    body = {"kind": "image.generate", "dedup": False, **extra,
            "params": {"prompt": unique_prompt(prompt), "steps": 2, "width": 64, "height": 64,
                       "simulate": simulate}}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/tasks", json=body, headers=server.headers())
    assert response.status_code == 201, response.text
    task_id: str = response.json()["id"]
    return task_id


def dry_run(server: Server, action: str, filter: dict[str, Any]) -> int:
    response = httpx.post(f"{server.url}/v1/tasks/{action}", headers=server.headers(),
                          json={"filter": filter, "dry_run": True})  # fmt: skip
    assert response.status_code == 200, response.text
    matched: int = response.json()["matched"]
    return matched


def statuses(server: Server, ids: list[str]) -> list[str]:
    return [server.task(task_id)["status"] for task_id in ids]


def parse_time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def open_overview(page: Page, url: str = "/") -> None:
    page.goto(url)
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
    failed_count = page.get_by_test_id("count-FAILED").locator(".tile-num")
    expect(failed_count).to_have_text(re.compile(r"^[\d,]+$"))


def test_retry_of_the_failed_tasks_the_list_shows_confirms_the_count_then_pages_through(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given three tasks FAILED with an error code of their own (their one attempt failed;
    # a retry's second attempt succeeds), and one FAILED with another code
    code = f"bulk_{uuid.uuid4().hex[:8]}"
    failing = {"step_ms": 5, "fail_attempts": 1, "fail_code": code}
    ids = [submit(server, "a cracked kiln", failing, max_attempts=1) for _ in range(3)]
    other = submit(server, "a cracked vase", {**failing, "fail_code": f"{code}_x"}, max_attempts=1)
    for task_id in [*ids, other]:
        server.wait_status(task_id, "FAILED")

    # When the list is filtered by FAILED, the error code narrows the action, pages hold 2
    open_overview(page)
    page.get_by_test_id("count-FAILED").click()
    expect(page.get_by_test_id("bulk-status")).to_have_value("FAILED")
    expect(page.locator(f'[data-testid="task-row"][data-task-id="{ids[0]}"]')).to_be_visible()
    page.get_by_test_id("bulk-code").fill(code)
    page.get_by_test_id("bulk-bar").evaluate("el => { el.dataset.pageSize = '2'; }")
    expect(page.get_by_test_id("bulk-cancel")).to_be_disabled()
    page.get_by_test_id("bulk-retry").click()

    # Then a dialog asks, with the count the API's dry run gives, the safe button focused
    dialog = page.get_by_test_id("bulk-dialog")
    expect(dialog).to_be_visible()
    expect(dialog).to_have_attribute("data-phase", "confirm")
    matched = dry_run(server, "retry", {"status": ["FAILED"], "code": [code]})
    assert matched == 3
    expect(dialog).to_have_attribute("data-count", str(matched))
    expect(dialog.get_by_test_id("bulk-message")).to_have_text(
        f"Retry {matched} FAILED tasks with code {code}?"
    )
    expect(dialog.get_by_test_id("bulk-close")).to_be_focused()
    assert statuses(server, ids) == ["FAILED"] * 3  # asking changed nothing

    # When confirmed
    dialog.get_by_test_id("bulk-confirm").click()

    # Then it sends two pages and sums them up
    summary = dialog.get_by_test_id("bulk-summary")
    expect(summary).to_be_visible(timeout=10_000)
    expect(dialog).to_have_attribute("data-outcome", "done")
    expect(dialog).to_have_attribute("data-pages", "2")
    expect(dialog).to_have_attribute("data-changed", "3")
    expect(dialog).to_have_attribute("data-skipped", "0")
    expect(summary).to_have_text("Done: retried 3, skipped 0 (changed meanwhile), in 2 pages.")
    expect(dialog.get_by_test_id("bulk-error")).to_be_hidden()

    # And the tasks leave FAILED and run to SUCCESS; the other code's task is untouched
    for task_id in ids:
        server.wait_status(task_id, "SUCCESS")
    assert server.task(other)["status"] == "FAILED"
    assert server.task(other)["attempt"] == 1

    # And closing gives focus back; the FAILED list, reloaded, no longer holds them
    dialog.get_by_test_id("bulk-close").click()
    expect(dialog).to_be_hidden()
    expect(page.get_by_test_id("bulk-retry")).to_be_focused()
    for task_id in ids:
        expect(page.locator(f'[data-testid="task-row"][data-task-id="{task_id}"]')).to_have_count(0)
    expect(page.locator(f'[data-testid="task-row"][data-task-id="{other}"]')).to_be_visible()
    assert console_errors == []


def test_cancel_of_delayed_pending_tasks_with_a_tenant_key_and_a_refused_filter(
    page: Page, secured_server: Server, console_errors: list[str]
) -> None:
    # Given three tasks of tenant acme held PENDING by a run_at an hour ahead
    run_at = time.time() + 3600
    ids = [submit(secured_server, "a far kiln", {"step_ms": 5}, run_at=run_at) for _ in range(3)]
    since = secured_server.task(ids[0])["created_at"]
    assert statuses(secured_server, ids) == ["PENDING"] * 3

    # And the dashboard with acme's key
    page.add_init_script(f"localStorage.setItem('kiln.apiKey', {ACME_KEY!r})")
    open_overview(page, f"{secured_server.url}/")

    # When a created-since that is no time is asked for
    page.get_by_test_id("bulk-status").select_option("PENDING")
    expect(page.get_by_test_id("bulk-retry")).to_be_disabled()
    page.get_by_test_id("bulk-since").fill("yesterday")
    page.get_by_test_id("bulk-cancel").click()

    # Then the dialog shows the error envelope's code and message, and offers nothing to do
    dialog = page.get_by_test_id("bulk-dialog")
    expect(dialog).to_have_attribute("data-error-code", "invalid_request")
    error = dialog.get_by_test_id("bulk-error")
    expect(error).to_contain_text("invalid_request")
    expect(error).to_contain_text(re.compile("created_after must be"))
    expect(dialog.get_by_test_id("bulk-confirm")).to_be_hidden()
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()

    # When the PENDING tasks created since the first of them are cancelled a page at a time,
    # and Stop is clicked while the second page is on its way
    held: list[Route] = []

    def hold_second_page(route: Route) -> None:
        body = route.request.post_data_json or {}
        if body.get("cursor") and not held:
            held.append(route)
        else:
            route.continue_()

    page.route("**/v1/tasks/cancel", hold_second_page)
    page.get_by_test_id("bulk-bar").evaluate("el => { el.dataset.pageSize = '1'; }")
    page.get_by_test_id("bulk-since").fill(since)
    page.get_by_test_id("bulk-cancel").click()
    matched = dry_run(secured_server, "cancel", {"status": ["PENDING"], "created_after": since})
    assert matched == 3
    expect(dialog).to_have_attribute("data-count", str(matched))
    expect(dialog.get_by_test_id("bulk-message")).to_have_text(
        f"Cancel {matched} PENDING tasks created since {since}?"
    )
    dialog.get_by_test_id("bulk-confirm").click()
    expect(dialog).to_have_attribute("data-pages", "1", timeout=10_000)
    expect(dialog.get_by_test_id("bulk-close")).to_be_hidden()
    dialog.get_by_test_id("bulk-stop").click()
    expect(dialog.get_by_test_id("bulk-stop")).to_have_text("Stopping…")
    assert len(held) == 1
    sent = held[0].request.post_data_json or {}
    # the answer's filter, its time made unix seconds, sent back with the cursor
    assert sent["filter"] == {"status": ["PENDING"], "created_after": parse_time(since)}
    assert sent["cursor"].startswith("tsk_")
    held[0].continue_()

    # Then it stops after that page, says so, and one task is still PENDING
    expect(dialog).to_have_attribute("data-outcome", "stopped", timeout=10_000)
    expect(dialog).to_have_attribute("data-changed", "2")
    expect(dialog.get_by_test_id("bulk-summary")).to_have_text(
        "Stopped before the last page: cancelled 2, skipped 0 (changed meanwhile), in 2 pages."
    )
    assert sorted(statuses(secured_server, ids)) == ["CANCELLED", "CANCELLED", "PENDING"]
    dialog.get_by_test_id("bulk-close").click()

    # When cancel is asked again: the one left is counted and cancelled
    page.get_by_test_id("bulk-cancel").click()
    expect(dialog).to_have_attribute("data-count", "1")
    expect(dialog.get_by_test_id("bulk-message")).to_have_text(
        f"Cancel 1 PENDING task created since {since}?"
    )
    dialog.get_by_test_id("bulk-confirm").click()
    expect(dialog).to_have_attribute("data-outcome", "done", timeout=10_000)
    expect(dialog.get_by_test_id("bulk-summary")).to_have_text(
        "Done: cancelled 1, skipped 0 (changed meanwhile), in 1 page."
    )
    assert statuses(secured_server, ids) == ["CANCELLED"] * 3
    dialog.get_by_test_id("bulk-close").click()
    for task_id in ids:
        expect(page.locator(f'[data-testid="task-row"][data-task-id="{task_id}"]')).to_have_count(0)
    # The one console error: Chromium's own line for the refused request above
    refused = "the server responded with a status of 422 (Unprocessable Entity)"
    assert console_errors == [
        f"console: Failed to load resource: {refused} ({secured_server.url}/v1/tasks/cancel)"
    ]


def test_a_page_refused_midway_stops_the_run_and_shows_the_envelope(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given two delayed PENDING tasks, and a server whose second page is refused with a 403
    # envelope (answered here: the dashboard never names another tenant, so the real API
    # gives it no such refusal to show)
    ids = [
        submit(server, "a far vase", {"step_ms": 5}, run_at=time.time() + 3600) for _ in range(2)
    ]
    since = server.task(ids[0])["created_at"]
    refusal = {
        "error": {"code": "forbidden", "message": "this key acts on tenant 'acme''s tasks only"}
    }

    def refuse_second_page(route: Route) -> None:
        if (route.request.post_data_json or {}).get("cursor"):
            route.fulfill(status=403, json=refusal)
        else:
            route.continue_()

    page.route("**/v1/tasks/cancel", refuse_second_page)
    open_overview(page)
    page.get_by_test_id("bulk-bar").evaluate("el => { el.dataset.pageSize = '1'; }")
    page.get_by_test_id("bulk-status").select_option("PENDING")
    page.get_by_test_id("bulk-since").fill(since)

    # When the cancel is confirmed
    page.get_by_test_id("bulk-cancel").click()
    dialog = page.get_by_test_id("bulk-dialog")
    expect(dialog).to_have_attribute("data-count", "2")
    dialog.get_by_test_id("bulk-confirm").click()

    # Then the first page's work is counted, the run stops, and the refusal is shown
    expect(dialog).to_have_attribute("data-outcome", "error", timeout=10_000)
    expect(dialog).to_have_attribute("data-error-code", "forbidden")
    expect(dialog.get_by_test_id("bulk-error")).to_have_text(
        "forbidden this key acts on tenant 'acme''s tasks only"
    )
    expect(dialog.get_by_test_id("bulk-summary")).to_have_text(
        "Stopped by an error: cancelled 1, skipped 0 (changed meanwhile), in 1 page."
    )
    assert sorted(statuses(server, ids)) == ["CANCELLED", "PENDING"]
    for task_id in ids:  # leave no delayed task behind on the shared server
        httpx.post(f"{server.url}/v1/tasks/{task_id}/cancel")
    assert statuses(server, ids) == ["CANCELLED"] * 2
    dialog.get_by_test_id("bulk-close").click()
    expect(dialog).to_be_hidden()
    refused = "the server responded with a status of 403 (Forbidden)"
    assert console_errors == [
        f"console: Failed to load resource: {refused} ({server.url}/v1/tasks/cancel)"
    ]
