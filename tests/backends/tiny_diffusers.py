"""A tiny Stable Diffusion pipeline with random weights, built from configs: no downloads.

The parts are shrunk versions of SD 1.x's (the same block types, a 4-channel latent space,
a CLIP text encoder and tokenizer), so the real loading and sampling code runs in about a
second on the CPU. As in SD, the VAE divides the size by 8: a 64×64 image has 8×8 latents.
The images are noise: only their size, bytes and the calls around them are tested.

Also here, for every diffusers test file: :class:`RecordingContext` (what a backend sees of
a worker's Context) and :func:`make_params`. torch is imported only when a pipeline is
built, so the test files import this module without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.backends.diffusers import DiffusersBackend, LoadedPipeline
from kiln.demo import GenerateParams

if TYPE_CHECKING:
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTokenizer

#: The longest prompt, in tokens, as in SD's own CLIP tokenizer.
MAX_TOKENS = 77


def byte_alphabet() -> list[str]:
    """The 256 printable characters that stand for bytes in byte-level BPE (CLIP, GPT-2)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + n) for n in range(len(shifted))]


def write_tokenizer(folder: Path) -> CLIPTokenizer:
    """A CLIP tokenizer whose vocabulary is single bytes (no merges) plus its two specials."""
    from transformers import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):  # a byte inside a word, and one that ends it
        for char in byte_alphabet():
            vocab[char + suffix] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return CLIPTokenizer.from_pretrained(str(folder), model_max_length=MAX_TOKENS)


def tiny_pipeline(scratch: Path, seed: int = 0) -> StableDiffusionPipeline:
    """The tiny pipeline, its random weights drawn from ``seed``."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = write_tokenizer(scratch / "tokenizer-source")
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(4, 8),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=2,
        norm_num_groups=2,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(4, 4, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=2,
        sample_size=64,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=8,
            intermediate_size=16,
            num_attention_heads=2,
            num_hidden_layers=1,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    return assemble(unet, vae, text_encoder, tokenizer)


def assemble(
    unet: object, vae: object, text_encoder: object, tokenizer: object
) -> StableDiffusionPipeline:
    """An SD 1.x pipeline of these parts, with SD's DDIM schedule and no safety checker."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def save_tiny_pipeline(folder: Path, seed: int = 0) -> Path:
    """Build the tiny pipeline and save it in ``folder`` as ``save_pretrained`` does."""
    tiny_pipeline(folder.parent, seed).save_pretrained(str(folder))
    return folder


class RecordingContext:
    """The part of a worker's Context a backend uses: progress reports, kept in order.

    ``halt_at`` makes the report of that step raise CancelledError, as a worker's does
    once the attempt is halted (cancelled, timed out, its lease lost); ``yield_at`` makes
    ``should_yield()`` true from the report of that step on (preemption)."""

    attempt = 1

    def __init__(self, halt_at: int | None = None, yield_at: int | None = None) -> None:
        self.reports: list[tuple[int | None, int | None, str | None, str | None]] = []
        self.on_report: asyncio.Event | None = None
        self.loads: list[str] = []
        self.halt_at = halt_at
        self.yield_at = yield_at

    def should_yield(self) -> bool:
        last = self.reports[-1][0] if self.reports else None
        return self.yield_at is not None and last is not None and last >= self.yield_at

    async def progress(
        self,
        step: int | None,
        total: int | None,
        *,
        stage: str | None = None,
        preview: str | None = None,
    ) -> None:
        self.reports.append((step, total, stage, preview))
        if self.on_report is not None:
            self.on_report.set()
        if self.halt_at is not None and step is not None and step >= self.halt_at:
            raise asyncio.CancelledError

    @contextlib.asynccontextmanager
    async def loading_model(self, model: str) -> AsyncIterator[None]:
        self.loads.append(model)
        yield


def make_params(**changes: object) -> GenerateParams:
    fields: dict[str, object] = {
        "prompt": "a lighthouse at dusk",
        "width": 64,
        "height": 64,
        "steps": 4,
        "seed": 7,
    }
    return GenerateParams.model_validate({**fields, **changes})


async def held(backend: DiffusersBackend, model: str) -> LoadedPipeline:
    """The pipeline ``backend`` holds for ``model`` (it must hold it: this loads nothing)."""

    async def no_load() -> LoadedPipeline:
        raise AssertionError(f"{model} is not loaded")

    async with backend.models.use(RecordingContext(), model, no_load, size_gb=0) as loaded:  # type: ignore[arg-type]
        return loaded
