"""Uploading from the dashboard in Chromium: an image and a transform, sent by a Web Worker;
the upload's own states (uploading with a byte progress bar, done, failed with the server's
error), then the task, live like any other."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from playwright.sync_api import Page, expect

from .conftest import ACME_KEY, Server

pytestmark = pytest.mark.browser

#: Records what the upload box goes through, however fast: each state with the number of
#: animation frames drawn so far, each value of the byte progress bar, the longest wait
#: between two frames while an upload ran, and whether the page took typing meanwhile.
RECORDER = """
window.__upload = {
  states: [], values: [], frames: 0, longestFrameGapMs: 0, typedWhileUploading: false,
};
const uploadState = () => {
  const box = document.querySelector('[data-testid="upload-status"]');
  return box ? box.dataset.state : null;
};
let lastFrame = null;
const countFrame = (now) => {
  window.__upload.frames += 1;
  if (uploadState() === "uploading" && lastFrame !== null) {
    const gap = now - lastFrame;
    window.__upload.longestFrameGapMs = Math.max(window.__upload.longestFrameGapMs, gap);
  }
  lastFrame = now;
  requestAnimationFrame(countFrame);
};
requestAnimationFrame(countFrame);
new MutationObserver((records) => {
  for (const record of records) {
    const el = record.target;
    const seen = { frames: window.__upload.frames, at_ms: performance.now() };
    if (el.dataset && el.dataset.testid === "upload-progress") {
      const value = Number(el.getAttribute("value"));
      window.__upload.values.push({ ...seen, value, max: Number(el.getAttribute("max")) });
    } else if (el.dataset && el.dataset.testid === "upload-status") {
      window.__upload.states.push({ ...seen, state: el.dataset.state });
    }
  }
}).observe(document, { attributes: true, attributeFilter: ["value", "data-state"], subtree: true });
document.addEventListener("input", () => {
  if (uploadState() === "uploading") window.__upload.typedWhileUploading = true;
}, true);
"""


#: The dashboard's saved API key (api.js keeps it in localStorage under this name).
SAVED_KEY = "try { localStorage.setItem('kiln.apiKey', '%s'); } catch (_) {}"


def noise_png(path: Path, width: int, height: int) -> Path:
    """A PNG of random pixels: no other test's upload has the same bytes, and it does not
    compress, so its size is about width × height × 3 bytes."""
    pixels = os.urandom(width * height * 3)
    Image.frombytes("RGB", (width, height), pixels).save(path, compress_level=0)
    return path


def open_overview(page: Page) -> None:
    page.goto("/")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
    expect(page.get_by_test_id("upload-status")).to_have_attribute("data-state", "idle")


def upload(page: Page, path: Path, op: str, **fields: Any) -> None:
    """Fills in the upload form (file, op, then the op's fields) and sends it."""
    page.get_by_test_id("upload-file").set_input_files(path)
    page.get_by_test_id("upload-op").select_option(op)
    for name, value in fields.items():
        field = page.get_by_test_id(f"upload-{name}")
        if name == "format":
            field.select_option(value)
        else:
            field.fill(str(value))
    page.get_by_test_id("upload-submit").click()


def throttle_uploads(page: Page, bytes_per_s: int) -> None:
    """Chromium's network emulation, which also covers the page's workers: a slow uplink,
    so a large upload lasts a few seconds however fast the machine is."""
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": -1,
         "uploadThroughput": bytes_per_s},
    )  # fmt: skip


