"""The chaos run's ComfyUI part: stand-in ComfyUI instances, each driven by its own
`kiln worker --kinds comfy.workflow`, that are SIGKILLed and restarted while
``comfy.workflow`` jobs run on them; and the checks of those jobs.

Each instance (``tests/services/comfyui_standin.py``) is a process with its own port and
folder; a killed one is started again on the same port and folder (its queue and history
are gone, as a real ComfyUI's are; the images it saved stay). Every instance makes each
``ImageScale`` node raise ``ValueError``: a job whose graph has one (a *failing* job) can
only fail, with ``node_execution_error``. Each job's SaveImage writes under a prefix of
its own, so the files in the instances' ``output/`` folders count how often each job's
graph ran to its end, across kills (the stand-ins' in-memory logs die with them).

Checks (besides DESIGN.md's, which see these tasks as every other):

- CF1: every comfy job is final; every failing job FAILED with ``node_execution_error``
  and its node; no other job FAILED with it;
- CF2: every SUCCESS comfy job has each of its SaveImage images as an output, in storage
  with the recorded size and sha256, the bytes an instance saved for that job;
- CF3: no job's graph ran to its end more often than the job was attempted, a failing
  job's never, a SUCCESS job's at least once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_checks import Check, Snapshot

import kiln
from kiln.backends import comfy_workflow
from kiln.models import StoredOutput
from kiln.states import FINAL, Status
from kiln.storage import Storage, verify

ROOT = Path(__file__).resolve().parents[1]
KIND = comfy_workflow.KIND
FAULT = {
    "raise": {
        "class_type": "ImageScale",
        "exception_type": "ValueError",
        "exception_message": "width must be positive",
    }
}
CKPT = "v1-5-pruned-emaonly.safetensors"
READY_S = 30.0


def graph(n: int, *, failing: bool, steps: int) -> dict[str, Any]:
    """ComfyUI's text-to-image graph, saving under ``chaos-c<n>``; a failing one scales
    the image (the node every instance makes raise) before saving it."""
    model, clip = ["4", 0], ["4", 1]
    nodes: dict[str, Any] = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
        "5": {
            "class_type": "EmptyLatentImage",
            "inputs": {"width": 32, "height": 32, "batch_size": 1},
        },
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": f"job {n}", "clip": clip}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": clip}},
        "3": {
            "class_type": "KSampler",
            "inputs": {
                "model": model,
                "seed": n,
                "steps": steps,
                "cfg": 7.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "positive": ["6", 0],
                "negative": ["7", 0],
                "latent_image": ["5", 0],
                "denoise": 1.0,
            },
        },
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {
            "class_type": "SaveImage",
            "inputs": {"filename_prefix": prefix(n), "images": ["8", 0]},
        },
    }
    if failing:
        nodes["10"] = {
            "class_type": "ImageScale",
            "inputs": {
                "image": ["8", 0],
                "upscale_method": "bilinear",
                "width": 16,
                "height": 16,
                "crop": "disabled",
            },
        }
        nodes["9"]["inputs"]["images"] = ["10", 0]
    return nodes


def prefix(n: int) -> str:
    return f"chaos-c{n}"


@dataclass
class Instance:
    """One stand-in ComfyUI on a fixed port, and the worker that drives it."""

    n: int
    port: int
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class ComfyFleet:
    """N instances and their workers; kills instances (and now and then a worker)."""

    run_dir: Path
    env: dict[str, str]
    count: int
    step_s: float
    instances: list[Instance] = field(default_factory=list)
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    instance_kills: int = 0
    worker_kills: int = 0
    exited_by_themselves: list[str] = field(default_factory=list)

    def _popen(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log_path = self.run_dir / "logs" / f"{name}-{len(self.started)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )
        self.started.append(process)
        return process

    def start(self) -> None:
        for n in range(self.count):
            instance = Instance(n, free_port(), self.run_dir / f"comfy-{n}")
            self.instances.append(instance)
            self.start_instance(instance)
        deadline = time.monotonic() + READY_S
        for instance in self.instances:
            wait_listening(instance, deadline)
            self.start_worker(instance)

    async def ready(self, app: kiln.App) -> None:
        """Wait until every worker has registered (its start-up, CPU-bound on a small
        machine, then lies behind the run, not in its first seconds)."""
        pids = {i.worker.pid for i in self.instances if i.worker is not None}
        deadline = time.monotonic() + READY_S
        while not pids <= {w.pid for w in await app.engine.store.workers.live()}:
            if time.monotonic() > deadline:
                raise RuntimeError("the comfy.workflow workers did not register")
            await asyncio.sleep(0.1)

    def start_instance(self, instance: Instance) -> None:
        instance.proc = self._popen(
            f"comfy-{instance.n}",
            [
                sys.executable,
                "-m",
                "tests.services.comfyui_standin",
                "--port",
                str(instance.port),
                "--root",
                str(instance.root),
                "--step-s",
                str(self.step_s),
                "--load-s",
                "0.05",
                "--faults",
                json.dumps(FAULT),
            ],
            {k: v for k, v in self.env.items() if not k.startswith("KILN_")},
        )

    def start_worker(self, instance: Instance) -> None:
        env = {
            **self.env,
            "KILN_COMFYUI_URL": instance.url,
            "KILN_BREAKER_OPEN_S": "1",
            "KILN_COMFYUI_TIMEOUT_S": "60",
        }
        env.pop("KILN_GENERATE_BATCH", None)
        instance.worker = self._popen(
            f"comfy-worker-{instance.n}",
            [sys.executable, "-m", "kiln", "worker", "--kinds", KIND],
            env,
        )

    async def chaos(
        self, rng: random.Random, done: asyncio.Event, every_s: tuple[float, float]
    ) -> None:
        """Every MIN..MAX seconds SIGKILL a random instance and start it again on its port
        after a moment (each fourth time, its worker instead, started again at once)."""
        while self.instances and await nap(done, rng.uniform(*every_s)):
            instance = rng.choice(self.instances)
            if (self.instance_kills + self.worker_kills) % 4 == 3:
                assert instance.worker is not None
                kill(instance.worker)
                self.worker_kills += 1
                self.start_worker(instance)
                continue
            assert instance.proc is not None
            kill(instance.proc)
            self.instance_kills += 1
            await nap(done, rng.uniform(0.2, 1.5))
            self.start_instance(instance)

    async def watch(self, done: asyncio.Event) -> None:
        """Note (and replace) a worker or instance that exited without being killed."""
        while not done.is_set():
            for instance in self.instances:
                for proc, restart in (
                    (instance.proc, self.start_instance),
                    (instance.worker, self.start_worker),
                ):
                    if proc is not None and proc.poll() is not None and proc.returncode >= 0:
                        self.exited_by_themselves.append(
                            f"pid {proc.pid} {proc.args[1:4]!r} {proc.returncode}"
                        )
                        restart(instance)
            await asyncio.sleep(0.1)

    def stop_all(self) -> None:
        live = [p for p in self.started if p.poll() is None]
        for process in live:
            process.terminate()
        for process in live:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_listening(instance: Instance, deadline: float) -> None:
    logs = sorted((instance.root.parent / "logs").glob(f"comfy-{instance.n}-*.log"))
    while time.monotonic() < deadline:
        if any("listening on" in p.read_text(errors="replace") for p in logs):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the ComfyUI stand-in {instance.n} did not start")


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL and reap (a killed process exits with a negative status: not 'by itself')."""
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


