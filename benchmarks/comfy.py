"""The Comfy API v2 in front of ComfyUI: `comfy-api-proxy` beside kiln, in the same run.

- **proxy**: `comfy-api-proxy` 0.1.6 (its own venv, ``.comfy-proxy-venv``, made and filled
  here, never in kiln's dependencies) with ``--token`` and ``--state-dir`` (its durable
  job and idempotency records) in front of ONE stand-in ComfyUI;
- **kiln**: `kiln serve --no-workers` (SQLite, an API key) and two
  `kiln worker --kinds comfy.workflow`, each in front of its own stand-in: TWO instances.

Every stand-in (``tests/services/comfyui_standin.py``) has the same per-step cost
(``--step-s``) and checkpoint load (``--load-s``). The client is the official
``comfy-sdk`` (``AsyncComfy``: ``submit`` and ``AsyncJob.refresh``), the same code for
both; each job is the same text-to-image graph with its own seed. Per round and system:

- **throughput**: ``--jobs`` jobs submitted at once; jobs/s from the first submit to the
  last ``succeeded``; p50/p99 of each job's submit-to-``succeeded`` (polled every
  ``--poll-s``);
- **API process killed**: ``--queued`` jobs submitted, the proxy (or `kiln serve`) SIGKILLed
  at once and started again on the same port and state; then every job is polled until
  final or ``--settle-s``: ``completed`` (succeeded) and ``lost`` (anything else: 404,
  ``expired``, ``failed``, still not final);
- **instance killed**: the same, with the ComfyUI instance SIGKILLed instead (for kiln, the
  one of the two instances whose worker runs a job) and restarted on its port.

Rounds are interleaved (each runs both systems, the order alternating); figures are the
medians over the rounds. Loopback only; every process is stopped at the end.

    .venv/bin/python benchmarks/comfy.py --rounds 3 --jobs 40 --queued 20

The last line is one JSON object (``median`` per system, ``rounds``, the settings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from comfy_sdk import AsyncComfy  # noqa: E402
from comfy_sdk.exceptions import ComfyError, NotFound  # noqa: E402
from tests.services.comfyui_nodes import txt2img  # noqa: E402

VENV = ROOT / ".comfy-proxy-venv"
PROXY = ("comfy-api-proxy==0.1.6",)
TOKEN = "bench-token-0123456789"
KILN_KEY = "key-bench-0123456789"
FINAL = {"succeeded", "failed", "canceled", "expired"}


def proxy_bin() -> Path:
    """The proxy's venv, made and filled once (a stamp names what it holds)."""
    python, stamp = VENV / "bin" / "python", VENV / ".installed"
    if not (stamp.exists() and stamp.read_text() == "\n".join(PROXY)):
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PROXY],
            check=True,
        )
        stamp.write_text("\n".join(PROXY))
    return VENV / "bin" / "comfy-api-proxy"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer in {timeout_s} s")


@dataclass
class Service:
    """A process with a fixed port, restartable on the same port after a SIGKILL."""

    name: str
    command: list[str]
    env: dict[str, str]
    health: str
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        with (self.log_dir / f"{self.name}-{self.starts}.log").open("wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )
        wait_http(self.health, self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "COMFY_"))}
    return {**env, **extra}


def standin(args: argparse.Namespace, root: Path, n: int) -> Service:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tests.services.comfyui_standin",
        "--port",
        str(port),
        "--root",
        str(root / f"comfy-{n}"),
        "--step-s",
        str(args.step_s),
        "--load-s",
        str(args.load_s),
    ]
    return Service(
        f"comfy-{n}", command, clean_env(), f"http://127.0.0.1:{port}/system_stats", root
    )


@dataclass
class System:
    """One side of the comparison: its API service, its instances, its other processes."""

    name: str
    api: Service
    base_url: str
    key: str
    instances: list[Service]
    others: list[Service] = field(default_factory=list)

    def start(self) -> None:
        for service in [*self.instances, self.api, *self.others]:
            service.start()

    def stop(self) -> None:
        for service in [*self.others, self.api, *self.instances]:
            service.stop()


