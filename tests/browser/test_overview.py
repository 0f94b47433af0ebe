"""The overview in Chromium: live rows and counts without a reload, and a phone-sized
screen."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, Route, expect

from .conftest import Server, unique_prompt

pytestmark = pytest.mark.browser

PHONE = {"width": 390, "height": 844}

NO_HORIZONTAL_SCROLL = "document.scrollingElement.scrollWidth <= window.innerWidth + 1"


def open_overview(page: Page) -> None:
    """The overview with its live feed connected and its counts loaded."""
    page.goto("/")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
    success_count = page.get_by_test_id("count-SUCCESS").locator(".tile-num")
    expect(success_count).to_have_text(re.compile(r"^[\d,]+$"))


def test_overview_shows_a_task_submitted_elsewhere_without_reloading(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given the overview, open and live, marked so a reload would show
    open_overview(page)
    page.evaluate("window.__sameDocument = true")
    succeeded_before = int(page.get_by_test_id("count-SUCCESS").get_attribute("data-count") or "")

    # When a task is submitted through the HTTP API, not through the page
    task = server.submit(unique_prompt("a lantern at dusk"), steps=4, width=64, height=64,
                         simulate={"step_ms": 20})  # fmt: skip

    # Then its row appears and turns SUCCESS, and the SUCCESS count goes up
    row = page.locator(f'[data-testid="task-row"][data-task-id="{task["id"]}"]')
    expect(row).to_be_visible(timeout=10_000)
    expect(row.get_by_test_id("status-badge")).to_have_attribute(
        "data-status", "SUCCESS", timeout=15_000
    )
    expect(row).to_have_attribute("data-status", "SUCCESS")
    expect(row.get_by_test_id("progress")).to_have_attribute("aria-valuenow", "4")
    page.wait_for_function(
        f"Number(document.querySelector('[data-testid=\"count-SUCCESS\"]').dataset.count)"
        f" > {succeeded_before}",
        timeout=10_000,
    )
    assert page.evaluate("window.__sameDocument") is True
    assert console_errors == []


def test_a_task_that_finishes_while_its_row_is_fetched_still_shows_success(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given the overview, whose first read of a new task is answered late: the answer says
    # GENERATING but arrives only after the task has finished (a slow network)
    open_overview(page)
    stale: list[str] = []

    def late_answer(route: Route) -> None:
        task_id = route.request.url.rsplit("/", 1)[1]
        if stale:  # the first read only
            route.continue_()
            return
        stale.append(task_id)
        server.wait_status(task_id, "GENERATING")
        answer = route.fetch()
        server.wait_status(task_id, "SUCCESS")
        route.fulfill(response=answer)

    page.route(re.compile(r".*/v1/tasks/tsk_[a-z0-9]+$"), late_answer)

    # When a task runs to the end meanwhile
    task = server.submit(unique_prompt("a kite"), steps=6, width=64, height=64,
                         simulate={"step_ms": 100})  # fmt: skip

    # Then its row ends SUCCESS, not at the status the late answer carried
    row = page.locator(f'[data-testid="task-row"][data-task-id="{task["id"]}"]')
    expect(row.get_by_test_id("status-badge")).to_have_attribute(
        "data-status", "SUCCESS", timeout=20_000
    )
    assert stale == [task["id"]]
    assert console_errors == []


@pytest.mark.browser_context_args(viewport=PHONE, is_mobile=True, has_touch=True)
def test_overview_fits_a_phone_screen_and_its_form_submits(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given tasks in the list, one with a long unbroken prompt, on a 390×844 phone screen
    long_word = unique_prompt("x" * 180).replace(" ", "-")
    long_task = server.submit(long_word, steps=2, width=64, height=64, simulate={"step_ms": 5})
    server.wait_status(long_task["id"], "SUCCESS")
    open_overview(page)
    expect(page.locator(f'[data-task-id="{long_task["id"]}"]')).to_be_visible()

    # Then the page does not scroll sideways
    assert page.evaluate(NO_HORIZONTAL_SCROLL), page.evaluate(
        "[document.scrollingElement.scrollWidth, window.innerWidth]"
    )

    # When the form is filled in and tapped
    page.get_by_test_id("prompt").fill(unique_prompt("a kite over the dunes"))
    page.get_by_test_id("steps").fill("3")
    page.get_by_test_id("step_ms").fill("5")
    page.get_by_test_id("submit").tap()

    # Then the task runs to SUCCESS on its page, which fits the screen too
    task_page = page.get_by_test_id("task-page")
    expect(task_page).to_have_attribute("data-status", "SUCCESS", timeout=15_000)
    expect(task_page.get_by_test_id("output-image")).to_have_js_property("naturalWidth", 512)
    assert page.evaluate(NO_HORIZONTAL_SCROLL), page.evaluate(
        "[document.scrollingElement.scrollWidth, window.innerWidth]"
    )
    assert console_errors == []
