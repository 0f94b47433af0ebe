"""The `diffusers` backend: Stable Diffusion style pipelines loaded from local folders.

A pipeline folder is what ``DiffusionPipeline.save_pretrained`` writes, as does a model
repository downloaded beforehand: ``model_index.json`` beside one subfolder per part (unet,
vae, text_encoder, tokenizer, scheduler). Nothing is fetched from a hub: a pipeline loads
with ``local_files_only=True``.

Models by name: ``KILN_DIFFUSERS_MODEL_DIR`` is the default pipeline, named after its folder
(``/models/sd15`` is ``sd15``); a task's ``model`` param names another folder beside it
(``"model": "sdxl-turbo"`` is ``/models/sdxl-turbo``). The name, never a path, is the task's
model (:meth:`DiffusersBackend.model_of`), so API nodes and workers agree on it.

Memory: a process keeps the pipelines it loaded in a :class:`~kiln.model_cache.ModelCache`
within ``KILN_MODEL_MEMORY_GB`` (no limit when unset), unloading the least recently used
idle ones to make room. A model's size is estimated before it loads from its weight files
(:func:`weights_gb`). The pipeline runs on CUDA in float16 when torch sees a GPU
(``KILN_DIFFUSERS_DEVICE=auto``), else on the CPU in float32. One generation (or batch)
runs at a time on a loaded pipeline, in a thread, so the worker's event loop keeps its
heartbeats going.

Batches: :meth:`DiffusersBackend.generate_batch` renders tasks of one model, size and step
count in one pipeline call, each from its own seed, so each picture is the one the task
would get alone (to float rounding: see docs/backends.md).

Progress: each denoising step reports stage ``denoise``, step n of m, through the
pipeline's ``callback_on_step_end``. Every ``KILN_DIFFUSERS_PREVIEW_EVERY`` steps the report
carries a preview made from the latents by a fixed linear map to RGB: cheap (no VAE decode),
blurry, and only for 4-channel latents (SD 1.x and 2.x). A cancelled or timed-out task stops
its run at the next step. A run whose every member is asked to yield (``ctx.should_yield()``,
preemption) stops after its current step and raises :class:`~kiln.errors.Yielded`; a batch
with a member not asked runs on.

Params: prompt, negative_prompt, width, height, steps, seed and model; the pipeline's own
scheduler and guidance scale are kept. The starting noise is drawn on the CPU from the seed,
so the same params give the same image on the same device and library versions.

Errors: a model whose folder has no ``model_index.json`` fails the task for good
(``model_not_found``); running out of GPU memory (``gpu_out_of_memory``) or asking for CUDA
on a worker where torch sees no GPU (``device_unavailable``) is retryable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import importlib.util
import json
import os
import struct
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from PIL import Image

from kiln.backends.upstream import UpstreamMetrics
from kiln.config import Settings
from kiln.demo import GenerateParams
from kiln.errors import InvalidRequest, Permanent, Retryable, Yielded
from kiln.model_cache import DEFAULT_MAX_MODELS, ModelCache
from kiln.models import JSON
from kiln.paint import encode, preview

if TYPE_CHECKING:
    from kiln.worker import Context

__all__ = [
    "DiffusersBackend",
    "LoadedPipeline",
    "gpu_errors",
    "latent_preview",
    "load_pipeline",
    "weights_gb",
]

NAME = "diffusers"
MODEL_NOT_FOUND = "model_not_found"
GPU_OUT_OF_MEMORY = "gpu_out_of_memory"
DEVICE_UNAVAILABLE = "device_unavailable"
#: The stage a batch member shows while another member's attempt loads the model.
LOADING_MODEL = "loading_model"
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
#: safetensors dtypes already at half precision: such files do not shrink in a float16 load.
HALF_DTYPES = frozenset({"F16", "BF16"})

#: Reports one step of a run to every member still in it, from the pipeline's thread:
#: (step, total, one preview per member or None). Returns the members dropped so far, by
#: index, with what their report raised (CancelledError: the attempt was halted).
Report = Callable[[int, int, Sequence[str | None]], Mapping[int, BaseException]]


class Interrupted(Exception):
    """Raised from the step callback to end a run whose tasks no longer want it."""


@dataclass(slots=True)
class LoadedPipeline:
    """A pipeline on its device, with the lock that lets one generation run on it at a time."""

    pipe: Any
    device: str
    lock: threading.Lock = field(default_factory=threading.Lock)


def load_pipeline(model_dir: Path, device: str = "auto") -> LoadedPipeline:
    """The pipeline saved in ``model_dir``, loaded on ``device`` (auto, cpu or cuda): a new
    one each call (the backend keeps what it loaded in its cache). Blocking: call it from a
    thread."""
    _check_folder(model_dir)
    import torch
    from diffusers import DiffusionPipeline

    resolved = _resolve_device(device)
    dtype = torch.float32 if resolved == "cpu" else torch.float16
    with gpu_errors():
        pipe = DiffusionPipeline.from_pretrained(
            str(model_dir), local_files_only=True, dtype=dtype
        ).to(resolved)
    pipe.set_progress_bar_config(disable=True)
    return LoadedPipeline(pipe, resolved)


def _check_folder(model_dir: Path) -> None:
    if not (model_dir / "model_index.json").is_file():
        raise Permanent(
            f"no diffusers pipeline in {model_dir} (model_index.json is missing); the "
            "default model is KILN_DIFFUSERS_MODEL_DIR, a task's model a folder beside it, "
            "each saved with save_pretrained",
            code=MODEL_NOT_FOUND,
        )


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


def weights_gb(model_dir: Path, *, half: bool = False) -> float:
    """The memory the pipeline in ``model_dir`` takes once loaded, estimated from its
    weight files, in GiB: in each part's folder the ``.safetensors`` files (else the
    ``.bin`` ones), leaving out variants (``*.fp16.safetensors``) and loose checkpoints,
    which ``from_pretrained`` does not read. With ``half`` (a float16 load) a file counts
    half its size, unless it already holds half-precision floats (read from the
    safetensors header; ``.bin`` files are taken as float32). Activations are not counted."""
    total = 0.0
    for part in sorted(path for path in model_dir.iterdir() if path.is_dir()):
        for weights in _weight_files(part):
            size = weights.stat().st_size
            total += size / 2 if half and not _stored_half(weights) else size
    return total / 2**30


def _weight_files(part: Path) -> list[Path]:
    for suffix in (".safetensors", ".bin"):
        # A name with two dots carries a variant (diffusion_pytorch_model.fp16.safetensors).
        found = [f for f in part.glob(f"*{suffix}") if f.is_file() and f.name.count(".") == 1]
        if found:
            return found
    return []


def _stored_half(weights: Path) -> bool:
    """Whether a safetensors file's floating tensors are all float16 or bfloat16."""
    if weights.suffix != ".safetensors":
        return False
    try:
        with weights.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(min(length, 100 * 2**20)))
    except (OSError, ValueError, struct.error):
        return False
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__" and "dtype" in v}
    floats = {dtype for dtype in dtypes if dtype.startswith(("F", "BF"))}
    return bool(floats) and floats <= HALF_DTYPES


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


