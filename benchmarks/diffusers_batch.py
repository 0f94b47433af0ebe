"""Pictures per second of the diffusers backend by batch size, on the tiny random pipeline.

The same pictures (different prompts and seeds) are made in batches of 1, 4 and 8 through
``DiffusersBackend.generate_batch``, progress reports and PNG encoding included, in rounds
that interleave the batch sizes; the median of the rounds is printed, then one JSON line.
The tiny pipeline (``tests/backends/tiny_diffusers.py``) is mostly per-call overhead, so
this measures what batching saves around the model, not a real model's GPU throughput.

    .venv/bin/python benchmarks/diffusers_batch.py                  # 1, 4, 8; 16 pictures
    .venv/bin/python benchmarks/diffusers_batch.py --batches 1,8 --pictures 32 --rounds 5

``tiny_throughput(batch, pictures)`` is the figure of one round, for other scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from kiln.backends.diffusers import DiffusersBackend
from kiln.demo import GenerateParams

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("a red kite", "a lighthouse at dusk", "two cats on a wall", "rain over a city")


class QuietContext:
    """What a backend sees of a worker's Context, reporting nowhere."""

    attempt = 1

    async def progress(
        self, step: int | None, total: int | None, *, stage: str | None = None,
        preview: str | None = None,
    ) -> None:  # fmt: skip
        return None

    @contextlib.asynccontextmanager
    async def loading_model(self, model: str) -> AsyncIterator[None]:
        yield

    def should_yield(self) -> bool:
        return False


@functools.cache
def tiny_model_dir() -> Path:
    """The tiny pipeline, saved once per process in a folder removed at exit."""
    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from tiny_diffusers import save_tiny_pipeline  # type: ignore[import-not-found]

    scratch = Path(tempfile.mkdtemp(prefix="kiln-tiny-sd-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return Path(save_tiny_pipeline(scratch / "tiny"))


def pictures_params(pictures: int, *, steps: int, side: int) -> list[GenerateParams]:
    return [
        GenerateParams(
            prompt=f"{PROMPTS[n % len(PROMPTS)]} #{n}",
            seed=n,
            steps=steps,
            width=side,
            height=side,
        )
        for n in range(pictures)
    ]


def tiny_throughput(
    batch: int, pictures: int, *, steps: int = 4, side: int = 64, device: str = "cpu"
) -> float:
    """Pictures per second making ``pictures`` pictures in batches of ``batch`` (the last
    one smaller when it does not divide), on a loaded tiny pipeline (the load and a warm-up
    batch are not timed)."""
    backend = DiffusersBackend(tiny_model_dir(), device=device, preview_every=0)
    params = pictures_params(pictures, steps=steps, side=side)

    async def run() -> float:
        await backend.generate_batch([QuietContext()] * batch, params[:batch])  # type: ignore[list-item]
        started = time.perf_counter()
        for start in range(0, pictures, batch):
            chunk = params[start : start + batch]
            results = await backend.generate_batch([QuietContext()] * len(chunk), chunk)  # type: ignore[list-item]
            if any(isinstance(result, BaseException) for result in results):
                raise RuntimeError(f"a picture failed: {results}")
        return pictures / (time.perf_counter() - started)

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--pictures", type=int, default=16, help="pictures per figure")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--side", type=int, default=64, help="width and height in pixels")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    batches = [int(size) for size in args.batches.split(",")]
    rates: dict[int, list[float]] = {size: [] for size in batches}
    for _ in range(args.rounds):
        for size in batches:
            rates[size].append(
                tiny_throughput(
                    size, args.pictures, steps=args.steps, side=args.side, device=args.device
                )
            )
    base = statistics.median(rates[batches[0]])
    for size in batches:
        median = statistics.median(rates[size])
        runs = ", ".join(f"{rate:.1f}" for rate in rates[size])
        print(f"batch {size:3d}: {median:7.1f} pictures/s  (x{median / base:.2f}; rounds {runs})")
    figures = {
        "pictures": args.pictures, "steps": args.steps, "side": args.side, "device": args.device,
        "pictures_per_s": {str(size): statistics.median(rates[size]) for size in batches},
    }  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
