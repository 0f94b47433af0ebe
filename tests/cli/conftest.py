"""Real `kiln` processes on 127.0.0.1: servers, workers and supervisors started by PID.

Every process is started by a fixture or a test through :class:`Processes`, which sends
SIGTERM to each one it started (SIGKILL only when that does not end it) at teardown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

#: Fast retries and sweeps: recovery tests wait on lease TTL + sweep, not on backoff.
FAST_ENV = {
    "KILN_RETRY_BASE_S": "0.05",
    "KILN_RETRY_MAX_S": "0.1",
    "KILN_SUPERVISOR_INTERVAL_S": "0.1",
}


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any KILN_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(extra)
    return env


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Server:
    process: Process
    url: str
    data_dir: Path
    env: dict[str, str]


@dataclass
class Processes:
    """Starts `python -m kiln ...` processes and stops each one it started."""

    root: Path
    started: list[Process] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Process:
        log = self.root / f"{name}-{len(self.started)}.log"
        with log.open("wb") as handle:
            popen = subprocess.Popen(
                [sys.executable, "-m", "kiln", *args],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.root,
            )
        process = Process(name, popen, log)
        self.started.append(process)
        return process

    def serve(self, data_dir: Path, *args: str, **env: str) -> Server:
        port = free_port()
        full_env = clean_env(**FAST_ENV, **env)
        process = self.start(
            "serve", ["serve", "--port", str(port), "--data-dir", str(data_dir), *args], full_env
        )
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url, process), 30, f"kiln serve on {url}")
        return Server(process, url, data_dir, full_env)

    def worker(self, server: Server, *args: str) -> Process:
        return self.start(
            "worker", ["worker", "--data-dir", str(server.data_dir), *args], server.env
        )

    def stop(self, process: Process, timeout_s: float = 15) -> int:
        if process.alive():
            os.kill(process.pid, signal.SIGTERM)
        try:
            return process.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            return process.popen.wait(timeout=timeout_s)

    def kill(self, process: Process) -> None:
        os.kill(process.pid, signal.SIGKILL)
        process.popen.wait(timeout=15)

    def stop_all(self) -> None:
        for process in reversed(self.started):
            self.stop(process)


def _healthy(url: str, process: Process) -> bool:
    if not process.alive():
        pytest.fail(f"kiln serve exited with {process.popen.returncode}:\n{process.output()}")
    try:
        return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    started = Processes(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(scope="module")
def module_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    started = Processes(tmp_path_factory.mktemp("procs"))
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(scope="session")
def session_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    started = Processes(tmp_path_factory.mktemp("session-procs"))
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(scope="session")
def server(session_processes: Processes) -> Server:
    """One `kiln serve` (API, 2 in-process workers, supervisor) shared by a test module.

    A 3 s lease means a heartbeat every second: a cancel reaches a stalled attempt quickly.
    """
    return session_processes.serve(
        session_processes.root / "data", "--workers", "2", KILN_LEASE_TTL_S="3"
    )


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands run in-process default to ./kiln-data: keep that under tmp_path."""
    monkeypatch.chdir(tmp_path)