class _Members:
    """The contexts of one batch, as one for :meth:`ModelCache.use`: the first member's
    attempt loads the model (and its load is timed once); the others show the stage."""

    def __init__(self, ctxs: Sequence[Context]) -> None:
        self.ctxs = ctxs

    @contextlib.asynccontextmanager
    async def loading_model(self, model: str) -> AsyncIterator[None]:
        others = [ctx.progress(None, None, stage=LOADING_MODEL) for ctx in self.ctxs[1:]]
        await asyncio.gather(*others, return_exceptions=True)  # a halted one stops at step 1
        async with self.ctxs[0].loading_model(model):
            yield


class DiffusersBackend:
    """Local diffusers pipelines on this worker's GPU (or CPU), by model name."""

    name = NAME
    resources: Mapping[str, int] = {"gpu": 1}

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "auto",
        preview_every: int = 5,
        memory_gb: float | None = None,
        max_models: int = DEFAULT_MAX_MODELS,
    ) -> None:
        # Normalised, not resolved: the default model's name must not depend on the links
        # of the machine (API nodes and workers name it alike).
        self.model_dir = Path(os.path.normpath(model_dir.absolute()))
        self.device = device
        self.preview_every = preview_every
        self.models: ModelCache[LoadedPipeline] = ModelCache(
            memory_gb, unload=self._unload, max_models=max_models
        )

    @classmethod
    def from_settings(cls, settings: Settings, metrics: UpstreamMetrics) -> DiffusersBackend:
        """The backend KILN_DIFFUSERS_* describe. Nothing heavy is imported yet (API nodes
        build it too); a pipeline loads on the first task that needs it."""
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
            memory_gb=settings.model_memory_gb,
            max_models=settings.max_loaded_models,
        )

    @property
    def default_model(self) -> str:
        """The name of KILN_DIFFUSERS_MODEL_DIR's pipeline: its folder's own name."""
        return self.model_dir.name

    def model_of(self, params: JSON | GenerateParams) -> str:
        """The model a task renders with: its ``model`` param, else the default's name."""
        model = params.model if isinstance(params, GenerateParams) else params.get("model")
        return self.default_model if model is None else str(model)

    def folder_of(self, model: str) -> Path:
        """The pipeline folder of ``model``: the default one, or the folder beside it."""
        if model == self.default_model:
            return self.model_dir
        if Path(model).name != model or model in (".", ".."):  # validated params never are
            raise Permanent(f"{model!r} is not a model name", code=MODEL_NOT_FOUND)
        return self.model_dir.parent / model

    def _model_of_batch(self, ctxs: Sequence[Context], params: Sequence[GenerateParams]) -> str:
        """The model of a batch, once it is checked to be one pipeline call (the worker
        batches only tasks of one model, size and step count: anything else is a bug)."""
        if not params or len(ctxs) != len(params):
            raise ValueError(f"a batch takes one context per params: {len(ctxs)}, {len(params)}")
        shapes = {(self.model_of(p), p.width, p.height, p.steps) for p in params}
        if len(shapes) > 1:
            raise ValueError(f"a batch's tasks must share model, size and steps: {shapes}")
        return self.model_of(params[0])

    def loaded_models(self) -> list[str]:
        """The models this process holds loaded, least recently used first."""
        return self.models.loaded_models()

    async def generate(self, ctx: Context, params: GenerateParams) -> bytes:
        """Run the pipeline in a thread; progress goes back to ``ctx`` on the event loop.
        A task whose model is not loaded loads it first, as its ``loading_model`` stage
        (timed in ``kiln_model_load_seconds``)."""
        (result,) = await self.generate_batch([ctx], [params])
        if isinstance(result, BaseException):
            raise result
        return result

    async def generate_batch(
        self, ctxs: Sequence[Context], params: Sequence[GenerateParams]
    ) -> list[bytes | BaseException]:
        """The images of tasks of one model, size and step count, made in one pipeline
        call, each in its own task's format; each is the image the task would get alone.

        Every step is reported to every member. A whole run that fails raises; a result is
        an exception only for the member it concerns: ``CancelledError`` for one halted
        while the others went on (the run stops when all are), or its encoding's error.
        """
        model = self._model_of_batch(ctxs, params)
        folder = self.folder_of(model)
        _check_folder(folder)  # before torch: a wrong name fails the same without it
        loop = asyncio.get_running_loop()
        device, size_gb = await loop.run_in_executor(None, self._sized, folder)

        async def load() -> LoadedPipeline:
            return await loop.run_in_executor(None, load_pipeline, folder, device)

        members = cast("Context", _Members(ctxs))  # all ModelCache.use asks of a context
        async with self.models.use(members, model, load, size_gb=size_gb) as loaded:
            return await self._run(loaded, ctxs, params)

    async def _run(
        self, loaded: LoadedPipeline, ctxs: Sequence[Context], params: Sequence[GenerateParams]
    ) -> list[bytes | BaseException]:
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        yielding: list[int] = []  # the step after which the run yielded (preemption)
        dropped: dict[int, BaseException] = {}

        def report(step: int, total: int, shown: Sequence[str | None]) -> dict[int, BaseException]:
            if stop.is_set():
                raise Interrupted
            sent = _report_all(ctxs, step, total, shown, dropped)
            future = asyncio.run_coroutine_threadsafe(sent, loop)
            try:
                dropped.update(future.result(timeout=REPORT_TIMEOUT_S))
            except (concurrent.futures.CancelledError, TimeoutError) as exc:
                stop.set()  # the loop is gone or stuck
                raise Interrupted from exc
            left = [ctx for index, ctx in enumerate(ctxs) if index not in dropped]
            if step < total and left and all(ctx.should_yield() for ctx in left):
                yielding.append(step)  # every member still running was asked to yield
                raise Interrupted
            return dropped

        job = loop.run_in_executor(None, self.render, loaded, params, report, stop)
        try:
            return await asyncio.shield(job)
        except Interrupted:
            if yielding:
                raise Yielded(f"yielded at step {yielding[0]}") from None
            raise
        except asyncio.CancelledError:
            # Let the thread reach its next step and stop there, so the GPU slot is only
            # given back once the GPU is free.
            stop.set()
            await asyncio.wait([job])
            if not job.cancelled():
                job.exception()  # retrieved: an Interrupted run is the expected end
            raise

    def render(
        self,
        loaded: LoadedPipeline,
        params: Sequence[GenerateParams],
        report: Report,
        stop: threading.Event,
    ) -> list[bytes | BaseException]:
        """The images' bytes, each in its ``format``. Blocking: the pipeline runs here."""
        import torch

        first = params[0]
        dropped: dict[int, BaseException] = {}
        with loaded.lock, gpu_errors():
            if stop.is_set():
                raise Interrupted
            images = loaded.pipe(
                prompt=[p.prompt for p in params],
                negative_prompt=[p.negative_prompt or "" for p in params],
                width=first.width,
                height=first.height,
                num_inference_steps=first.steps,
                generator=[torch.Generator("cpu").manual_seed(p.effective_seed()) for p in params],
                callback_on_step_end=self._on_step(len(params), first.steps, report, dropped),
                callback_on_step_end_tensor_inputs=["latents"],
            ).images
        return [
            dropped[index] if index in dropped else _encoded(image, p.format)
            for index, (image, p) in enumerate(zip(images, params, strict=True))
        ]

    def _on_step(
        self, members: int, steps: int, report: Report, dropped: dict[int, BaseException]
    ) -> Callable[..., dict[str, Any]]:
        every = self.preview_every

        def on_step(
            pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            step = index + 1
            # Some schedulers take more model calls than steps asked for; report theirs.
            total = int(getattr(pipe, "num_timesteps", 0) or steps)
            shown: list[str | None] = [None] * members
            if every and step % every == 0 and step < total:
                latents = tensors["latents"]
                shown = [latent_preview(latents[n : n + 1]) for n in range(members)]
            dropped.update(report(step, total, shown))
            if len(dropped) == members:
                raise Interrupted
            return tensors

        return on_step

    def _sized(self, folder: Path) -> tuple[str, float]:
        """The device a load goes to, and the GiB the model takes there (float16 off the
        CPU). Blocking: the first call imports torch, and weight files are read."""
        device = _resolve_device(self.device)
        return device, weights_gb(folder, half=device != "cpu")

    def _unload(self, model: str, loaded: LoadedPipeline) -> None:
        """Drop an evicted pipeline, and give its GPU memory back to the device."""
        loaded.pipe = None
        gc.collect()  # a pipeline's modules refer to each other; free them now
        if loaded.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


async def _report_all(
    ctxs: Sequence[Context],
    step: int,
    total: int,
    shown: Sequence[str | None],
    dropped: Mapping[int, BaseException],
) -> dict[int, BaseException]:
    """Report a step to the members not dropped yet; those whose report raised, by index
    (a halted attempt's report raises CancelledError)."""
    members = [index for index in range(len(ctxs)) if index not in dropped]
    sent = [
        ctxs[index].progress(step, total, stage="denoise", preview=shown[index])
        for index in members
    ]
    results = await asyncio.gather(*sent, return_exceptions=True)
    return {
        index: result
        for index, result in zip(members, results, strict=True)
        if isinstance(result, BaseException)
    }


def _encoded(image: Image.Image, fmt: str) -> bytes | BaseException:
    try:
        return encode(image, fmt)
    except (OSError, ValueError) as exc:
        return exc
