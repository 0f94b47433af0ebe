"""The dashboard in a real Chromium (Debian's package, driven by Playwright) against real
`kiln serve` processes on 127.0.0.1, each started and stopped by its PID.

Two servers start side by side once per session: an open one (no API keys) and a secured
one (`KILN_API_KEYS=acme:k1`). Chromium missing is a loud skip outside CI and a failure in
CI, where nothing is skipped for a missing component.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import ConsoleMessage, Error, Page

#: The key of tenant `acme` on the secured server.
ACME_KEY = "k1"

#: Snappy leases, sweeps and cancels: a cancel or a retry shows up within a second or two.
FAST_ENV = {
    "KILN_LEASE_TTL_S": "2",
    "KILN_SUPERVISOR_INTERVAL_S": "0.2",
    "KILN_CANCEL_GRACE_S": "2",
    "KILN_RETRY_BASE_S": "0.05",
    "KILN_RETRY_MAX_S": "0.1",
}

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

MISSING_CHROMIUM = (
    "Chromium is not installed: the browser tests need Debian's `chromium` package "
    "(`apt-get install -y chromium`, or `make system-deps`)"
)


# ---- Chromium --------------------------------------------------------------------------


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        if in_ci():
            pytest.fail(MISSING_CHROMIUM)
        pytest.skip(MISSING_CHROMIUM)
    return path


@pytest.fixture(scope="session")
def browser_type_launch_args(
    browser_type_launch_args: dict[str, Any], chromium_path: str
) -> dict[str, Any]:
    return {
        **browser_type_launch_args,
        "executable_path": chromium_path,
        "headless": True,
        "args": CHROMIUM_ARGS,
    }


@pytest.fixture(scope="session")
def base_url(server: Server) -> str:
    """The open server, so pages go to "/" or "/#/tasks/<id>".

    This replaces pytest-playwright's own `base_url` fixture, a session-scoped instance
    method that pytest 9 warns about (PytestRemovedIn10Warning) when it runs.
    """
    return server.url


@pytest.fixture
def console_errors(page: Page) -> list[str]:
    """Every console error and uncaught exception of the page, as text."""
    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(f"console: {message.text} ({message.location.get('url', '')})")

    def on_page_error(error: Error) -> None:
        errors.append(f"pageerror: {error.message}")

    page.on("console", on_console)
    page.on("pageerror", on_page_error)
    return errors


# ---- kiln servers ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Server:
    """One `kiln serve` process and the HTTP calls the tests make to it."""

    url: str
    popen: subprocess.Popen[bytes]
    log: Path
    key: str | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def wait_healthy(self, timeout_s: float = 60) -> Server:
        def healthy() -> bool:
            if self.popen.poll() is not None:
                pytest.fail(f"kiln serve exited with {self.popen.returncode}:\n{self.output()}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout_s, f"kiln serve on {self.url}")
        return self

    def submit(self, prompt: str, **params: Any) -> dict[str, Any]:
        body = {"kind": "image.generate", "params": {"prompt": prompt, **params}}
        response = httpx.post(f"{self.url}/v1/tasks", json=body, headers=self.headers())
        assert response.status_code == 201, response.text
        task: dict[str, Any] = response.json()
        return task

    def task(self, task_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/tasks/{task_id}", headers=self.headers())
        assert response.status_code == 200, response.text
        task: dict[str, Any] = response.json()
        return task

    def wait_status(self, task_id: str, status: str, timeout_s: float = 20) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            task = self.task(task_id)
            return task if task["status"] == status else None

        found: dict[str, Any] = wait_until(reached, timeout_s, f"{task_id} to reach {status}")
        return found

    def stop(self, timeout_s: float = 10) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=timeout_s)


def launch(root: Path, name: str, key: str | None = None, **env: str) -> Server:
    """Starts `kiln serve` with 2 in-process workers; returns before it answers."""
    data_dir = root / name
    data_dir.mkdir()
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    full_env.update(FAST_ENV, **env)
    log = root / f"{name}.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            [sys.executable, "-m", "kiln", "serve", "--port", str(port),
             "--data-dir", str(data_dir), "--workers", "2"],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=root,
        )  # fmt: skip
    return Server(f"http://127.0.0.1:{port}", popen, log, key)


@dataclass
class Launched:
    open: Server
    secured: Server


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory, chromium_path: str) -> Iterator[Launched]:
    """Both servers, started at once so their start-up times overlap."""
    root = tmp_path_factory.mktemp("kiln-servers")
    started: list[Server] = []
    try:
        started.append(launch(root, "open"))
        started.append(launch(root, "secured", ACME_KEY, KILN_API_KEYS=f"acme:{ACME_KEY}"))
        yield Launched(*started)
    finally:
        for server in reversed(started):
            server.stop()


@pytest.fixture(scope="session")
def server(launched: Launched) -> Server:
    """A `kiln serve` without API keys: one tenant, every action open."""
    return launched.open.wait_healthy()


@pytest.fixture(scope="session")
def secured_server(launched: Launched) -> Server:
    """A `kiln serve` with `KILN_API_KEYS=acme:k1`."""
    return launched.secured.wait_healthy()


def unique_prompt(what: str) -> str:
    """A prompt no other task has: content dedup never hands back another test's task."""
    return f"{what} {uuid.uuid4().hex[:8]}"
