"""kiln beside its peers, in the same run: Dramatiq on Redis; Procrastinate and PgQueuer
on PostgreSQL; Oban for Python where it installs.

Each peer runs through its own worker CLI at that CLI's defaults (what they are, and the
source, in benchmarks/README.md). Rounds are interleaved (each round runs every system
once) and each figure is the median over the rounds, so the machine's drift hits every
system alike:

- kiln on SQLite, full no-op lifecycles (submit included) per second,
  ``benchmarks/lifecycle.py`` at ``synchronous=NORMAL`` and at ``FULL``, as ``kiln serve``
  runs it (``KILN_WORKER_PROCESSES=auto``: the submitting process with its own worker, and
  one worker process per core beyond the first, on the same file), CPU per lifecycle of
  all those processes; and at ``FULL`` in one process (``--worker-processes 0``), beside;
- kiln on PostgreSQL, the same with ``--workers`` worker processes of ``--pg-slots`` slots
  on a throwaway cluster (fsync and synchronous_commit on); and, like the peers, its drain
  (``lifecycle.py --drain``: all queued, then the workers start) and enqueue + drain with
  submits in batches of ``--enqueue-batch`` (``--submit-batch``), PgQueuer's list size;
- every peer: the drain rate (N jobs queued before the worker starts) and the enqueue +
  drain rate (enqueued while the worker runs, first enqueue to last job done), by
  ``benchmarks/peers/*.py``; Procrastinate and PgQueuer on the same cluster as kiln;
- the pickup latency (submit to handler start), p50 and p99, of every system at a fixed
  offered load (``--rate`` tasks/s for ``--seconds``, an open-loop generator).

The peers live in their own virtual environment (``.peers-venv``, made and filled here
from pinned PyPI versions, never in kiln's dependencies); Redis is Debian's
``redis-server`` (installed here as root when missing), started on a free loopback port
without persistence.

    make bench-peers
    .venv/bin/python benchmarks/peers.py --rounds 3 --tasks 3000 --pg-tasks 1500
    .venv/bin/python benchmarks/peers.py --quick     # one small round, a smoke run

The last line is one JSON object: each figure's median (``median_per_s``; kiln's CPU per
lifecycle too, ``*_cpu_us``), the pickup p50/p99 per system (``pickup_ms``), and kiln's
ratios to its peers (``ratios``).
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
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pg_cluster import throwaway_cluster

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = ROOT / ".peers-venv"
PEERS = (
    "dramatiq[redis]==2.2.1",
    "redis==8.2.0",
    "procrastinate==3.10.0",
    "psycopg[binary]==3.3.9",
    "psycopg-pool==3.3.3",
    "pgqueuer[asyncpg]==1.6.0",
    "asyncpg==0.32.0",
    # pgqueuer 1.6.0's `pgq run` fails at start on typer 0.29 (its --log-level default
    # reaches the logger as a str); 0.16 is the typer the recorded runs used
    "typer==0.16.0",
)
#: Oban for Python (PyPI ``oban``): every release needs Python >= 3.12, newer than this
#: machine's, so it is not installed nor run; the JSON says so.
OBAN = "oban==0.7.0"
#: kiln's SQLite figures beside the default one, and their ratios to Dramatiq's drain
#: (None when the figure did not run).
BESIDE_DRAMATIQ = (
    ("kiln_sqlite_full_one_process", "sqlite_full_one_process_vs_dramatiq"),
    ("kiln_sqlite_full_baseline", "sqlite_full_baseline_vs_dramatiq"),
)
#: kiln's worker slots on SQLite, as benchmarks/lifecycle.py runs it.
SQLITE_SLOTS = 256


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
def redis() -> Iterator[dict[str, str]]:
    """A Redis server for the run: the Dramatiq script's environment (its URL, its pid)."""
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
        url = f"redis://127.0.0.1:{port}/0"
        yield {"BENCH_REDIS_URL": url, "BENCH_SERVER_PID": str(server.pid)}
    finally:
        server.terminate()
        server.wait(timeout=10)


