"""kiln beside its peers, in the same run: Dramatiq on Redis and Procrastinate on PostgreSQL.

Rounds are interleaved (each round runs every system once), and each figure is the median
over the rounds, so the machine's drift hits every system alike:

- kiln on SQLite, full no-op lifecycles (submit included) per second,
  ``benchmarks/lifecycle.py`` at ``synchronous=NORMAL`` and at ``FULL``;
- kiln on PostgreSQL, the same with ``--workers`` worker processes of ``--pg-slots`` slots
  (default one of 64: on two cores, more processes than cores cost CPU for smaller
  batches) on a throwaway cluster (fsync and synchronous_commit on);
- Dramatiq on Redis and Procrastinate on the same PostgreSQL cluster: the drain rate of N
  queued no-op jobs (and enqueue + drain), by ``benchmarks/peers/*.py``.

The peers live in their own virtual environment (``.peers-venv``, made and filled here,
never in kiln's dependencies); Redis is Debian's ``redis-server`` (installed here as root
when missing), started on a free loopback port without persistence.

    make bench-peers
    .venv/bin/python benchmarks/peers.py --rounds 3 --tasks 3000 --pg-tasks 1500

The last line is one JSON object: each system's median (kiln's CPU per lifecycle too,
``*_cpu_us``), and kiln's ratios to its peers
(``sqlite_normal_vs_dramatiq``, ``sqlite_full_vs_dramatiq``,
``postgres_vs_procrastinate``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pg_cluster import throwaway_cluster

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = ROOT / ".peers-venv"
PEERS = ("dramatiq[redis]==2.2.1", "procrastinate==3.10.0", "psycopg[binary]>=3.2")


def peers_python() -> Path:
    """The peers' venv, made and filled once (a stamp names what it holds)."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    if stamp.exists() and stamp.read_text() == "\n".join(PEERS):
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    *PEERS], check=True)  # fmt: skip
    stamp.write_text("\n".join(PEERS))
    return python


def redis_server() -> str:
    """Debian's redis-server, installed when missing (as root)."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0:
        sys.exit("redis-server is missing: sudo apt-get install -y redis-server")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                    "redis-server"], check=True, env=env)  # fmt: skip
    return shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def redis() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)


def last_json(command: list[str], timeout_s: float) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=HERE)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{done.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def one_round(
    args: argparse.Namespace, peers: Path, redis_url: str, cluster: Any
) -> dict[str, Any]:
    lifecycle = [sys.executable, str(HERE / "lifecycle.py"), "--output-bytes", "0", "--json-only"]
    figures: dict[str, Any] = {}
    for level in ("NORMAL", "FULL"):
        run = last_json([*lifecycle, "--tasks", str(args.tasks), "--synchronous", level], 600)
        figures[f"kiln_sqlite_{level.lower()}"] = run["lifecycles_per_s"]
        figures[f"kiln_sqlite_{level.lower()}_cpu_us"] = run["cpu_us_per_lifecycle"]
    figures["dramatiq"] = last_json(
        [str(peers), str(HERE / "peers" / "dramatiq_noop.py"), "--redis-url", redis_url,
         "--tasks", str(args.tasks), "--threads", str(args.threads)], 600,
    )["drain_per_s"]  # fmt: skip
    run = last_json(
        [*lifecycle, "--database", cluster.url, "--workers", str(args.workers),
         "--concurrency", str(args.pg_slots), "--tasks", str(args.pg_tasks),
         "--pgbench-seconds", "1"], 900,
    )  # fmt: skip
    figures["kiln_postgres"] = run["lifecycles_per_s"]
    figures["kiln_postgres_cpu_us"] = run["cpu_us_per_lifecycle"]
    database = cluster.create_database(f"procrastinate_{int(time.time() * 1000)}")
    figures["procrastinate"] = last_json(
        [str(peers), str(HERE / "peers" / "procrastinate_noop.py"), "--database", database,
         "--tasks", str(args.pg_tasks), "--concurrency", str(args.concurrency)], 900,
    )["drain_per_s"]  # fmt: skip
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=3000, help="SQLite and Dramatiq")
    parser.add_argument("--pg-tasks", type=int, default=1500, help="PostgreSQL, both systems")
    parser.add_argument("--workers", type=int, default=1, help="kiln worker processes on PG")
    parser.add_argument("--pg-slots", type=int, default=64, help="slots per kiln worker on PG")
    parser.add_argument("--threads", type=int, default=8, help="Dramatiq worker threads")
    parser.add_argument("--concurrency", type=int, default=16, help="Procrastinate's")
    args = parser.parse_args()
    peers = peers_python()
    rounds: list[dict[str, Any]] = []
    with redis() as redis_url, throwaway_cluster() as cluster:
        for n in range(args.rounds):
            rounds.append(one_round(args, peers, redis_url, cluster))
            shown = (f"{k} {v:,.0f}" + ("" if k.endswith("_us") else "/s")
                     for k, v in rounds[-1].items())  # fmt: skip
            print(f"round {n + 1}: " + ", ".join(shown))
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    ratios = {
        "sqlite_normal_vs_dramatiq": median["kiln_sqlite_normal"] / median["dramatiq"],
        "sqlite_full_vs_dramatiq": median["kiln_sqlite_full"] / median["dramatiq"],
        "postgres_vs_procrastinate": median["kiln_postgres"] / median["procrastinate"],
    }
    print(json.dumps({"rounds": rounds, "median_per_s": median,
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
