"""A tiny Stable Diffusion pipeline with random weights, built from configs: no downloads.

The parts are shrunk versions of SD 1.x's (the same block types, a 4-channel latent space,
a CLIP text encoder and tokenizer), so the real loading and sampling code runs in about a
second on the CPU. As in SD, the VAE divides the size by 8: a 64×64 image has 8×8 latents.
The images are noise: only their size, bytes and the calls around them are tested.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

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
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):  # a byte inside a word, and one that ends it
        for char in byte_alphabet():
            vocab[char + suffix] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return CLIPTokenizer.from_pretrained(str(folder), model_max_length=MAX_TOKENS)


def tiny_pipeline(scratch: Path) -> StableDiffusionPipeline:
    tokenizer = write_tokenizer(scratch / "tokenizer-source")
    torch.manual_seed(0)
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


def save_tiny_pipeline(folder: Path) -> Path:
    """Build the tiny pipeline and save it in ``folder`` as ``save_pretrained`` does."""
    tiny_pipeline(folder.parent).save_pretrained(str(folder))
    return folder