async def nap(done: asyncio.Event, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), seconds)
    return not done.is_set()


@dataclass
class ComfySubmitter:
    """Submits the comfy jobs through the run's App, spread over the run."""

    app: kiln.App
    rng: random.Random
    jobs: int
    failing_share: float
    steps: int
    #: task id -> (n, failing)
    made: dict[str, tuple[int, bool]] = field(default_factory=dict)
    finished: bool = False

    async def submit_all(
        self, done: asyncio.Event, every_s: float, progress: Callable[[], float]
    ) -> None:
        """Submit the jobs in step with the rest of the mix (``progress``: the share of it
        submitted so far, 0 to 1), at most one every ``every_s`` seconds, so that the
        instance kills meet running jobs over the whole run."""
        for n in range(self.jobs):
            while n >= self.jobs * progress() and await nap(done, every_s):
                pass
            if done.is_set():
                break
            # evenly spread: floor(jobs * share) failing jobs in all
            failing = int((n + 1) * self.failing_share) > int(n * self.failing_share)
            params = {"workflow": graph(n, failing=failing, steps=self.steps)}
            result = await self.app.submit(KIND, params, max_attempts=10, dedup=False)
            self.made[result.task.id] = (n, failing)
            await nap(done, every_s)
        self.finished = True

    @property
    def failing(self) -> set[str]:
        return {task_id for task_id, (_, failing) in self.made.items() if failing}


