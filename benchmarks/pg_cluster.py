"""PostgreSQL for the lifecycle benchmark: a throwaway cluster, fresh databases, the
server's own counters, and pgbench on the same cluster.

The throwaway cluster keeps PostgreSQL's durable defaults (``fsync``, ``synchronous_commit``
and ``full_page_writes`` on): every commit waits for its WAL flush, as in production. As
root, the server runs as the ``postgres`` user through ``runuser`` (initdb refuses root).

    python benchmarks/pg_cluster.py          # start one, print its URL, stop on Enter
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

#: What the benchmark reports about the server it ran on.
SHOWN_SETTINGS = (
    "fsync", "synchronous_commit", "full_page_writes", "wal_level", "wal_sync_method",
    "shared_buffers", "max_connections",
)  # fmt: skip


def bin_dir() -> Path:
    """The folder of initdb, pg_ctl and pgbench (Debian's versioned folder, or PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"))
    if found:
        return Path(found[-1]).parent
    pgbench = shutil.which("pgbench")
    if pgbench is None:
        raise SystemExit("pgbench not found: install PostgreSQL (make system-deps)")
    return Path(pgbench).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def with_database(url: str, name: str) -> str:
    """The same server URL, naming another database."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The server's counters at one moment: cluster-wide xids, one database's commits, and
    the CPU seconds the server's processes used so far (None when they cannot be read)."""

    next_xid: int
    commits: int
    rollbacks: int
    server_cpu_s: float | None


class Cluster:
    """A PostgreSQL server reached through ``url`` (a database where CREATE DATABASE may
    run)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def sql(self, statement: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            cur = conn.execute(statement.encode(), args or None)
            return cur.fetchall() if cur.description else []

    def create_database(self, name: str) -> str:
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.sql(f'CREATE DATABASE "{name}"')
        return with_database(self.url, name)

    def drop_database(self, name: str) -> None:
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def describe(self) -> dict[str, str]:
        version = str(self.sql("SHOW server_version")[0][0])
        shown = {"postgresql": version.split()[0]}
        for name in SHOWN_SETTINGS:
            shown[name] = str(self.sql(f"SHOW {name}")[0][0])
        return shown

    def postmaster_pid(self) -> int | None:
        """The server's main process, when it runs on this machine and /proc shows it."""
        with psycopg.connect(self.url, autocommit=True) as conn:  # its backend lives on
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            try:
                if b"postgres" not in Path(f"/proc/{row[0]}/cmdline").read_bytes():
                    return None  # a server elsewhere: that pid is some local process
                return int(_proc_stat(row[0])[1])
            except (OSError, ValueError):
                return None

    def connections(self, database: str) -> int:
        rows = self.sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,))
        return int(rows[0][0])

    def snapshot(self, database: str, postmaster: int | None) -> Snapshot:
        """Read from the maintenance database, so the reads add no commits to ``database``.

        A backend reports its commit counts when idle, at most once a second, and when it
        exits: read ``commits`` after the database's connections have closed.
        """
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
                (database,),
            ).fetchone()
            xid = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        assert row is not None and xid is not None
        cpu = server_cpu_s(postmaster) if postmaster is not None else None
        return Snapshot(int(xid[0]), int(row[0]), int(row[1]), cpu)

    def wait_idle(self, database: str, timeout_s: float = 10.0) -> None:
        """Wait until no connection to ``database`` is left (their counts are then in)."""
        deadline = time.monotonic() + timeout_s
        while self.connections(database) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # a backend flushes its counts while it exits


def _proc_stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ...]."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def server_cpu_s(postmaster: int) -> float | None:
    """CPU seconds of the server: the postmaster, the children it has reaped (cutime,
    cstime) and its live children. Backends that exit between two readings still count."""
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        fields = _proc_stat(postmaster)
    except OSError:
        return None
    total = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            child = _proc_stat(int(entry.name))
        except (OSError, IndexError):  # it exited meanwhile
            continue
        if child[1] == str(postmaster):
            total += int(child[11]) + int(child[12])
    return total / ticks


def machine_cpu() -> tuple[float, float, float]:
    """(busy, idle, iowait) seconds of all CPUs together so far, from /proc/stat."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / ticks, idle / ticks, iowait / ticks


# pgbench --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pgbench:
    tps: float
    latency_ms: float
    clients: int
    threads: int
    seconds: float
    server_cpu_s: float | None
    client_cpu_s: float
    busy_s: float


def run_pgbench(
    cluster: Cluster, *, clients: int, threads: int, seconds: float, postmaster: int | None
) -> Pgbench:
    """``pgbench -N`` (TPC-B without the contended branch and teller updates) for
    ``seconds`` on a fresh database of its own on the same cluster."""
    name = f"kiln_pgbench_{os.getpid()}"
    url = cluster.create_database(name)
    pgbench = str(bin_dir() / "pgbench")
    try:
        subprocess.run([pgbench, "-i", "-q", url], check=True, capture_output=True, timeout=120)
        busy, _, _ = machine_cpu()
        before_cpu = server_cpu_s(postmaster) if postmaster else None
        before_children = os.times()
        done = subprocess.run(
            [pgbench, "-N", "-c", str(clients), "-j", str(threads), "-T", str(round(seconds)),
             url],
            check=True, capture_output=True, text=True, timeout=seconds + 120,
        )  # fmt: skip
        after_children = os.times()
        after_cpu = server_cpu_s(postmaster) if postmaster else None
        busy_s = machine_cpu()[0] - busy
    finally:
        cluster.drop_database(name)
    tps = re.search(r"^tps = ([0-9.]+)", done.stdout, re.MULTILINE)
    latency = re.search(r"^latency average = ([0-9.]+) ms", done.stdout, re.MULTILINE)
    if tps is None or latency is None:
        raise RuntimeError(f"unexpected pgbench output:\n{done.stdout}\n{done.stderr}")
    server = None
    if before_cpu is not None and after_cpu is not None:
        server = after_cpu - before_cpu
    client = (after_children.children_user + after_children.children_system) - (
        before_children.children_user + before_children.children_system
    )
    return Pgbench(float(tps[1]), float(latency[1]), clients, threads, seconds, server,
                   client, busy_s)  # fmt: skip


# A throwaway cluster --------------------------------------------------------------------------


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


@contextmanager
def throwaway_cluster(max_connections: int = 200) -> Iterator[Cluster]:
    """Start a fresh cluster on a free loopback port with durability on; stop and remove it
    afterwards, whatever happens."""
    binaries = bin_dir()
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    pg_ctl = [str(binaries / "pg_ctl"), "-D", str(data), "-w", "-t", "60"]
    started = False
    try:
        subprocess.run(
            _as_server_user([str(binaries / "initdb"), "-D", str(data), "-U", "kiln",
                             "--auth=trust", "-E", "UTF8", "--no-locale"]),
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        options = (
            f"-c listen_addresses=127.0.0.1 -p {port} -k {root}"
            f" -c max_connections={max_connections}"
        )
        subprocess.run(
            _as_server_user([*pg_ctl, "-l", str(root / "log"), "-o", options, "start"]),
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        started = True
        yield Cluster(f"postgresql://kiln@127.0.0.1:{port}/postgres")
    finally:
        if started:
            subprocess.run(_as_server_user([*pg_ctl, "-m", "fast", "stop"]),
                           capture_output=True, timeout=120)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    with throwaway_cluster() as cluster:
        print(cluster.url, cluster.describe(), flush=True)
        input("Enter stops the cluster: ")