def proxy_system(args: argparse.Namespace, root: Path) -> System:
    comfy = standin(args, root, 0)
    port = free_port()
    command = [
        str(proxy_bin()),
        "run",
        "--comfyui",
        comfy.health.removesuffix("/system_stats"),
        "--port",
        str(port),
        "--token",
        TOKEN,
        "--state-dir",
        str(root / "proxy-state"),
    ]
    base = f"http://127.0.0.1:{port}"
    api = Service("proxy", command, clean_env(), f"{base}/api/v2/health", root)
    return System("proxy", api, base, TOKEN, [comfy])


def kiln_system(args: argparse.Namespace, root: Path) -> System:
    instances = [standin(args, root, n) for n in range(2)]
    port = free_port()
    data = str(root / "kiln-data")
    env = clean_env(
        KILN_API_KEYS=f"bench:{KILN_KEY}",
        KILN_LOG_LEVEL="WARNING",
        KILN_SUPERVISOR_INTERVAL_S="0.5",
    )
    kiln = [sys.executable, "-m", "kiln"]
    base = f"http://127.0.0.1:{port}"
    api = Service(
        "serve",
        [*kiln, "serve", "--no-workers", "--port", str(port), "--data-dir", data],
        env,
        f"{base}/api/v2/health",
        root,
    )
    workers = [
        Service(
            f"worker-{n}",
            [*kiln, "worker", "--data-dir", data, "--kinds", "comfy.workflow"],
            {**env, "KILN_COMFYUI_URL": i.health.removesuffix("/system_stats")},
            f"{base}/api/v2/health",
            root,
        )
        for n, i in enumerate(instances)
    ]
    return System("kiln", api, base, KILN_KEY, instances, workers)


# The client ---------------------------------------------------------------------------------


def workflow(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return txt2img(seed=seed, steps=args.steps, size=64, prefix=f"bench-{seed}")


async def submit_all(
    comfy: AsyncComfy, args: argparse.Namespace, seeds: range
) -> list[tuple[Any, float]]:
    async def one(seed: int) -> tuple[Any, float]:
        started = time.monotonic()
        job = await comfy.submit(comfy.workflows.from_json(workflow(args, seed)))
        return job, started

    return list(await asyncio.gather(*(one(seed) for seed in seeds)))


async def poll(comfy: AsyncComfy, job_id: str, poll_s: float, deadline: float) -> tuple[str, float]:
    """The job's final status (or the last one seen: ``not_found``, ``unreachable``) and
    when it was seen."""
    status = "unknown"
    while time.monotonic() < deadline:
        try:
            status = (await comfy.jobs.get(job_id)).status
        except NotFound:
            status = "not_found"
        except (ComfyError, httpx.HTTPError):
            status = "unreachable"
        if status in FINAL:
            break
        await asyncio.sleep(poll_s)
    return status, time.monotonic()


def client(system: System) -> AsyncComfy:
    os.environ["COMFY_BASE_URL"] = system.base_url  # the client reads it at construction
    return AsyncComfy(api_key=system.key, timeout=30)


def percentile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(share * len(ordered)))], 3) if values else None


async def throughput(system: System, args: argparse.Namespace, seed0: int) -> dict[str, Any]:
    async with client(system) as comfy:
        first = time.monotonic()
        jobs = await submit_all(comfy, args, range(seed0, seed0 + args.jobs))
        deadline = time.monotonic() + args.settle_s
        ends = await asyncio.gather(
            *(poll(comfy, job.id, args.poll_s, deadline) for job, _ in jobs)
        )
    ok = [
        end - start
        for (_, start), (status, end) in zip(jobs, ends, strict=True)
        if status == "succeeded"
    ]
    return {
        "succeeded": len(ok),
        "jobs_per_s": round(len(ok) / (max(end for _, end in ends) - first), 3),
        "p50_s": percentile(ok, 0.5),
        "p99_s": percentile(ok, 0.99),
    }


