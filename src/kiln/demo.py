"""The built-in demo image generator: the `image.generate` kind on the demo painter.

A fresh install has no model weights, so `image.generate` is served by a small procedural
painter: the prompt and seed choose a palette and a landscape (sky, sun or moon, clouds,
layered hills, trees, water), and each denoising step blends that final picture with seeded
noise, the way a diffusion model's previews sharpen from static into an image.

Everything here is deterministic: the same arguments give the same pixels and, through
`encode`, the same bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import Permanent, Retryable, Yielded
from kiln.kinds import Registry
from kiln.models import Output
from kiln.paint import encode, preview, render

if TYPE_CHECKING:
    from kiln.worker import Context

JSONObject = dict[str, Any]

__all__ = [
    "MAX_SEED",
    "OUTPUT_NAMES",
    "GenerateParams",
    "Simulate",
    "derive_seed",
    "generate",
    "register",
]

MAX_SEED = 2**32 - 1

OUTPUT_NAMES: dict[str, tuple[str, str]] = {
    "png": ("image.png", "image/png"),
    "webp": ("image.webp", "image/webp"),
    "jpeg": ("image.jpg", "image/jpeg"),
}

Dimension = Annotated[int, Field(ge=64, le=2048, multiple_of=8)]
#: A model's name: a file or folder name, never a path.
ModelName = Annotated[
    str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
]


class Simulate(BaseModel):
    """Failure and pacing knobs of the demo backend (API.md, `simulate`)."""

    model_config = ConfigDict(extra="forbid")

    step_ms: Annotated[int, Field(ge=0, le=10_000)] = 40
    fail_attempts: Annotated[int, Field(ge=0, le=10)] = 0
    fail_code: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")] = (
        "simulated_failure"
    )
    permanent: bool = False
    stall_attempts: Annotated[int, Field(ge=0, le=10)] = 0
    review: bool = False


class GenerateParams(BaseModel):
    """Parameters of an `image.generate` task."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[str, Field(min_length=1, max_length=2000)]
    negative_prompt: Annotated[str | None, Field(max_length=2000)] = None
    width: Dimension = 512
    height: Dimension = 512
    steps: Annotated[int, Field(ge=1, le=150)] = 30
    seed: Annotated[int | None, Field(ge=0, le=MAX_SEED)] = None
    format: Literal["png", "webp", "jpeg"] = "png"
    #: The model to render with, as the backend names its models (the diffusers backend:
    #: a pipeline folder; ComfyUI: a checkpoint); None: the backend's own.
    model: ModelName | None = None
    simulate: Simulate | None = None

    def effective_seed(self) -> int:
        """The seed to render with: `seed` when given, else one derived from the picture's params.

        Only the params that shape the picture take part (`format` and `simulate` do not), so
        the same prompt renders the same image whatever the encoding or simulated failures.
        """
        if self.seed is not None:
            return self.seed
        unused = set(_UNSEEDED) | ({"model"} if self.model is None else set())
        return derive_seed(self.model_dump(mode="json", exclude=unused))


def derive_seed(params_without_seed: Mapping[str, object]) -> int:
    """A seed in 0..2**32-1 from the sha256 of the params' canonical JSON.

    A `seed` key, if present, is ignored, so identical requests always get identical seeds.
    """
    body = {key: value for key, value in params_without_seed.items() if key != "seed"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:4], "big")


KIND = "image.generate"


def normalize(params: JSONObject) -> JSONObject:
    """Fill in the derived seed, so the stored params say exactly what was rendered.

    ``params`` are validated already (``TaskKind.validate``: their dump without None
    values), so the seed is derived from them as :meth:`GenerateParams.effective_seed`
    derives it from the model, without validating them a second time."""
    if params.get("seed") is None:
        unused = _UNSEEDED | ({"model"} if params.get("model") is None else set())
        shaping = {name: params.get(name) for name in GenerateParams.model_fields}
        params = {
            **params,
            "seed": derive_seed({k: v for k, v in shaping.items() if k not in unused}),
        }
    return params


#: The params that do not shape the picture (:meth:`GenerateParams.effective_seed`).
_UNSEEDED = frozenset({"seed", "format", "simulate"})


async def generate(ctx: Context, params: GenerateParams) -> Output:
    """Paint step by step, reporting progress and a small preview every few steps; asked
    to yield (``ctx.should_yield()``, preemption), it stops between two steps."""
    sim = params.simulate or Simulate()
    if sim.permanent:
        raise Permanent(f"simulated permanent failure ({sim.fail_code})", code=sim.fail_code)
    seed = params.effective_seed()
    total = params.steps
    preview_every = max(1, total // 6)

    def frame(step: int) -> Image.Image:
        return render(
            params.prompt, seed, params.width, params.height, step, total, params.negative_prompt
        )

    for step in range(1, total + 1):
        if step > 1 and ctx.should_yield():  # preemption: give the slot up between steps
            raise Yielded(f"yielded at step {step - 1} of {total}")
        if ctx.attempt <= sim.stall_attempts and step > total // 3:
            await asyncio.Event().wait()  # alive but stuck: the generating timeout ends it
        if ctx.attempt <= sim.fail_attempts and step == max(1, total // 2):
            raise Retryable(f"simulated failure on attempt {ctx.attempt}", code=sim.fail_code)
        if sim.step_ms:
            await asyncio.sleep(sim.step_ms / 1000)
        shown = None
        if step % preview_every == 0 and step < total:
            shown = preview(await asyncio.to_thread(frame, step))
        await ctx.progress(step, total, stage="denoise", preview=shown)
    await ctx.progress(total, total, stage="encode")
    name, content_type = OUTPUT_NAMES[params.format]
    data = await asyncio.to_thread(lambda: encode(frame(total), params.format))
    return Output(name, data, content_type)


def flagged_for_review(params: GenerateParams, outputs: list[Output]) -> bool:
    """The demo's moderation check: flags the output when `simulate.review` is set."""
    return bool(params.simulate and params.simulate.review)


def register(app: Registry, *, resources: dict[str, int] | None = None) -> None:
    """Register `image.generate` on ``app``; it needs one `gpu` slot by default."""
    app.task(
        KIND,
        params=GenerateParams,
        resources={"gpu": 1} if resources is None else resources,
        review=flagged_for_review,
        normalize=normalize,
        model="model",
    )(generate)
