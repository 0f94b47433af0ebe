"""GPU scheduling: model loads with and without warm-model routing, and batch throughput.

1. **Routing.** Two `kiln worker` processes (demo backend, each able to hold one model:
   `KILN_MODEL_MEMORY_GB=2`, a simulated load of `--load-s`) run `--tasks` tasks that
   alternate between two models, once with warm-model routing (`KILN_AFFINITY_WAIT_S=5`)
   and once without (`0`), on a temporary SQLite file. It counts the model loads (the
   workers' `model_loaded` log lines) and the wall time; rounds interleave. With torch and
   diffusers installed, the same again on the diffusers backend with two tiny random
   pipelines (sibling folders `a` and `b`, each worker's memory budget holding one).
2. **Batching** (when torch and diffusers are installed, `make test-diffusers` installs
   them): the tiny random diffusers pipeline of the tests on the CPU, pictures per second
   at batch 1, 4 and 8 (`benchmarks/diffusers_batch.py`). With `--gpu` (a CUDA machine),
   the same at 512×512, 20 steps, on Stable Diffusion 1.5's architecture at full size with
   random weights, in half precision, with the peak GPU memory of each batch size.

The last line is one JSON object with every figure.

    .venv/bin/python benchmarks/gpu.py --tasks 100 --rounds 3
    .venv/bin/python benchmarks/gpu.py --tasks 100 --rounds 3 --gpu   # on a GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import kiln
from kiln import backends
from kiln.states import Status

ROOT = Path(__file__).resolve().parents[1]


async def routing_round(
    tasks: int, load_s: float, wait_s: float, order: str, models: Path | None = None
) -> dict[str, Any]:
    """One run of ``tasks`` tasks of models a and b on two fresh worker processes: the
    demo backend's simulated loads, or the diffusers backend on the tiny pipelines saved
    in ``models`` (``a`` and ``b``)."""
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-") as tmp:
        root = Path(tmp)
        database, storage = f"sqlite:///{root / 'kiln.db'}", (root / "results").as_uri()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        own: dict[str, str] = {"KILN_DEMO_MODEL_LOAD_S": str(load_s), "KILN_MODEL_MEMORY_GB": "2"}
        if models is not None:
            from kiln.backends.diffusers import weights_gb

            own = {"KILN_BACKEND": "diffusers", "KILN_DIFFUSERS_MODEL_DIR": str(models / "a"),
                   "KILN_DIFFUSERS_DEVICE": "cpu", "KILN_DIFFUSERS_PREVIEW_EVERY_STEPS": "0",
                   "KILN_MODEL_MEMORY_GB": f"{weights_gb(models / 'a') * 1.5:.9f}",
                   "HF_HUB_OFFLINE": "1"}  # fmt: skip
        env.update(KILN_DATABASE_URL=database, KILN_STORAGE_URL=storage,
                   KILN_AFFINITY_WAIT_S=str(wait_s), KILN_LOG_FORMAT="json", **own)  # fmt: skip
        settings = kiln.Settings(data_dir=root, database_url=database, storage_url=storage)
        if models is not None:  # the submitter names the models as the workers do
            settings = settings.with_(backend="diffusers", diffusers_model_dir=models / "a")
        app = kiln.App(settings=settings)
        backends.register(app)
        rng = random.Random(11)
        models = ["ab"[i % 2] if order == "alternating" else rng.choice("ab")
                  for i in range(tasks)]  # fmt: skip
        procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        async with app:
            ids = []
            for model in models:
                params = {"prompt": f"a kiln {uuid.uuid4().hex[:8]}", "width": 64,
                          "height": 64, "steps": 4, "simulate": {"step_ms": 20},
                          "model": model}  # fmt: skip
                ids.append((await app.submit("image.generate", params)).task.id)
            started = time.perf_counter()
            for n in range(2):
                log = root / f"worker-{n}.log"
                with log.open("wb") as out:
                    cmd = [sys.executable, "-m", "kiln", "worker", "--concurrency", "1"]
                    procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                   env=env, cwd=root), log))  # fmt: skip
            try:
                for task_id in ids:
                    while (await app.get(task_id)).status is not Status.SUCCESS:
                        await asyncio.sleep(0.05)
                wall = time.perf_counter() - started
            finally:
                for proc, _ in procs:
                    os.kill(proc.pid, signal.SIGTERM)
                for proc, _ in procs:
                    proc.wait(timeout=30)
        loads = sum(log.read_text().count('"model_loaded"') for _, log in procs)
    return {"loads": loads, "wall_s": round(wall, 2)}


def routing(
    tasks: int, rounds: int, load_s: float, order: str, models: Path | None = None
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"routed": [], "plain": []}
    for n in range(rounds):
        for name, wait_s in (("routed", 5.0), ("plain", 0.0))[:: 1 if n % 2 == 0 else -1]:
            run = asyncio.run(routing_round(tasks, load_s, wait_s, order, models))
            print(f"round {n + 1} {name:6} {order}: {run['loads']} loads in {run['wall_s']} s",
                  flush=True)  # fmt: skip
            runs[name].append(run)
    return {
        name: {"loads_median": statistics.median(r["loads"] for r in found),
               "wall_s_median": statistics.median(r["wall_s"] for r in found), "runs": found}
        for name, found in runs.items()
    }  # fmt: skip


def tiny_routing(tasks: int, rounds: int) -> dict[str, Any] | str:
    """Routing on the diffusers backend: two tiny random pipelines, one held at a time."""
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return "skipped: torch and diffusers are not installed (make test-diffusers)"
    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from tiny_diffusers import save_tiny_pipeline

    with tempfile.TemporaryDirectory(prefix="kiln-tiny-models-") as tmp:
        models = Path(tmp)
        save_tiny_pipeline(models / "a", seed=0)
        save_tiny_pipeline(models / "b", seed=1)
        return routing(tasks, rounds, 0.0, "random", models)


def batching(pictures: int, rounds: int, *, gpu: bool = False) -> dict[str, Any] | str:
    """Pictures per second at batch 1, 4 and 8: the tiny pipeline on the CPU, or (``gpu``)
    SD 1.5's architecture with random weights at 512×512, 20 steps, on CUDA."""
    try:
        import diffusers  # noqa: F401
        import torch
    except ImportError:
        return "skipped: torch and diffusers are not installed (make test-diffusers)"
    if gpu and not torch.cuda.is_available():
        return "skipped: no CUDA device"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from diffusers_batch import peak_gpu_gib, tiny_throughput

    shape: dict[str, Any] = (
        {"architecture": "sd15", "device": "cuda", "side": 512, "steps": 20} if gpu else {}
    )
    found: dict[int, list[float]] = {1: [], 4: [], 8: []}
    memory: dict[int, float | None] = {}
    for n in range(rounds):
        for size in (1, 4, 8) if n % 2 == 0 else (8, 4, 1):
            rate = tiny_throughput(size, pictures, **shape)
            found[size].append(rate)
            memory[size] = peak_gpu_gib(shape.get("device", "cpu"))
            print(f"round {n + 1} batch {size}: {rate:.2f} pictures/s", flush=True)
    medians = {size: statistics.median(rates) for size, rates in found.items()}
    return {
        f"batch_{size}": {"pictures_per_s": round(rate, 2),
                          "vs_batch_1": round(rate / medians[1], 2),
                          "peak_gpu_gib": memory[size]}
        for size, rate in medians.items()
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-s", type=float, default=0.5, help="a simulated model load")
    parser.add_argument("--pictures", type=int, default=16, help="per batching measurement")
    parser.add_argument("--skip-batching", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="also SD 1.5's architecture on CUDA")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "benchmark": "gpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tasks": args.tasks,
        "load_s": args.load_s,
    }
    for order in ("alternating", "random"):
        result[f"routing_{order}"] = routing(args.tasks, args.rounds, args.load_s, order)
    if not args.skip_batching:
        result["routing_tiny_diffusers_random"] = tiny_routing(args.tasks, args.rounds)
        result["batching_tiny_cpu"] = batching(args.pictures, args.rounds)
        if args.gpu:
            result["batching_sd15_512_gpu"] = batching(args.pictures, args.rounds, gpu=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