async def after_kill(
    system: System, args: argparse.Namespace, seed0: int, kill: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    """Submit ``--queued`` jobs, run ``kill`` (a SIGKILL and a restart), count what ends."""
    async with client(system) as comfy:
        jobs = await submit_all(comfy, args, range(seed0, seed0 + args.queued))
    await kill()
    async with client(system) as comfy:  # a new connection to the restarted process
        deadline = time.monotonic() + args.settle_s
        ends = await asyncio.gather(
            *(poll(comfy, job.id, args.poll_s, deadline) for job, _ in jobs)
        )
    statuses = [status for status, _ in ends]
    done = statuses.count("succeeded")
    return {
        "completed": done,
        "lost": len(statuses) - done,
        "lost_as": sorted({s for s in statuses if s != "succeeded"}),
    }


async def kill_api(system: System) -> None:
    system.api.kill()
    system.api.start()


async def kill_instance(system: System) -> None:
    """SIGKILL the instance running a job (the proxy's only one), restart it on its port."""
    victim = system.instances[0]
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient() as http:
        while len(system.instances) > 1 and time.monotonic() < deadline:
            running = [
                i
                for i in system.instances
                if (await http.get(i.health.removesuffix("/system_stats") + "/queue"))
                .json()
                .get("queue_running")
            ]
            if running:
                victim = running[0]
                break
            await asyncio.sleep(0.02)
    victim.kill()
    await asyncio.sleep(0.5)
    victim.start()


# The run ------------------------------------------------------------------------------------


async def one_system(
    make: Callable[[argparse.Namespace, Path], System], args: argparse.Namespace, n: int
) -> dict[str, Any]:
    """Throughput, then an API kill, then an instance kill, each on fresh processes."""
    figures: dict[str, Any] = {}
    phases: list[tuple[str, Callable[[System], Awaitable[dict[str, Any]]]]] = [
        ("throughput", lambda s: throughput(s, args, 1000 * n)),
        ("api_kill", lambda s: after_kill(s, args, 1000 * n + 200, lambda: kill_api(s))),
        ("instance_kill", lambda s: after_kill(s, args, 1000 * n + 400, lambda: kill_instance(s))),
    ]
    for phase, measure in phases:
        root = Path(tempfile.mkdtemp(prefix=f"kiln-comfy-{phase}-", dir=args.dir))
        system = make(args, root)
        try:
            system.start()
            found = await measure(system)
        finally:
            system.stop()
            shutil.rmtree(root, ignore_errors=True)
        figures.update({f"{phase}_{k}": v for k, v in found.items()})
    return figures


def median_of(rounds: list[dict[str, dict[str, Any]]], name: str) -> dict[str, Any]:
    keys = [k for k, v in rounds[0][name].items() if isinstance(v, int | float)]
    found: dict[str, Any] = {}
    for key in keys:
        values = [r[name][key] for r in rounds if r[name][key] is not None]
        found[key] = round(statistics.median(values), 3) if values else None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--rounds", type=int, default=3)
    add("--jobs", type=int, default=40, help="jobs of the throughput figure (40)")
    add("--queued", type=int, default=20, help="jobs queued when a process is killed (20)")
    add("--steps", type=int, default=10, help="KSampler steps of each job (10)")
    add("--step-s", type=float, default=0.1, help="a stand-in's cost per step (0.1)")
    add("--load-s", type=float, default=0.2, help="a stand-in's checkpoint load (0.2)")
    add("--poll-s", type=float, default=0.25, help="the client's poll period per job (0.25)")
    add("--settle-s", type=float, default=120, help="the most a phase waits for jobs (120)")
    add("--dir", type=Path, default=None, help="where the runs' folders go (a temp dir)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what it started
    makers = {"proxy": proxy_system, "kiln": kiln_system}
    rounds: list[dict[str, dict[str, Any]]] = []
    for n in range(args.rounds):
        order = ["proxy", "kiln"] if n % 2 == 0 else ["kiln", "proxy"]
        found = {name: asyncio.run(one_system(makers[name], args, n)) for name in order}
        rounds.append(found)
        for name in order:
            print(f"round {n + 1} {name}: " + json.dumps(found[name]), flush=True)
    median = {name: median_of(rounds, name) for name in makers}
    settings = {
        k: getattr(args, k)
        for k in ("jobs", "queued", "steps", "step_s", "load_s", "poll_s", "rounds")
    }
    print(
        json.dumps(
            {
                "median": median,
                "rounds": rounds,
                "settings": settings,
                "instances": {"proxy": 1, "kiln": 2},
                "proxy": PROXY[0],
                "client": "comfy-sdk AsyncComfy",
            }
        )
    )


if __name__ == "__main__":
    main()
