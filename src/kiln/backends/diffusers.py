"""The `diffusers` backend: a Stable Diffusion style pipeline loaded from a local folder.

The folder (``KILN_DIFFUSERS_MODEL_DIR``) is what ``DiffusionPipeline.save_pretrained``
writes, as does a model repository downloaded beforehand: ``model_index.json`` beside one
subfolder per part (unet, vae, text_encoder, tokenizer, scheduler). Nothing is fetched from
a hub: the pipeline loads with ``local_files_only=True``.

The pipeline runs on CUDA in float16 when torch sees a GPU (``KILN_DIFFUSERS_DEVICE=auto``),
else on the CPU in float32. A process loads it once, on its first task, and keeps it: the
next tasks on the same folder and device reuse it. One generation runs at a time on a
loaded pipeline, in a thread, so the worker's event loop keeps its heartbeats going.

Progress: each denoising step reports stage ``denoise``, step n of m, through the
pipeline's ``callback_on_step_end``. Every ``KILN_DIFFUSERS_PREVIEW_EVERY`` steps the report
carries a preview made from the latents by a fixed linear map to RGB: cheap (no VAE decode),
blurry, and only for 4-channel latents (SD 1.x and 2.x). A cancelled or timed-out task stops
its run at the next step.

Params: prompt, negative_prompt, width, height, steps and seed; the pipeline's own scheduler
and guidance scale are kept. The starting noise is drawn on the CPU from the seed, so the
same params give the same image on the same device and library versions.

Errors: a folder without ``model_index.json`` fails the task for good (``model_not_found``);
running out of GPU memory (``gpu_out_of_memory``) or asking for CUDA on a worker where torch
sees no GPU (``device_unavailable``) is retryable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from kiln.backends.upstream import UpstreamMetrics
from kiln.config import Settings
from kiln.demo import GenerateParams
from kiln.errors import InvalidRequest, Permanent, Retryable
from kiln.paint import encode, preview

if TYPE_CHECKING:
    from kiln.worker import Context

__all__ = ["DiffusersBackend", "LoadedPipeline", "gpu_errors", "latent_preview", "load_pipeline"]

NAME = "diffusers"
MODEL_NOT_FOUND = "model_not_found"
GPU_OUT_OF_MEMORY = "gpu_out_of_memory"
DEVICE_UNAVAILABLE = "device_unavailable"
#: What the backend imports on its first task (torch first, then the `diffusers` extra).
REQUIRED_MODULES = ("torch", "diffusers", "transformers")
#: A progress report from the pipeline's thread waits at most this long for the event loop.
REPORT_TIMEOUT_S = 30.0
#: Previews are scaled up to this many pixels on their longer side (latents are 1/8 size).
PREVIEW_SIDE = 96
#: SD 1.x/2.x latent channels to RGB, a linear fit widely used for live previews.
LATENT_RGB = (
    (0.3512, 0.2297, 0.3227),
    (0.3250, 0.4974, 0.2350),
    (-0.2829, 0.1762, 0.2721),
    (-0.2120, -0.2616, -0.7177),
)

#: Reports one stage of a run from the pipeline's thread: (step, total, stage, preview).
Report = Callable[[int | None, int | None, str, str | None], None]


class Interrupted(Exception):
    """Raised from the step callback to end a run whose task no longer wants it."""


@dataclass(slots=True)
class LoadedPipeline:
    """A pipeline on its device, with the lock that lets one generation run on it at a time."""

    pipe: Any
    device: str
    lock: threading.Lock = field(default_factory=threading.Lock)


# Loading takes seconds to minutes and gigabytes of (GPU) memory, so a process keeps each
# pipeline it loaded, by (folder, device), for its lifetime.
_LOADED: dict[tuple[str, str], LoadedPipeline] = {}
_LOADING = threading.Lock()


def load_pipeline(model_dir: Path, device: str = "auto") -> LoadedPipeline:
    """The pipeline saved in ``model_dir``, on ``device`` (auto, cpu or cuda); loaded on
    first use, then the same object. Blocking: call it from a thread."""
    if not (model_dir / "model_index.json").is_file():
        raise Permanent(
            f"no diffusers pipeline in {model_dir} (model_index.json is missing); "
            "set KILN_DIFFUSERS_MODEL_DIR to a folder saved with save_pretrained",
            code=MODEL_NOT_FOUND,
        )
    import torch
    from diffusers import DiffusionPipeline

    resolved = _resolve_device(device)
    key = (str(model_dir.resolve()), resolved)
    with _LOADING:
        loaded = _LOADED.get(key)
        if loaded is None:
            dtype = torch.float32 if resolved == "cpu" else torch.float16
            with gpu_errors():
                pipe = DiffusionPipeline.from_pretrained(
                    str(model_dir), local_files_only=True, dtype=dtype
                ).to(resolved)
            pipe.set_progress_bar_config(disable=True)
            loaded = _LOADED[key] = LoadedPipeline(pipe, resolved)
    return loaded


def _resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise Retryable(
            "KILN_DIFFUSERS_DEVICE=cuda but torch sees no CUDA device on this worker",
            code=DEVICE_UNAVAILABLE,
        )
    return requested


@contextlib.contextmanager
def gpu_errors() -> Iterator[None]:
    """Running out of GPU memory is retryable: the next attempt may land on a freer GPU."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        raise Retryable(f"the GPU ran out of memory: {first_line}", code=GPU_OUT_OF_MEMORY) from exc


