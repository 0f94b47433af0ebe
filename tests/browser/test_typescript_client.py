"""The generated TypeScript client in Chromium, against a real `kiln serve`: a page bundles
clients/typescript with esbuild, submits a task with the typed client, follows its event
stream, stops, resumes it from the last event id (`Last-Event-ID`), and downloads the
output, whose sha256 it checks against the task's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, Route

from typescript_support import install, tool

from .conftest import Server, unique_prompt

pytestmark = pytest.mark.browser

#: Where the page and the bundle are served from: kiln's own origin (the route answers
#: them in the browser), so the client calls kiln as a page kiln served would.
PAGE_PATH = "/ts-client"

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>kiln TypeScript client</title></head>
<body><script type="module">
import { createKilnClient, downloadOutput, followTask } from "./kiln-client.js";

window.submitFollowDownload = async (prompt, stopAfter) => {
  const kiln = createKilnClient({ baseUrl: location.origin });
  const { data: task, error } = await kiln.POST("/v1/tasks", {
    body: { kind: "image.generate",
            params: { prompt, width: 64, height: 64, steps: 12, simulate: { step_ms: 30 } } },
  });
  if (error) throw new Error(JSON.stringify(error));
  const before = [];
  const stopped = await followTask(kiln, task.id, {
    onEvent: (event, id) => {
      if (id !== undefined) before.push(id);
      return before.length < stopAfter;
    },
  });
  const after = [];
  let progress = 0;
  const resumed = await followTask(kiln, task.id, {
    lastEventId: stopped.lastEventId,
    onEvent: (event, id) => {
      if (id !== undefined) after.push(id);
      else progress += 1;
    },
  });
  const { data: done } = await kiln.GET("/v1/tasks/{task_id}", {
    params: { path: { task_id: task.id } },
  });
  const output = done.result.outputs[0];
  const blob = await downloadOutput(kiln, task.id, output.name);
  const digest = await crypto.subtle.digest("SHA-256", await blob.arrayBuffer());
  const sha256 = [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0"));
  return {
    id: task.id, before, stoppedAt: stopped.lastEventId, stoppedFinal: stopped.final ?? null,
    after, progress, final: resumed.final, output, size: blob.size, type: blob.type,
    sha256: sha256.join(""),
  };
};
window.ready = true;
</script></body></html>
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[bytes]:
    """clients/typescript bundled for the browser by its pinned esbuild."""
    install()
    out = tmp_path_factory.mktemp("ts-client") / "kiln-client.js"
    built = tool("esbuild", "src/index.ts", "--bundle", "--format=esm", f"--outfile={out}")
    assert built.returncode == 0, built.stderr
    yield Path(out).read_bytes()


@pytest.fixture
def client_page(page: Page, server: Server, bundle: bytes) -> Page:
    def serve(route: Route) -> None:
        if route.request.url.endswith("/kiln-client.js"):
            route.fulfill(body=bundle, content_type="text/javascript")
        else:
            route.fulfill(body=PAGE, content_type="text/html")

    page.route(f"{server.url}{PAGE_PATH}/*", serve)
    page.goto(f"{server.url}{PAGE_PATH}/index.html")
    page.wait_for_function("window.ready === true")
    return page


def _event_ids(server: Server, task_id: str) -> list[int]:
    """The ids of a final task's status events, as its stream replays them to anyone."""
    ids = []
    with httpx.stream("GET", f"{server.url}/v1/tasks/{task_id}/events", timeout=30) as stream:
        for line in stream.iter_lines():
            if line.startswith("id:"):
                ids.append(int(line[3:].strip()))
    return ids


def test_the_generated_client_submits_follows_with_resume_and_downloads(
    client_page: Page, server: Server, console_errors: list[str]
) -> None:
    # When the page submits a task with the typed client, follows its stream for two
    # status events, stops, and resumes from the last id it saw
    result: dict[str, Any] = client_page.evaluate(
        "([prompt, stopAfter]) => window.submitFollowDownload(prompt, stopAfter)",
        [unique_prompt("a fox for the typescript client"), 2],
    )
    # Then the first stream stopped at its second event, before the end (ids are the
    # event log's sequence, so a shared server's ids do not start at 1)
    replayed = _event_ids(server, result["id"])
    assert result["before"] == replayed[:2] and result["stoppedAt"] == replayed[1]
    assert result["stoppedFinal"] is None
    # And the resumed stream went on from the next event, through the final one: no
    # status event lost or repeated, the same ids the server replays for the task
    assert result["after"][0] == replayed[2]
    assert result["before"] + result["after"] == replayed
    assert result["final"]["status"] == "SUCCESS" and result["final"]["final"] is True
    # And the downloaded output is the stored one
    output = result["output"]
    assert output["name"] == "image.png" and result["type"] == "image/png"
    assert result["size"] == output["size"] and result["sha256"] == output["sha256"]
    assert server.task(result["id"])["status"] == "SUCCESS"
    assert console_errors == []