def test_uploaded_image_is_transformed_and_the_same_file_again_is_the_same_task(
    page: Page, server: Server, console_errors: list[str], tmp_path: Path
) -> None:
    # Given a 300×200 PNG, and the overview recording what its upload box goes through
    photo = noise_png(tmp_path / "photo.png", 300, 200)
    with Image.open(photo) as image:
        image.thumbnail((64, 64))
        thumbnail_size = image.size
    page.add_init_script(RECORDER)
    open_overview(page)

    # When it is uploaded with a 64×64 thumbnail transform
    upload(page, photo, "thumbnail", width=64, height=64)

    # Then the box shows the upload, with a byte progress bar that ends full, then done
    status = page.get_by_test_id("upload-status")
    expect(status).to_have_attribute("data-state", "done", timeout=20_000)
    expect(status).to_have_attribute("data-deduplicated", "false")
    expect(status.get_by_test_id("upload-headline")).to_contain_text("Uploaded — task")
    seen = page.evaluate("window.__upload")
    assert [s["state"] for s in seen["states"]] == ["uploading", "done"], seen
    last = seen["values"][-1]
    assert last["value"] == last["max"] > photo.stat().st_size, seen["values"]
    task_id = status.get_attribute("data-task-id") or ""
    assert task_id.startswith("tsk_")

    # And the task joins the live list and runs to SUCCESS, in the box too
    row = page.locator(f'[data-testid="task-row"][data-task-id="{task_id}"]')
    expect(row).to_have_attribute("data-status", "SUCCESS", timeout=20_000)
    expect(row).to_contain_text("image.transform (thumbnail)")
    expect(status.get_by_test_id("upload-task-status")).to_have_attribute("data-status", "SUCCESS")

    # And its page shows the thumbnail
    status.get_by_test_id("upload-task-link").click()
    task_page = page.get_by_test_id("task-page")
    expect(task_page).to_have_attribute("data-task-id", task_id)
    expect(task_page).to_have_attribute("data-status", "SUCCESS")
    output = task_page.get_by_test_id("output-image")
    expect(output).to_have_js_property("naturalWidth", thumbnail_size[0])
    expect(output).to_have_js_property("naturalHeight", thumbnail_size[1])

    # When the same file is uploaded again with the same transform
    page.get_by_role("link", name="← All tasks").click()
    expect(status).to_have_attribute("data-state", "done")
    page.get_by_test_id("upload-submit").click()

    # Then the answer is that same task, already done, and the list still has it once
    expect(status).to_have_attribute("data-deduplicated", "true", timeout=20_000)
    expect(status).to_have_attribute("data-task-id", task_id)
    expect(status.get_by_test_id("upload-headline")).to_contain_text(
        f"Already done — same as task {task_id[:12]}"
    )
    expect(status.get_by_test_id("upload-task-status")).to_have_attribute("data-status", "SUCCESS")
    expect(page.locator(f'[data-testid="task-row"][data-task-id="{task_id}"]')).to_have_count(1)
    assert console_errors == []


def test_upload_refused_by_the_server_shows_its_error_as_it_wrote_it(
    page: Page, server: Server, console_errors: list[str], tmp_path: Path
) -> None:
    # Given a text file named .png, what the server answers when it is sent directly, and
    # a file over the 20 MiB upload limit
    fake = tmp_path / "notes.png"
    fake.write_text("a shopping list, not a picture\n")
    request = '{"kind": "image.transform", "params": {"op": "convert", "format": "webp"}}'
    direct = httpx.post(f"{server.url}/v1/tasks", data={"request": request},
                        files={"image": ("notes.png", fake.read_bytes(), "image/png")})  # fmt: skip
    assert direct.status_code == 415, direct.text
    oversized = tmp_path / "huge.png"
    oversized.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(21 * 1024 * 1024))
    open_overview(page)
    status = page.get_by_test_id("upload-status")

    # When the form is sent without a file
    page.get_by_test_id("upload-submit").click()

    # Then it says so and sends nothing
    expect(page.get_by_test_id("upload-form-error")).to_have_text("Pick an image file first.")
    expect(status).to_have_attribute("data-state", "idle")

    # When the text file is uploaded to be converted
    upload(page, fake, "convert", format="webp")

    # Then the box shows the server's 415 error code and message as they are
    expect(status).to_have_attribute("data-state", "failed", timeout=20_000)
    expect(page.get_by_test_id("upload-form-error")).to_be_hidden()
    expect(status).to_have_attribute("data-status", "415")
    expect(status.get_by_test_id("upload-error-code")).to_have_text("unsupported_media_type")
    expect(status.get_by_test_id("upload-error-message")).to_have_text(
        direct.json()["error"]["message"]
    )

    # When the file over the limit is uploaded
    upload(page, oversized, "convert", format="webp")

    # Then the box shows the 413
    expect(status).to_have_attribute("data-status", "413", timeout=30_000)
    expect(status).to_have_attribute("data-state", "failed")
    expect(status.get_by_test_id("upload-error-code")).to_have_text("payload_too_large")
    expect(status.get_by_test_id("upload-error-message")).to_contain_text("20971520 bytes")
    assert console_errors == []