def last_json(
    command: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=HERE,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def peer(
    args: argparse.Namespace, peers: Path, script: str, tasks: int, env: dict[str, str]
) -> dict[str, Any]:
    """One peer's three figures, by its script in the peers' venv, in a scratch folder."""
    with tempfile.TemporaryDirectory(prefix="kiln-peers-") as scratch:
        found = last_json(
            [
                str(peers),
                str(HERE / "peers" / script),
                "--tasks",
                str(tasks),
                "--rate",
                str(args.rate),
                "--seconds",
                str(args.seconds),
                "--scratch",
                scratch,
                "--enqueue-batch",
                str(args.enqueue_batch),
            ],
            900,
            env,
        )
    name = found["system"]
    one = found.get("enqueue_one_drain_per_s")  # PgQueuer's one job per enqueue call
    return {
        name: found["drain_per_s"],
        f"{name}_enqueue_drain": found["enqueue_drain_per_s"],
        f"{name}_enqueue_drain_cpu_us": found["enqueue_drain_cpu_us"],
        f"{name}_enqueue_drain_server_cpu_us": found["enqueue_drain_server_cpu_us"],
        **({f"{name}_enqueue_one_drain": one} if one is not None else {}),
        **pickup_keys(name, found),
    }


def pickup_keys(name: str, found: dict[str, Any]) -> dict[str, Any]:
    return {
        f"{name}_pickup_p50_ms": found["pickup_p50_ms"],
        f"{name}_pickup_p99_ms": found["pickup_p99_ms"],
        f"{name}_pickup_started_per_s": found["pickup_started_per_s"],
    }


def kiln_pickup(args: argparse.Namespace, name: str, database: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kiln-pickup-") as scratch:
        url = database or f"sqlite:///{scratch}/pickup.db"
        found = last_json(
            [
                sys.executable,
                str(HERE / "peers" / "kiln_pickup.py"),
                "--database",
                url,
                "--scratch",
                scratch,
                "--rate",
                str(args.rate),
                "--seconds",
                str(args.seconds),
                "--workers",
                str(args.workers),
                "--concurrency",
                str(args.pg_slots if database else SQLITE_SLOTS),
            ],
            600,
        )
    return pickup_keys(name, found)


LIFECYCLE = [sys.executable, str(HERE / "lifecycle.py"), "--output-bytes", "0", "--json-only"]


def kiln_figures(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    lifecycle = LIFECYCLE
    figures: dict[str, Any] = {}
    for level in ("NORMAL", "FULL"):
        run = last_json([*lifecycle, "--tasks", str(args.tasks), "--synchronous", level], 600)
        figures[f"kiln_sqlite_{level.lower()}"] = run["lifecycles_per_s"]
        figures[f"kiln_sqlite_{level.lower()}_cpu_us"] = run["cpu_us_per_lifecycle"]
        figures["kiln_sqlite_worker_processes"] = run.get("worker_processes", 0)
    one = [*lifecycle, "--tasks", str(args.tasks), "--synchronous", "FULL"]
    run = last_json([*one, "--worker-processes", "0"], 600)
    figures["kiln_sqlite_full_one_process"] = run["lifecycles_per_s"]
    figures["kiln_sqlite_full_one_process_cpu_us"] = run["cpu_us_per_lifecycle"]
    if args.baseline_src:
        figures.update(baseline_figures(args))
    return figures


#: kiln's PostgreSQL figures: the key, and lifecycle.py's options beyond the common ones
#: (B: --enqueue-batch). The first is the lifecycle, submitted one task per call.
KILN_POSTGRES = (
    ("kiln_postgres", ()),
    ("kiln_postgres_enqueue_drain", ("--submit-batch", "B")),
    ("kiln_postgres_drain", ("--drain", "--submit-batch", "B")),
)


def kiln_postgres_figures(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    """kiln on PostgreSQL three ways: the lifecycle (submits one per call while the workers
    run), enqueue + drain (submits in batches of --enqueue-batch while they run), and the
    drain (all queued, then the workers start); CPU of all processes and of the workers."""
    common = [*LIFECYCLE, "--database", cluster.url, "--workers", str(args.workers),
              "--concurrency", str(args.pg_slots), "--tasks", str(args.pg_tasks),
              "--pgbench-seconds", "1"]  # fmt: skip
    figures: dict[str, Any] = {}
    for key, extra in KILN_POSTGRES:
        options = [str(args.enqueue_batch) if word == "B" else word for word in extra]
        run = last_json([*common, *options], 900)
        figures[key] = run["lifecycles_per_s"]
        figures[f"{key}_cpu_us"] = run["cpu_us_per_lifecycle"]
        figures[f"{key}_worker_cpu_us"] = run["worker_cpu_us_per_lifecycle"]
        if run.get("server_cpu_us_per_lifecycle") is not None:  # a server on this machine
            figures[f"{key}_server_cpu_us"] = run["server_cpu_us_per_lifecycle"]
    return figures


def baseline_figures(args: argparse.Namespace) -> dict[str, Any]:
    """kiln on SQLite (FULL) as another checkout runs it (``--baseline-src``: its
    ``benchmarks/lifecycle.py`` on its ``src``), in the same round."""
    src = Path(args.baseline_src).resolve()
    run = last_json(
        [
            sys.executable,
            str(src / "benchmarks" / "lifecycle.py"),
            "--output-bytes",
            "0",
            "--json-only",
            "--tasks",
            str(args.tasks),
            "--synchronous",
            "FULL",
        ],
        600,
        {"PYTHONPATH": str(src / "src")},
    )
    return {
        "kiln_sqlite_full_baseline": run["lifecycles_per_s"],
        "kiln_sqlite_full_baseline_cpu_us": run["cpu_us_per_lifecycle"],
    }


def one_round(
    args: argparse.Namespace, peers: Path, redis_env: dict[str, str], cluster: Any
) -> dict[str, Any]:
    figures: dict[str, Any] = {"loadavg_start": os.getloadavg()[0]}
    if not args.postgres_only:
        figures.update(kiln_figures(args, cluster))
    figures.update(kiln_postgres_figures(args, cluster))
    if not args.postgres_only:
        figures.update(peer(args, peers, "dramatiq_noop.py", args.tasks, redis_env))
    for script in ("procrastinate_noop.py", "pgqueuer_noop.py"):
        database = cluster.create_database(f"{script.split('_')[0]}_{int(time.time() * 1000)}")
        env = {"BENCH_DATABASE": database}
        postmaster = cluster.postmaster_pid()
        if postmaster is not None:  # the server's CPU, read from /proc
            env["BENCH_SERVER_PID"] = str(postmaster)
        figures.update(peer(args, peers, script, args.pg_tasks, env))
        cluster.drop_database(database.rsplit("/", 1)[1])
    if args.postgres_only:
        figures["loadavg_end"] = os.getloadavg()[0]
        return figures
    figures.update(kiln_pickup(args, "kiln_sqlite", None))
    database = cluster.create_database(f"kiln_pickup_{int(time.time() * 1000)}")
    figures.update(kiln_pickup(args, "kiln_postgres", database))
    cluster.drop_database(database.rsplit("/", 1)[1])
    figures["loadavg_end"] = os.getloadavg()[0]
    return figures


def oban_note(peers: Path) -> str:
    """Why Oban for Python did not run: it needs a newer Python than the peers' venv has."""
    version = subprocess.run(
        [str(peers), "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return (
        f"not run: PyPI {OBAN} requires Python >= 3.12, the peers' venv has {version}"
        " (no other Python on this machine)"
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


#: kiln's PostgreSQL drain and batched enqueue + drain beside the PostgreSQL peers' same
#: figures: (ratio, kiln's key, the peer's key).
LIKE_FOR_LIKE = (
    ("postgres_drain_vs_pgqueuer_drain", "kiln_postgres_drain", "pgqueuer"),
    ("postgres_enqueue_drain_vs_pgqueuer_enqueue_drain", "kiln_postgres_enqueue_drain",
     "pgqueuer_enqueue_drain"),
    ("postgres_drain_vs_procrastinate_drain", "kiln_postgres_drain", "procrastinate"),
    ("postgres_enqueue_drain_vs_procrastinate_enqueue_drain", "kiln_postgres_enqueue_drain",
     "procrastinate_enqueue_drain"),
    ("postgres_vs_pgqueuer_enqueue_one_drain", "kiln_postgres", "pgqueuer_enqueue_one_drain"),
)  # fmt: skip


def summary(rounds: list[dict[str, Any]], peers: Path) -> dict[str, Any]:
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    if "dramatiq" not in median:  # --postgres-only
        return postgres_summary(median, rounds, peers)
    ratios = {
        "sqlite_normal_vs_dramatiq": ratio(median["kiln_sqlite_normal"], median["dramatiq"]),
        "sqlite_full_vs_dramatiq": ratio(median["kiln_sqlite_full"], median["dramatiq"]),
        "postgres_vs_procrastinate": ratio(median["kiln_postgres"], median["procrastinate"]),
        "postgres_vs_procrastinate_enqueue_drain": ratio(
            median["kiln_postgres"], median["procrastinate_enqueue_drain"]
        ),
        "postgres_vs_pgqueuer_drain": ratio(median["kiln_postgres"], median["pgqueuer"]),
        "postgres_vs_pgqueuer_enqueue_drain": ratio(
            median["kiln_postgres"], median["pgqueuer_enqueue_drain"]
        ),
        "postgres_vs_oban_drain": None,
    }
    for key, name in BESIDE_DRAMATIQ:
        ratios[name] = ratio(median[key], median["dramatiq"]) if key in median else None
    for name, ours, theirs in LIKE_FOR_LIKE:
        ratios[name] = ratio(median.get(ours), median.get(theirs))
    systems = ("kiln_sqlite", "kiln_postgres", "dramatiq", "procrastinate", "pgqueuer")
    pickup = {
        name: {
            "p50": median[f"{name}_pickup_p50_ms"],
            "p99": median[f"{name}_pickup_p99_ms"],
            "started_per_s": median[f"{name}_pickup_started_per_s"],
        }
        for name in systems
    }
    return {
        "rounds": rounds,
        "median_per_s": median,
        "ratios": ratios,
        "pickup_ms": pickup,
        "oban": oban_note(peers),
        "machine": machine_line(),
    }


def postgres_summary(
    median: dict[str, Any], rounds: list[dict[str, Any]], peers: Path
) -> dict[str, Any]:
    """The summary of a --postgres-only run: kiln and the PostgreSQL peers (their pickup
    figures too: their scripts measure it)."""
    ratios: dict[str, float | None] = {
        "postgres_vs_procrastinate": ratio(median["kiln_postgres"], median["procrastinate"]),
        "postgres_vs_pgqueuer_drain": ratio(median["kiln_postgres"], median["pgqueuer"]),
        "postgres_vs_pgqueuer_enqueue_drain": ratio(
            median["kiln_postgres"], median["pgqueuer_enqueue_drain"]
        ),
        "postgres_vs_procrastinate_enqueue_drain": ratio(
            median["kiln_postgres"], median["procrastinate_enqueue_drain"]
        ),
    }
    for name, ours, theirs in LIKE_FOR_LIKE:
        ratios[name] = ratio(median.get(ours), median.get(theirs))
    return {
        "rounds": rounds,
        "median_per_s": median,
        "ratios": ratios,
        "pickup_ms": {
            name: {
                "p50": median[f"{name}_pickup_p50_ms"],
                "p99": median[f"{name}_pickup_p99_ms"],
                "started_per_s": median[f"{name}_pickup_started_per_s"],
            }
            for name in ("procrastinate", "pgqueuer")
        },
        "oban": oban_note(peers),
        "machine": machine_line(),
    }


def machine_line() -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "nproc": os.cpu_count(),
        "loadavg": round(os.getloadavg()[0], 2),
    }


def pickup_cell(pickup: dict[str, float], rate: float) -> str:
    cell = f"{pickup['p50']:.1f} / {pickup['p99']:.1f}"
    if pickup["started_per_s"] < 0.95 * rate:
        cell += f" (saturated: {pickup['started_per_s']:,.0f} of {rate:,.0f}/s started)"
    return cell


def table(body: dict[str, Any]) -> list[str]:
    median = body["median_per_s"]
    lines = [
        "system              drain/s  enqueue+drain/s  CPU us/job  server us/job  pickup p50/p99 ms"
    ]
    rows = (
        ("kiln SQLite NORMAL", "kiln_sqlite_normal", None, None),
        ("kiln SQLite FULL", "kiln_sqlite_full", None, "kiln_sqlite"),  # the default
        ("  in one process", "kiln_sqlite_full_one_process", None, None),
        ("  --baseline-src", "kiln_sqlite_full_baseline", None, None),
        ("kiln PostgreSQL", "kiln_postgres", None, "kiln_postgres"),
        (
            f"  batches of {body['enqueue_batch']}",
            "kiln_postgres_drain",
            "kiln_postgres_enqueue_drain",
            None,
        ),
        ("Dramatiq (Redis)", "dramatiq", "dramatiq_enqueue_drain", "dramatiq"),
        ("Procrastinate", "procrastinate", "procrastinate_enqueue_drain", "procrastinate"),
        ("PgQueuer", "pgqueuer", "pgqueuer_enqueue_drain", "pgqueuer"),
        ("  one per call", "pgqueuer_enqueue_one_drain", None, None),
    )
    for label, key, both, pick in rows:
        if key not in median:
            continue
        drain = "-" if both is None else f"{median[key]:,.0f}"
        lifecycle = f"{median[both or key]:,.0f}"
        cpu, server = (_us(median, key, both, part) for part in ("cpu_us", "server_cpu_us"))
        latency = (
            "-"
            if pick not in body["pickup_ms"]
            else pickup_cell(body["pickup_ms"][pick], body["rate"])
        )
        lines.append(f"{label:<18} {drain:>8} {lifecycle:>16} {cpu:>11} {server:>14}  {latency}")
    lines.append(
        "kiln PostgreSQL: submits one task per call while the workers run (enqueue+drain"
        " column); 'batches of B': drain = all queued, workers started; enqueue+drain ="
        " submits in batches of B while they run (CPU: the drain's, submits included);"
        " PgQueuer 'one per call': one job per enqueue call, 40 calls in flight on 10"
        " connections, as kiln's lifecycle submits. CPU per job: kiln's, every kiln process"
        " (submits included); a peer's, its enqueuing script and its worker CLI's processes"
        " over enqueue + drain; server: PostgreSQL's processes (Redis for Dramatiq)"
    )
    lines.append(f"Oban for Python: {body['oban']}")
    return lines


def _us(median: dict[str, Any], key: str, both: str | None, part: str) -> str:
    """A row's CPU per job (``part``: ``cpu_us`` or ``server_cpu_us``): its own figure's,
    or its enqueue + drain figure's (a peer measures it there)."""
    for name in (f"{key}_{part}", f"{both}_{part}"):
        if median.get(name) is not None:
            return f"{median[name]:,.0f}"
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=3000, help="SQLite and Dramatiq")
    parser.add_argument("--pg-tasks", type=int, default=1500, help="PostgreSQL, all systems")
    parser.add_argument("--workers", type=int, default=1, help="kiln worker processes on PG")
    parser.add_argument("--pg-slots", type=int, default=64, help="slots per kiln worker on PG")
    parser.add_argument("--rate", type=float, default=500.0, help="pickup: offered tasks/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="pickup: how long")
    parser.add_argument(
        "--baseline-src",
        default=None,
        metavar="DIR",
        help="another checkout of kiln (git worktree add DIR REV): its SQLite FULL figure,"
        " one process as it runs it, in every round beside this tree's",
    )
    parser.add_argument(
        "--enqueue-batch",
        type=int,
        default=500,
        help="jobs per enqueue call: PgQueuer's, and kiln's batched PostgreSQL figures",
    )
    parser.add_argument(
        "--postgres-only",
        action="store_true",
        help="only kiln on PostgreSQL, Procrastinate and PgQueuer (no SQLite, no Dramatiq,"
        " no kiln pickup; the peers' scripts still measure theirs)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 round, 300 tasks (200 on PG), 2 s of pickup",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tasks, args.pg_tasks, args.seconds = 1, 300, 200, 2.0
    print(f"enqueue batch: {args.enqueue_batch} jobs per call", flush=True)
    peers = peers_python()
    rounds: list[dict[str, Any]] = []
    with redis() as redis_env, throwaway_cluster() as cluster:
        for n in range(args.rounds):
            rounds.append(one_round(args, peers, redis_env, cluster))
            shown = (f"{k} {v:,.1f}" for k, v in rounds[-1].items())
            print(f"round {n + 1}: " + ", ".join(shown), flush=True)
    body = summary(rounds, peers)
    body["rate"], body["pickup_seconds"] = args.rate, args.seconds
    body["enqueue_batch"] = args.enqueue_batch
    print("\n".join(table(body)))
    print(json.dumps(body))


if __name__ == "__main__":
    main()
