"""Pictures per second of the diffusers backend by batch size, on a random pipeline.

The same pictures (different prompts and seeds) are made in batches of 1, 4 and 8 through
``DiffusersBackend.generate_batch``, progress reports and PNG encoding included, in rounds
that interleave the batch sizes; the median of the rounds is printed, then one JSON line.
The tiny pipeline (``tests/backends/tiny_diffusers.py``, the default) is mostly per-call
overhead, so it measures what batching saves around the model, not a real model's GPU
throughput. ``--architecture sd15`` builds Stable Diffusion 1.5's architecture at full size
(UNet 860 M parameters, its VAE and a 12-layer CLIP text encoder) with random weights, no
download: on a GPU at 512×512 its figures are a real model's, and the JSON line adds the
peak GPU memory per batch size.

    .venv/bin/python benchmarks/diffusers_batch.py                  # 1, 4, 8; 16 pictures
    .venv/bin/python benchmarks/diffusers_batch.py --batches 1,8 --pictures 32 --rounds 5
    .venv/bin/python benchmarks/diffusers_batch.py --architecture sd15 --device cuda \
        --side 512 --steps 20 --pictures 16

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


@functools.cache
def sd15_model_dir() -> Path:
    """Stable Diffusion 1.5's architecture at full size with random weights, saved once per
    process in a folder removed at exit (about 4 GB)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from tiny_diffusers import MAX_TOKENS, assemble, write_tokenizer

    scratch = Path(tempfile.mkdtemp(prefix="kiln-sd15-random-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    tokenizer = write_tokenizer(scratch / "tokenizer-source")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(  # SD 1.5's UNet config
        sample_size=64,
        in_channels=4,
        out_channels=4,
        block_out_channels=(320, 640, 1280, 1280),
        layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768,
        attention_head_dim=8,
    )
    vae = AutoencoderKL(  # SD 1.5's VAE config
        in_channels=3,
        out_channels=3,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=2,
        sample_size=512,
    )
    text_encoder = CLIPTextModel(  # CLIP ViT-L/14's text tower, as SD 1.5 uses
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_hidden_layers=12,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    pipeline = assemble(unet, vae, text_encoder, tokenizer)
    folder = scratch / "sd15"
    pipeline.save_pretrained(str(folder))
    return folder


def peak_gpu_gib(device: str) -> float | None:
    """The peak GPU memory of this process since the last reset, in GiB (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


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
    batch: int,
    pictures: int,
    *,
    steps: int = 4,
    side: int = 64,
    device: str = "cpu",
    architecture: str = "tiny",
) -> float:
    """Pictures per second making ``pictures`` pictures in batches of ``batch`` (the last
    one smaller when it does not divide), on a loaded pipeline (the tiny one, or SD 1.5's
    architecture: ``sd15``); the load and a warm-up batch are not timed."""
    folder = sd15_model_dir() if architecture == "sd15" else tiny_model_dir()
    backend = DiffusersBackend(folder, device=device, preview_every=0)
    params = pictures_params(pictures, steps=steps, side=side)

    async def run() -> float:
        warm = params[:batch]
        await backend.generate_batch([QuietContext()] * len(warm), warm)  # type: ignore[list-item]
        if device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats()
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
    parser.add_argument("--architecture", choices=("tiny", "sd15"), default="tiny")
    args = parser.parse_args()
    batches = [int(size) for size in args.batches.split(",")]
    rates: dict[int, list[float]] = {size: [] for size in batches}
    memory: dict[int, float | None] = {}
    for _ in range(args.rounds):
        for size in batches:
            rates[size].append(
                tiny_throughput(
                    size, args.pictures, steps=args.steps, side=args.side, device=args.device,
                    architecture=args.architecture,
                )
            )  # fmt: skip
            memory[size] = peak_gpu_gib(args.device)
    base = statistics.median(rates[batches[0]])
    for size in batches:
        median = statistics.median(rates[size])
        runs = ", ".join(f"{rate:.1f}" for rate in rates[size])
        print(f"batch {size:3d}: {median:7.1f} pictures/s  (x{median / base:.2f}; rounds {runs})")
    figures = {
        "architecture": args.architecture, "pictures": args.pictures, "steps": args.steps,
        "side": args.side, "device": args.device,
        "pictures_per_s": {str(size): statistics.median(rates[size]) for size in batches},
        "peak_gpu_gib": {str(size): memory[size] for size in batches},
    }  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
