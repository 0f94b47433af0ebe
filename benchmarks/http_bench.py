"""kiln's HTTP hot path beside a bare FastAPI app on the same uvicorn settings, same run.

``kiln serve`` runs as a real process on 127.0.0.1 (a free port, a temporary SQLite data
dir, ``--no-workers``, its supervisor on, auth on with one key); the reference is
``http_bare.py``, a FastAPI app answering constant JSON on ``kiln serve``'s uvicorn
settings (the access log off on both, as ``kiln serve`` has it by default;
``--access-log`` turns it on on both). wrk (Debian's, installed when missing) drives each
route for ``--seconds`` on ``--connections`` connections, kiln and the reference in turn,
for ``--rounds`` interleaved rounds (the first of each pair alternates); figures and
ratios are medians over the rounds (a ratio is taken within its round):

- ``healthz``: ``GET /healthz``, against the reference's ``GET /healthz``;
- ``get``: ``GET /v1/tasks/{id}`` of a PENDING task, against a constant task;
- ``post_new``: ``POST /v1/tasks`` with a new prompt on every request (a new task each),
  against the reference's ``POST /v1/tasks``;
- ``post_dedup``: the same body on every request (content-dedup hits), against the same.

Each round also reads how many tasks are queued and the server's CPU per request of each
figure, so the rounds show whether a figure drifts as the queue grows (each ``post_new``
run adds thousands of tasks to it). After the rounds, ``--backlog`` tasks (100,000 by
default) are seeded straight through the store (the same SQLite file, group commits of
500 submissions) and one more round runs at that backlog: a new task's CPU there beside
the first round's shows whether a submission costs the same at any backlog.

Then, on the same server, ``--burst`` identical submissions at once (exactly one task must
come back); and on a second ``kiln serve`` with in-process workers, ``--subscribers``
tenant feeds while tasks run (``http_clients.py`` says what each latency measures).
The server's CPU per request comes from ``/proc``: its process and those it started
(kiln's submit process) together. The last stdout line is one JSON
object with every figure and ratio.

The file is not named ``http.py``: in this folder, first on ``sys.path`` of every script
run from it, that name would hide the standard library's ``http`` from them all.

    make bench-http
    .venv/bin/python benchmarks/http_bench.py --rounds 3 --seconds 8
    .venv/bin/python benchmarks/http_bench.py --rounds 1 --seconds 2 --subscribers 100 --burst 100
    .venv/bin/python benchmarks/http_bench.py --rounds 3 --seconds 5 --backlog 0   # no seeding
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from http_clients import burst, sse_fanout
from pg_cluster import server_cpu_s

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEY = "key-bench-0123456789"
FIGURES = ("healthz", "get", "post_new", "post_dedup")
AIMS = {"post_new": 0.4, "post_dedup": 0.6, "get": 0.7}


def wrk_binary() -> str:
    """Debian's wrk, installed when missing (as root)."""
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0:
        sys.exit("wrk is missing: sudo apt-get install -y wrk")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "wrk"],
                   check=True, env=env)  # fmt: skip
    return shutil.which("wrk") or "/usr/bin/wrk"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# The servers ----------------------------------------------------------------------------


@dataclass
class Server:
    """A server process on 127.0.0.1 (kiln serve or the reference), stopped by its PID."""

    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def wait_healthy(self, timeout_s: float = 60.0) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                sys.exit(f"{self.name} exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        sys.exit(f"{self.name} did not answer /healthz within {timeout_s:g} s")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            self.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)


@contextmanager
def started(name: str, command: list[str], env: dict[str, str], root: Path) -> Iterator[Server]:
    port = free_port()
    log = root / f"{name}.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen([*command, "--port", str(port)], stdout=handle,
                                 stderr=subprocess.STDOUT, env=env, cwd=root)  # fmt: skip
    server = Server(name, f"http://127.0.0.1:{port}", popen, log)
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def kiln_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return {**env, "KILN_API_KEYS": f"bench:{KEY}", **extra}