def test_large_upload_shows_its_bytes_advancing_and_the_page_stays_responsive(
    page: Page, server: Server, console_errors: list[str], tmp_path: Path
) -> None:
    # Given a ~15 MB PNG of noise, a 4 MiB/s uplink, and the overview recording frames
    big = noise_png(tmp_path / "noise.png", 2240, 2240)
    assert big.stat().st_size > 15_000_000
    page.add_init_script(RECORDER)
    throttle_uploads(page, 4 * 1024 * 1024)
    open_overview(page)

    # When it is uploaded, and someone types in the other form meanwhile
    with page.expect_worker() as started:
        upload(page, big, "thumbnail", width=128, height=128)
    assert started.value.url.endswith("/dashboard/upload-worker.js")
    status = page.get_by_test_id("upload-status")
    expect(status).to_have_attribute("data-state", "uploading")
    expect(status.get_by_test_id("upload-progress")).to_be_visible()
    expect(status.get_by_test_id("upload-bytes")).to_contain_text("of 14.4 MiB")
    expect(status.get_by_test_id("upload-percent")).to_have_text(re.compile(r"^\d{1,3}%$"))
    prompt = page.get_by_test_id("prompt")
    prompt.fill("typed while the upload runs")

    # Then the upload ends done, and the page took the typing while it ran
    expect(status).to_have_attribute("data-state", "done", timeout=60_000)
    expect(prompt).to_have_value("typed while the upload runs")
    seen = page.evaluate("window.__upload")
    assert seen["typedWhileUploading"] is True

    # And the progress bar went up through values in between, one after another
    values = [v["value"] for v in seen["values"]]
    total = seen["values"][-1]["max"]
    between = [v for v in seen["values"] if 0 < v["value"] < total]
    assert values == sorted(values), values
    assert values[-1] == total
    assert len({v["value"] for v in between}) >= 3, values

    # And animation frames kept coming while the bytes went out, never a second apart
    assert between[-1]["frames"] - between[0]["frames"] >= 3, seen["values"]
    assert between[-1]["at_ms"] > between[0]["at_ms"]
    assert seen["longestFrameGapMs"] < 1000, seen["longestFrameGapMs"]
    assert console_errors == []


def test_upload_carries_the_dashboards_api_key(
    page: Page, secured_server: Server, console_errors: list[str], tmp_path: Path
) -> None:
    # Given the dashboard of a server with API keys, with tenant acme's key already saved
    photo = noise_png(tmp_path / "keyed.png", 80, 60)
    page.add_init_script(SAVED_KEY % ACME_KEY)
    page.goto(f"{secured_server.url}/")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")

    # When an image is uploaded to be converted to WebP
    upload(page, photo, "convert", format="webp")

    # Then acme's task is made and runs to SUCCESS; its page loads the WebP with the key
    status = page.get_by_test_id("upload-status")
    expect(status).to_have_attribute("data-state", "done", timeout=20_000)
    task_id = status.get_attribute("data-task-id") or ""
    task = secured_server.task(task_id)
    assert task["inputs"][0]["content_type"] == "image/png"
    expect(status.get_by_test_id("upload-task-status")).to_have_attribute(
        "data-status", "SUCCESS", timeout=20_000
    )
    status.get_by_test_id("upload-task-link").click()
    output = page.get_by_test_id("task-page").get_by_test_id("output-image")
    expect(output).to_have_js_property("naturalWidth", 80)
    assert secured_server.task(task_id)["result"]["outputs"][0]["name"] == "image.webp"
    expect(page.get_by_test_id("auth-form-panel")).to_be_hidden()
    assert console_errors == []