# Checks --------------------------------------------------------------------------------------


def saved_files(roots: list[Path], n: int) -> list[Path]:
    return [p for root in roots for p in (root / "output").glob(f"{prefix(n)}_*_.png")]


def check_final(snap: Snapshot, made: dict[str, tuple[int, bool]]) -> Check:
    check = Check("CF1", "comfy jobs final; failing nodes FAILED node_execution_error", len(made))
    for task_id, (_, failing) in made.items():
        task = snap.tasks.get(task_id)
        code = ((task.error or {}).get("code") if task else None) or ""
        if task is None or task.status not in FINAL:
            check.fail(f"{task_id}: {task.status if task else 'missing'}, not final")
        elif failing and (task.status is not Status.FAILED or code != "node_execution_error"):
            check.fail(f"{task_id}: a failing node, but {task.status} {code}")
        elif failing and (task.error or {}).get("details", [{}])[0].get("node_id") != "10":
            check.fail(f"{task_id}: node_execution_error without its node 10")
        elif not failing and code == "node_execution_error":
            check.fail(f"{task_id}: no failing node, but node_execution_error")
    return check


async def check_outputs(
    snap: Snapshot, storage: Storage, made: dict[str, tuple[int, bool]], roots: list[Path]
) -> Check:
    check = Check("CF2", "comfy SUCCESS: every SaveImage output stored, right sha256")
    for task_id, (n, _) in made.items():
        task = snap.tasks.get(task_id)
        if task is None or task.status is not Status.SUCCESS:
            continue
        check.checked += 1
        outputs = [StoredOutput.from_json(o) for o in (task.result or {}).get("outputs", [])]
        saved = [o for o in outputs if o.name.startswith(f"9-{prefix(n)}_")]
        if len(saved) != 1 or len(outputs) != 1:
            check.fail(f"{task_id}: outputs {[o.name for o in outputs]}, not one of node 9")
            continue
        rendered = {hashlib.sha256(p.read_bytes()).hexdigest() for p in saved_files(roots, n)}
        if not await verify(storage, saved[0]):
            check.fail(f"{task_id}: {saved[0].key} missing or not as recorded")
        elif saved[0].sha256 not in rendered:
            check.fail(f"{task_id}: sha256 {saved[0].sha256[:12]} is no image saved for it")
    return check


def check_runs(snap: Snapshot, made: dict[str, tuple[int, bool]], roots: list[Path]) -> Check:
    check = Check("CF3", "no comfy job ran to its end more often than attempted", len(made))
    twice = 0
    for task_id, (n, failing) in made.items():
        task = snap.tasks.get(task_id)
        runs = len(saved_files(roots, n))
        twice += runs > 1
        if task is None:
            continue
        if failing and runs:
            check.fail(f"{task_id}: a failing job's graph ran to its end {runs} times")
        elif runs > task.attempt:
            check.fail(f"{task_id}: ran to its end {runs} times in {task.attempt} attempts")
        elif task.status is Status.SUCCESS and not runs:
            check.fail(f"{task_id}: SUCCESS, but no instance saved its image")
    check.note = f"{twice} jobs ran to the end on two instances (a kill between the two)"
    return check


async def check_comfy(
    snap: Snapshot, storage: Storage, submitter: ComfySubmitter, fleet: ComfyFleet
) -> list[Check]:
    roots = [instance.root for instance in fleet.instances]
    return [
        check_final(snap, submitter.made),
        await check_outputs(snap, storage, submitter.made, roots),
        check_runs(snap, submitter.made, roots),
    ]


def figures(snap: Snapshot, submitter: ComfySubmitter, fleet: ComfyFleet) -> dict[str, Any]:
    outcomes: dict[str, int] = {}
    for task_id in submitter.made:
        task = snap.tasks.get(task_id)
        status = str(task.status) if task else "missing"
        outcomes[status] = outcomes.get(status, 0) + 1
    return {
        "comfy_jobs": len(submitter.made),
        "comfy_failing": len(submitter.failing),
        "comfy_outcomes": dict(sorted(outcomes.items())),
        "comfy_instances": fleet.count,
        "comfy_instance_kills": fleet.instance_kills,
        "comfy_worker_kills": fleet.worker_kills,
        "comfy_attempts": sum(snap.tasks[t].attempt for t in submitter.made if t in snap.tasks),
        "comfy_exited_by_themselves": fleet.exited_by_themselves,
    }