def kiln_serve(root: Path, name: str, *flags: str, **env: str) -> Any:
    command = [sys.executable, "-m", "kiln", "serve", "--host", "127.0.0.1",
               "--data-dir", str(root / name), *flags]  # fmt: skip
    return started(name, command, kiln_env(**env), root)


def bare_serve(root: Path, access_log: bool) -> Any:
    command = [sys.executable, str(HERE / "http_bare.py"), *(["--access-log"] * access_log)]
    return started("bare", command, kiln_env(), root)


# wrk ------------------------------------------------------------------------------------

DONE = """
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"status":%d,"timeout":%d,"p50_us":%d,"p99_us":%d}\\n', summary.requests,
    summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""

SCRIPTS = {
    "get": 'wrk.headers["Authorization"] = "Bearer {key}"\n',
    "post_new": """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
local made = 0
function setup(thread)
  made = made + 1
  thread:set("thread_no", made)
end
local n = 0
function request()
  n = n + 1
  local body = '{{"kind":"image.generate","params":{{"prompt":"a fox {tag} ' .. thread_no ..
    '-' .. n .. '"}}}}'
  return wrk.format(nil, nil, nil, body)
end
""",
    "post_dedup": """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
wrk.body = '{{"kind":"image.generate","params":{{"prompt":"a fox, deduplicated {tag}"}}}}'
""",
}
SCRIPTS["healthz"] = SCRIPTS["get"]


@dataclass
class Run:
    """One wrk run against one server."""

    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float
    cpu_us: float  # the server's CPU per request

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds


def wrk(args: argparse.Namespace, server: Server, figure: str, path: str, tag: str) -> Run:
    script = args.workdir / f"{figure}-{tag}.lua"
    script.write_text(SCRIPTS[figure].format(key=KEY, tag=tag) + DONE)
    command = [args.wrk, "-t", str(args.threads), "-c", str(args.connections),
               "-d", f"{args.seconds}s", "--timeout", "10s", "-s", str(script),
               f"{server.url}{path}"]  # fmt: skip
    # The server and the processes it started (kiln's submit process).
    before = server_cpu_s(server.popen.pid) or 0.0
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    used = (server_cpu_s(server.popen.pid) or 0.0) - before
    found = json.loads(done.stdout.strip().splitlines()[-1])
    errors = sum(found[k] for k in ("connect", "read", "write", "status", "timeout"))
    return Run(
        requests=found["requests"],
        seconds=found["duration_us"] / 1e6,
        errors=errors,
        p50_ms=found["p50_us"] / 1000,
        p99_ms=found["p99_us"] / 1000,
        cpu_us=used / max(found["requests"], 1) * 1e6,
    )


def submit_one(server: Server, prompt: str) -> str:
    body = {"kind": "image.generate", "params": {"prompt": prompt}}
    answer = httpx.post(f"{server.url}/v1/tasks", json=body,
                        headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    answer.raise_for_status()
    task_id: str = answer.json()["id"]
    return task_id


def task_counts(server: Server) -> dict[str, int]:
    answer = httpx.get(f"{server.url}/v1/stats", headers={"Authorization": f"Bearer {KEY}"})
    counts: dict[str, int] = answer.json()["counts"]
    return counts


def task_count(server: Server) -> int:
    return sum(task_counts(server).values())


def queued(server: Server) -> int:
    counts = task_counts(server)
    return counts.get("PENDING", 0) + counts.get("RETRYING", 0)


async def seed(database: Path, count: int) -> float:
    """``count`` queued tasks of the benchmark's kind and tenant written straight through
    the store (kiln serve reads the same SQLite file), 500 a group commit; the seconds it
    took. Their deadline is a week away, so they stay queued and due."""
    from kiln import canonical
    from kiln.models import NewTask, Timeouts
    from kiln.store import open_store

    store = open_store(f"sqlite:///{database}", synchronous="NORMAL")
    started = time.perf_counter()
    try:
        for done in range(0, count, 500):
            news = [
                NewTask(
                    id=canonical.new_task_id(),
                    tenant="bench",
                    kind="image.generate",
                    params={"prompt": f"seeded {done + i}"},
                    fingerprint=f"seeded-{done + i}",
                    idempotency_key=None,
                    dedup_key=None,
                    priority=0,
                    max_attempts=3,
                    deadline_s=7 * 86400.0,
                    timeouts=Timeouts(),
                )
                for i in range(min(500, count - done))
            ]
            await asyncio.gather(*(store.submit(new) for new in news))
    finally:
        await store.close()
    return time.perf_counter() - started


def one_round(
    args: argparse.Namespace, n: int, kiln: Server, bare: Server, task_id: str
) -> dict[str, Any]:
    """Each figure: kiln and the reference in turn (which goes first alternates)."""
    paths = {"healthz": "/healthz", "get": f"/v1/tasks/{task_id}", "post_new": "/v1/tasks",
             "post_dedup": "/v1/tasks"}  # fmt: skip
    figures: dict[str, Any] = {"queued": queued(kiln)}
    for figure in FIGURES:
        pair = (kiln, bare) if n % 2 == 0 else (bare, kiln)
        runs: dict[str, Run] = {}
        tasks_before = task_count(kiln)
        for server in pair:
            runs[server.name] = wrk(args, server, figure, paths[figure], f"r{n}-{server.name}")
        made = task_count(kiln) - tasks_before
        k, b = runs["kiln"], runs["bare"]
        figures[figure] = {
            "kiln": k.per_s, "bare": b.per_s, "ratio": k.per_s / b.per_s,
            "kiln_cpu_us": k.cpu_us, "bare_cpu_us": b.cpu_us, "kiln_p99_ms": k.p99_ms,
            "bare_p99_ms": b.p99_ms, "errors": k.errors + b.errors, "tasks_made": made,
        }  # fmt: skip
        print(f"round {n + 1} {figure:<10} queued {figures['queued']:7,}  "
              f"kiln {k.per_s:7,.0f}/s ({k.cpu_us:5,.0f} µs CPU, "
              f"p99 {k.p99_ms:6.1f} ms)  bare {b.per_s:7,.0f}/s ({b.cpu_us:5,.0f} µs CPU)  "
              f"ratio {k.per_s / b.per_s:.2f}  errors {k.errors + b.errors}  tasks made {made}",
              flush=True)  # fmt: skip
    return figures


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for figure in FIGURES:
        for key in ("kiln", "bare", "ratio", "kiln_cpu_us", "bare_cpu_us"):
            value = statistics.median(r[figure][key] for r in rounds)
            out[f"{figure}_{key}"] = round(value, 3 if key == "ratio" else 1)
        out[f"{figure}_errors"] = sum(r[figure]["errors"] for r in rounds)
    out["post_new_tasks_made"] = sum(r["post_new"]["tasks_made"] for r in rounds)
    out["post_dedup_tasks_made"] = sum(r["post_dedup"]["tasks_made"] for r in rounds)
    out["rounds"] = [by_round(r) for r in rounds]
    first, last = rounds[0]["post_new"]["kiln_cpu_us"], rounds[-1]["post_new"]["kiln_cpu_us"]
    out["post_new_cpu_last_over_first"] = round(last / first, 3)
    return out


def by_round(found: dict[str, Any]) -> dict[str, Any]:
    """One round's queue, and each figure's server CPU per request and ratio."""
    out: dict[str, Any] = {"queued": found["queued"]}
    for figure in FIGURES:
        out[f"{figure}_kiln_cpu_us"] = round(found[figure]["kiln_cpu_us"], 1)
        out[f"{figure}_bare_cpu_us"] = round(found[figure]["bare_cpu_us"], 1)
        out[f"{figure}_ratio"] = round(found[figure]["ratio"], 3)
    return out


def backlog_round(
    args: argparse.Namespace, kiln: Server, bare: Server, task_id: str, first: dict[str, Any]
) -> dict[str, Any]:
    """Seed the store up to ``--backlog`` queued tasks, then one more round there."""
    adding = args.backlog - queued(kiln)
    seconds = asyncio.run(seed(args.workdir / "kiln" / "kiln.db", adding)) if adding > 0 else 0.0
    print(f"seeded {max(adding, 0):,} queued tasks in {seconds:.1f} s", flush=True)
    found = one_round(args, args.rounds, kiln, bare, task_id)
    out = {f"backlog_{k}": v for k, v in by_round(found).items()}
    out["backlog_seeded_s"] = round(seconds, 1)
    for figure in FIGURES:
        ratio = found[figure]["kiln_cpu_us"] / first[figure]["kiln_cpu_us"]
        out[f"backlog_{figure}_cpu_over_first_round"] = round(ratio, 3)
    return out


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + ("+dirty" if dirty else ""),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=8, help="each wrk run")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--burst", type=int, default=1000, help="identical submissions at once")
    parser.add_argument("--subscribers", type=int, default=1000, help="SSE tenant feeds")
    parser.add_argument("--sse-tasks-per-s", type=float, default=2.0)
    parser.add_argument("--sse-seconds", type=float, default=10.0)
    parser.add_argument("--sse-steps", type=int, default=4, help="demo steps per task")
    parser.add_argument("--sse-step-ms", type=int, default=50)
    parser.add_argument(
        "--backlog",
        type=int,
        default=100_000,
        help="queued tasks of the last round (0: no such round)",
    )
    parser.add_argument("--skip-wrk", action="store_true", help="only the burst and streams")
    parser.add_argument(
        "--access-log", action="store_true", help="uvicorn's access log on, kiln's and the bare"
    )
    return parser.parse_args()


def main() -> None:
    args = parse()
    args.wrk = wrk_binary()
    report: dict[str, Any] = {**machine(), "access_log": args.access_log}
    print(f"kiln HTTP benchmark: {report}", flush=True)
    connections = str(max(args.burst, args.subscribers) + args.connections + 100)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-http-") as tmp:
        root = args.workdir = Path(tmp)
        serving = {"KILN_MAX_CONNECTIONS": connections}
        if args.access_log:
            serving["KILN_ACCESS_LOG"] = "1"
        with kiln_serve(root, "kiln", "--no-workers", **serving) as kiln:
            if not args.skip_wrk:
                with bare_serve(root, args.access_log) as bare:
                    task_id = submit_one(kiln, "a fox to read back")
                    rounds = [one_round(args, n, kiln, bare, task_id)
                              for n in range(args.rounds)]  # fmt: skip
                    report.update(medians(rounds))
                    if args.backlog > 0:
                        report.update(backlog_round(args, kiln, bare, task_id, rounds[0]))
            found = asyncio.run(burst(kiln.url, KEY, args.burst, f"a burst {time.time()}"))
            print(f"burst: {found}", flush=True)
            report.update({f"burst_{k}": v for k, v in found.items()})
        with kiln_serve(root, "kiln-sse", "--workers", "4", KILN_MAX_CONNECTIONS=connections,
                        KILN_LOG_LEVEL="WARNING") as streaming:  # fmt: skip
            found = asyncio.run(sse_fanout(
                streaming.url, KEY, args.subscribers, args.sse_tasks_per_s, args.sse_seconds,
                args.sse_steps, args.sse_step_ms,
            ))  # fmt: skip
            print(f"sse: {found}", flush=True)
            report.update({f"sse_{k}": v for k, v in found.items()})
    report["load_1m_end"] = round(os.getloadavg()[0], 2)
    report["aims"] = {f"{k}_ratio": v for k, v in AIMS.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
