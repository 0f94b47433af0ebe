"""The task page in Chromium: submitting from the form, live progress and previews, the
output image, the timeline, and the cancel / approve / retry / run again buttons."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from .conftest import Server, unique_prompt

pytestmark = pytest.mark.browser

#: Records what flashes by on the task page (progress steps, loaded previews), so a test
#: can check afterwards what the page went through, however fast it went.
RECORDER = """
window.__seen = { progress: [], previews: [] };
new MutationObserver((records) => {
  for (const record of records) {
    const bar = record.target;
    if (bar.closest && bar.closest('[data-testid="task-page"]')) {
      window.__seen.progress.push(Number(bar.getAttribute("aria-valuenow")));
    }
  }
}).observe(document, { attributes: true, attributeFilter: ["aria-valuenow"], subtree: true });
document.addEventListener("load", (event) => {
  const img = event.target;
  if (img.dataset && img.dataset.testid === "preview-image") {
    window.__seen.previews.push({ width: img.naturalWidth, src: img.src.slice(0, 15) });
  }
}, true);
"""

STATUS_CHANGE = re.compile(r"after \d+(\.\d+)? (ms|s) in ")


def open_task(page: Page, task_id: str) -> None:
    page.goto(f"/#/tasks/{task_id}")
    expect(page.get_by_test_id("task-page")).to_have_attribute("data-task-id", task_id)


def test_form_submit_shows_live_progress_preview_and_the_output_image(
    page: Page, server: Server, console_errors: list[str], tmp_path: Path
) -> None:
    # Given the overview, recording what the task page shows on its way
    page.add_init_script(RECORDER)
    page.goto("/")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")

    # When a 30-step image of 320×256 is submitted from the form
    page.get_by_test_id("prompt").fill(unique_prompt("a red fox in snow"))
    page.get_by_test_id("width").fill("320")
    page.get_by_test_id("height").fill("256")
    page.get_by_test_id("steps").fill("30")
    page.get_by_test_id("step_ms").fill("100")
    page.get_by_test_id("submit").click()

    # Then the browser goes to the task's page, which shows it generating step by step
    expect(page).to_have_url(re.compile(r"#/tasks/tsk_\w+$"), timeout=10_000)
    task_page = page.get_by_test_id("task-page")
    bar = task_page.get_by_test_id("progress")
    expect(task_page).to_have_attribute("data-status", "GENERATING", timeout=15_000)
    expect(task_page.get_by_test_id("preview-image")).to_be_visible(timeout=10_000)
    expect(bar).to_have_attribute("aria-valuenow", re.compile(r"^([1-9]|[12][0-9])$"))
    expect(bar).to_have_attribute("aria-valuemax", "30")

    # And it ends in SUCCESS with the full-size output image really loaded
    expect(task_page).to_have_attribute("data-status", "SUCCESS", timeout=20_000)
    expect(bar).to_have_attribute("aria-valuenow", "30")
    output = task_page.get_by_test_id("output-image")
    expect(output).to_be_visible()
    expect(output).to_have_js_property("complete", True)
    expect(output).to_have_js_property("naturalWidth", 320)
    expect(output).to_have_js_property("naturalHeight", 256)
    expect(task_page.get_by_test_id("preview-image")).to_have_count(0)

    seen = page.evaluate("window.__seen")
    steps = set(seen["progress"])
    assert len(steps) >= 2, seen
    assert any(0 < step < 30 for step in steps), seen
    assert seen["previews"], "no preview image ever loaded"
    assert all(p["width"] > 0 and p["src"].startswith("data:image/") for p in seen["previews"])

    page.screenshot(path=tmp_path / "task-page.png", full_page=True)
    page.get_by_role("link", name="← All tasks").click()
    expect(page.get_by_test_id("count-SUCCESS")).not_to_have_attribute("data-count", "0")
    page.screenshot(path=tmp_path / "overview.png", full_page=True)
    assert console_errors == []


def test_cancel_button_stops_a_generating_task(page: Page, server: Server) -> None:
    # Given a slow task that is generating, on its page
    task = server.submit(unique_prompt("slow lighthouse"), steps=40, simulate={"step_ms": 300})
    open_task(page, task["id"])
    task_page = page.get_by_test_id("task-page")
    expect(task_page).to_have_attribute("data-status", "GENERATING", timeout=15_000)

    # When cancel is clicked
    page.get_by_test_id("cancel").click()

    # Then the worker stops it: CANCELLED, with the stop in the timeline
    expect(task_page).to_have_attribute("data-status", "CANCELLED", timeout=15_000)
    stop = page.locator(
        '[data-testid="timeline-entry"][data-event="stopped"],'
        ' [data-testid="timeline-entry"][data-event="force_cancel"]'
    )
    expect(stop).to_have_count(1)
    expect(stop).to_have_attribute("data-status", "CANCELLED")
    expect(page.get_by_test_id("cancel")).to_have_count(0)
    expect(page.get_by_test_id("retry")).to_be_visible()
    assert server.task(task["id"])["status"] == "CANCELLED"


def test_completed_task_page_shows_its_timeline_in_order_with_durations(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given a task that already succeeded
    task = server.submit(unique_prompt("quiet harbour"), steps=3, width=64, height=64,
                         simulate={"step_ms": 5})  # fmt: skip
    server.wait_status(task["id"], "SUCCESS")

    # When its page is opened
    open_task(page, task["id"])

    # Then the timeline replays its history in order, each change with its time in the
    # state it left
    entries = page.get_by_test_id("timeline-entry")
    expect(entries).to_have_count(5, timeout=10_000)
    expected = [
        ("submit", "PENDING", None),
        ("claim", "WAITING_FOR_RESOURCE", "PENDING"),
        ("acquire", "GENERATING", "WAITING_FOR_RESOURCE"),
        ("generated", "UPLOADING", "GENERATING"),
        ("uploaded", "SUCCESS", "UPLOADING"),
    ]
    for index, (event, status, left) in enumerate(expected):
        entry = entries.nth(index)
        expect(entry).to_have_attribute("data-event", event)
        expect(entry).to_have_attribute("data-status", status)
        expect(entry.locator("time")).to_have_text(re.compile(r"\d{1,2}:\d{2}:\d{2}[.,]\d{3}"))
        if left is None:
            expect(entry).to_contain_text("accepted")
        else:
            expect(entry).to_contain_text(re.compile(STATUS_CHANGE.pattern + left + r"\b"))
    expect(page.get_by_test_id("task-page")).to_have_attribute("data-status", "SUCCESS")
    assert console_errors == []


def test_the_timeline_shows_how_long_the_model_took_to_load(
    page: Page, server: Server, console_errors: list[str]
) -> None:
    # Given a task on a model no worker held yet (the demo backend loads it, about a second)
    model = f"demo-{unique_prompt('model').split()[-1]}"
    task = server.submit(unique_prompt("lighthouse"), steps=2, width=64, height=64, model=model)
    server.wait_status(task["id"], "SUCCESS")

    # When its page is opened
    open_task(page, task["id"])

    # Then the step that left GENERATING says how long the load took, the others say nothing
    generated = page.locator('[data-testid="timeline-entry"][data-event="generated"]')
    expect(generated).to_contain_text(re.compile(r"model loaded in \d+(\.\d+)? (ms|s)"))
    expect(page.get_by_test_id("timeline-entry").filter(has_text="model loaded")).to_have_count(1)
    assert console_errors == []


def test_approve_button_releases_a_task_held_for_review(page: Page, server: Server) -> None:
    # Given a task submitted from the form with "Flag for review"
    page.goto("/")
    page.get_by_test_id("prompt").fill(unique_prompt("a contested painting"))
    page.get_by_test_id("steps").fill("3")
    page.get_by_test_id("step_ms").fill("5")
    page.get_by_text("Simulate trouble").click()
    page.get_by_test_id("review").check()
    page.get_by_test_id("submit").click()

    # When it reaches NEEDS_REVIEW and approve is clicked
    task_page = page.get_by_test_id("task-page")
    expect(task_page).to_have_attribute("data-status", "NEEDS_REVIEW", timeout=15_000)
    expect(page.get_by_test_id("output-image")).to_have_count(0)
    page.get_by_test_id("approve").click()

    # Then the task succeeds and its image is shown
    expect(task_page).to_have_attribute("data-status", "SUCCESS", timeout=10_000)
    expect(page.locator('[data-testid="timeline-entry"][data-event="approve"]')).to_have_count(1)
    expect(page.get_by_test_id("output-image")).to_have_js_property("naturalWidth", 512)
    expect(page.get_by_test_id("approve")).to_have_count(0)


def test_retry_button_runs_a_failed_task_again(page: Page, server: Server) -> None:
    # Given a task that failed permanently, on its page with its error code
    task = server.submit(unique_prompt("a broken kiln"), steps=2, width=64, height=64,
                         simulate={"step_ms": 5, "permanent": True})  # fmt: skip
    open_task(page, task["id"])
    task_page = page.get_by_test_id("task-page")
    expect(task_page).to_have_attribute("data-status", "FAILED", timeout=15_000)
    expect(page.get_by_test_id("error-code")).to_have_text("simulated_failure")
    expect(page.get_by_test_id("attempt")).to_have_text("1/3")

    # When retry is clicked
    page.get_by_test_id("retry").click()

    # Then it goes to RETRYING and runs a second attempt (which fails the same way)
    retried = page.locator('[data-testid="timeline-entry"][data-event="retry"]')
    expect(retried).to_have_attribute("data-status", "RETRYING", timeout=10_000)
    fails = page.locator('[data-testid="timeline-entry"][data-event="fail"]')
    expect(fails).to_have_count(2, timeout=15_000)
    expect(page.get_by_test_id("attempt")).to_have_text("2/4")
    expect(task_page).to_have_attribute("data-status", "FAILED")
    expect(page.get_by_test_id("error-code")).to_have_text("simulated_failure")
    assert server.task(task["id"])["attempt"] == 2


def test_a_delayed_task_shows_when_it_is_scheduled_in_the_list_and_on_its_page(
    page: Page, server: Server
) -> None:
    # Given a task delayed by an hour
    body = {"kind": "image.generate", "params": {"prompt": unique_prompt("a sunrise")},
            "delay_s": 3600}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/tasks", json=body, headers=server.headers())
    assert response.status_code == 201, response.text
    task = response.json()

    # When its page is open: it says when it runs
    open_task(page, task["id"])
    expect(page.get_by_test_id("scheduled")).to_contain_text("Scheduled — runs at")

    # And the task list says it is scheduled, not queued
    page.goto("/")
    row = page.locator(f'[data-testid="task-row"][data-task-id="{task["id"]}"]')
    expect(row).to_contain_text("scheduled in")
    httpx.post(f"{server.url}/v1/tasks/{task['id']}/cancel", headers=server.headers())


def test_run_again_makes_a_new_task_and_opens_its_page(page: Page, server: Server) -> None:
    # Given a task that succeeded, on its page
    task = server.submit(unique_prompt("a kiln at dusk"), steps=2, width=64, height=64,
                         simulate={"step_ms": 5})  # fmt: skip
    open_task(page, task["id"])
    expect(page.get_by_test_id("task-page")).to_have_attribute("data-status", "SUCCESS",
                                                               timeout=15_000)  # fmt: skip

    # When "Run again" is clicked
    page.get_by_test_id("rerun").click()

    # Then the page of a new task opens, linked to the original, which runs to SUCCESS too
    task_page = page.get_by_test_id("task-page")
    expect(task_page).not_to_have_attribute("data-task-id", task["id"], timeout=10_000)
    expect(page.get_by_test_id("rerun-of")).to_have_text(task["id"])
    expect(task_page).to_have_attribute("data-status", "SUCCESS", timeout=15_000)
    new_id = task_page.get_attribute("data-task-id")
    assert new_id and new_id != task["id"]
    assert server.task(new_id)["rerun_of"] == task["id"]