def latent_preview(latents: Any) -> str | None:
    """A small JPEG data URL of the first image in ``latents`` ([batch, 4, h, w]), mapped
    to RGB without the VAE; None for latents of another shape."""
    import torch

    if latents.ndim != 4 or latents.shape[1] != len(LATENT_RGB):
        return None
    factors = torch.tensor(LATENT_RGB, dtype=torch.float32, device=latents.device)
    rgb = torch.einsum("chw,cr->hwr", latents[0].float(), factors)
    pixels = ((rgb + 1.0) * 127.5).clamp(0, 255).to(torch.uint8).cpu().numpy()
    image = Image.fromarray(pixels)
    scale = PREVIEW_SIDE / max(image.size)
    if scale > 1:
        size = (round(image.width * scale), round(image.height * scale))
        image = image.resize(size, Image.Resampling.BILINEAR)
    return preview(image, max_side=PREVIEW_SIDE)


class DiffusersBackend:
    """A local diffusers pipeline on this worker's GPU (or CPU)."""

    name = NAME
    resources: Mapping[str, int] = {"gpu": 1}

    def __init__(self, model_dir: Path, *, device: str = "auto", preview_every: int = 5) -> None:
        self.model_dir = model_dir
        self.device = device
        self.preview_every = preview_every

    @classmethod
    def from_settings(cls, settings: Settings, metrics: UpstreamMetrics) -> DiffusersBackend:
        """The backend KILN_DIFFUSERS_* describe. Nothing heavy is imported yet (API nodes
        build it too); the pipeline loads on the first task."""
        if settings.diffusers_model_dir is None:
            raise InvalidRequest(
                "KILN_BACKEND=diffusers needs KILN_DIFFUSERS_MODEL_DIR: the folder of a "
                "pipeline saved with save_pretrained (model_index.json and its parts)"
            )
        missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
        if missing:
            raise InvalidRequest(
                f"KILN_BACKEND=diffusers needs {', '.join(missing)}: install torch first "
                "(pip install torch==<version>), then pip install 'kiln[diffusers]'"
            )
        return cls(
            settings.diffusers_model_dir,
            device=settings.diffusers_device,
            preview_every=settings.diffusers_preview_every,
        )

    def loaded_models(self) -> list[str]:
        """The pipeline folder, once this process has loaded it (the worker registry)."""
        folder = str(self.model_dir.resolve())
        loaded = list(_LOADED)  # a copy: a loading thread may add to it meanwhile
        return [folder] if any(key[0] == folder for key in loaded) else []

    async def generate(self, ctx: Context, params: GenerateParams) -> bytes:
        """Run the pipeline in a thread; progress goes back to ``ctx`` on the event loop.
        The first task of a process loads the pipeline first, as its ``loading_model``
        stage (timed in ``kiln_model_load_seconds``)."""
        loop = asyncio.get_running_loop()
        if not self.loaded_models():
            async with ctx.loading_model(str(self.model_dir.resolve())):
                await loop.run_in_executor(None, load_pipeline, self.model_dir, self.device)
        stop = threading.Event()

        def report(step: int | None, total: int | None, stage: str, shown: str | None) -> None:
            if stop.is_set():
                raise Interrupted
            sent = ctx.progress(step, total, stage=stage, preview=shown)
            future = asyncio.run_coroutine_threadsafe(sent, loop)
            try:
                future.result(timeout=REPORT_TIMEOUT_S)
            except (concurrent.futures.CancelledError, TimeoutError) as exc:
                stop.set()  # the attempt was halted (cancel, lost lease) or the loop is gone
                raise Interrupted from exc

        job = loop.run_in_executor(None, self.render, params, report, stop)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            # Let the thread reach its next step and stop there, so the GPU slot is only
            # given back once the GPU is free.
            stop.set()
            await asyncio.wait([job])
            if not job.cancelled():
                job.exception()  # retrieved: an Interrupted run is the expected end
            raise

    def render(self, params: GenerateParams, report: Report, stop: threading.Event) -> bytes:
        """The image's bytes in ``params.format``. Blocking: the pipeline runs here."""
        loaded = load_pipeline(self.model_dir, self.device)
        import torch  # after the folder check, which needs no torch

        with loaded.lock, gpu_errors():
            if stop.is_set():
                raise Interrupted
            generator = torch.Generator("cpu").manual_seed(params.effective_seed())
            images = loaded.pipe(
                prompt=params.prompt,
                negative_prompt=params.negative_prompt,
                width=params.width,
                height=params.height,
                num_inference_steps=params.steps,
                generator=generator,
                callback_on_step_end=self._on_step(params, report),
                callback_on_step_end_tensor_inputs=["latents"],
            ).images
        return encode(images[0], params.format)

    def _on_step(self, params: GenerateParams, report: Report) -> Callable[..., dict[str, Any]]:
        every = self.preview_every

        def on_step(
            pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            step = index + 1
            # Some schedulers take more model calls than steps asked for; report theirs.
            total = int(getattr(pipe, "num_timesteps", 0) or params.steps)
            shown = None
            if every and step % every == 0 and step < total:
                shown = latent_preview(tensors["latents"])
            report(step, total, "denoise", shown)
            return tensors

        return on_step
