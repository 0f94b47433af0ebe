"""A throwaway PostgreSQL cluster for the test session, on a free loopback port.

``initdb`` refuses to run as root, so as root the server runs as the ``postgres`` user
through ``runuser``. Durability is off (``fsync=off``): these tests attack concurrency and
crash semantics of kiln, not PostgreSQL's own. Each test gets its own database, cloned from
a template that already holds kiln's schema, in about 30 ms.

Missing binaries fail the session in CI (``CI=true``) and skip loudly elsewhere.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TEMPLATE = "kiln_template"


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def missing(what: str) -> None:
    """Fail in CI, skip loudly elsewhere."""
    message = f"PostgreSQL tests need {what}: run `make system-deps` (installs postgresql)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(f"SKIPPED, MISSING COMPONENT: {message}")


@dataclass
class PostgresServer:
    bin_dir: Path
    root: Path
    port: int
    _names: Iterator[int] = field(default_factory=itertools.count)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://kiln@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def init(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run(
            "initdb", "-D", str(self.data), "-U", "kiln", "--auth=trust", "-E", "UTF8",
            "--no-locale", "--no-sync",
        )  # fmt: skip

    def start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off -c max_connections=400"
            " -c shared_buffers=128MB"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"),
                  "-o", options, "-w", "-t", "60", "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop",
                  check=False)  # fmt: skip

    def restart(self) -> None:
        """Stop (dropping every connection) and start again on the same port."""
        self.stop("fast")
        self.start()

    def sql(self, statement: str, database: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            conn.execute(statement)  # type: ignore[arg-type]

    def new_database(self, *, template: str | None = TEMPLATE) -> str:
        """A fresh database (a copy of the migrated template by default); its URL."""
        name = f"t{os.getpid()}_{next(self._names)}"
        clause = f" TEMPLATE {template}" if template else ""
        self.sql(f"CREATE DATABASE {name}{clause}")
        return self.url(name)


def _prepare_template(server: PostgresServer) -> None:
    import asyncio
    import concurrent.futures

    from kiln.store.postgres import PostgresStore

    server.sql(f"CREATE DATABASE {TEMPLATE}")

    async def migrate() -> None:
        store = await PostgresStore.open(server.url(TEMPLATE), clock=time.time, pool_size=1)
        await store.close()

    # On a thread of its own: the first test to ask for the server may be inside a loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, migrate()).result()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (``.new_database()`` per test)."""
    bin_dir = _bin_dir()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        missing("PostgreSQL's server binaries (initdb, pg_ctl)")
    assert bin_dir is not None
    try:
        import psycopg  # noqa: F401
    except ImportError:
        missing("the psycopg package (make setup)")
    root = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
    server = PostgresServer(bin_dir, root, free_port())
    server.init()
    server.start()
    try:
        _prepare_template(server)
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
