"""Generator backends: what turns `image.generate` params into image bytes.

One small protocol, :class:`Backend`, and one backend per process for the kind, chosen by
configuration (``KILN_BACKEND``):

| name            | what makes the image                                        |
|-----------------|-------------------------------------------------------------|
| `demo`          | kiln's procedural painter (:mod:`kiln.demo`); the default   |
| `openai-images` | an OpenAI-compatible ``/images/generations`` endpoint       |
| `comfyui`       | a ComfyUI server's prompt queue, running an API-format workflow |

The engine owns everything around the call: claiming, resource slots, retries, timeouts,
uploading and verifying the output. A backend only makes the image, reports progress on
``ctx``, and raises :class:`kiln.Retryable` or :class:`kiln.Permanent` when it cannot.
Backends that call a service go through :class:`~kiln.backends.upstream.Upstream`, which
adds the circuit breaker, the overall deadline, the latency histogram and the error
classification.

Adding a backend (a local diffusers pipeline is the next one): a class with the
:class:`Backend` attributes, a factory ``(settings, metrics) -> Backend`` that imports its
heavy dependencies lazily, and an entry in :data:`BACKENDS`.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from PIL import Image

from kiln import demo
from kiln.backends.upstream import BAD_RESPONSE, UpstreamMetrics, sniff
from kiln.config import Settings
from kiln.config_values import MemoryRule
from kiln.demo import OUTPUT_NAMES, GenerateParams
from kiln.errors import InvalidRequest, Retryable
from kiln.kinds import AmountsOf, BatchPolicy, Registry
from kiln.model_cache import DEFAULT_MAX_MODELS, ModelCache
from kiln.models import JSON, Output
from kiln.paint import encode

if TYPE_CHECKING:
    from kiln.worker import Context

__all__ = [
    "BACKENDS",
    "Backend",
    "DemoBackend",
    "ImageGenerate",
    "UpstreamMetrics",
    "backend_for",
    "collectors",
    "register",
]


class Backend(Protocol):
    """Makes the image of one `image.generate` task.

    ``generate`` gets the worker's ``ctx`` (``ctx.progress(step, total, stage=...)``,
    ``ctx.attempt``) and the validated params (prompt, negative_prompt, width, height,
    steps, seed, format), and returns the image's bytes: PNG, JPEG or WEBP. When that is
    not the task's ``format``, the image is re-encoded. A backend ignores the params its
    model has no use for (the OpenAI API takes no seed) and documents which.
    """

    #: The KILN_BACKEND value that selects it; the ``backend`` label of its metrics.
    name: str
    #: Worker resource slots one generation holds: ``{"gpu": 1}`` for GPU work on this
    #: machine or on a single-GPU server; ``{}`` when only worker concurrency bounds it.
    resources: Mapping[str, int]

    async def generate(self, ctx: Context, params: GenerateParams) -> bytes: ...


Factory = Callable[[Settings, UpstreamMetrics], Backend]


class DemoBackend:
    """The procedural painter: deterministic from prompt and seed, no GPU, no network.

    A task that names a ``model`` has it "loaded" first when this process does not hold
    it (a pause of ``load_s``, the ``loading_model`` stage), each model taking
    :data:`DEMO_MODEL_GB` of ``KILN_MODEL_MEMORY_GB``: warm-model routing, eviction and
    the load metrics can be watched without a GPU. The picture does not depend on it.
    """

    name = "demo"
    resources: Mapping[str, int] = {"gpu": 1}

    def __init__(
        self,
        *,
        load_s: float = 0.0,
        memory_gb: float | None = None,
        max_models: int = DEFAULT_MAX_MODELS,
    ) -> None:
        self.load_s = load_s
        self.models: ModelCache[str] = ModelCache(memory_gb, max_models=max_models)

    def model_of(self, params: JSON) -> str | None:
        model = params.get("model")
        return None if model is None else str(model)

    def loaded_models(self) -> list[str]:
        return self.models.loaded_models()

    async def generate(self, ctx: Context, params: GenerateParams) -> bytes:
        if params.model is None:
            return (await demo.generate(ctx, params)).data
        async with self.models.use(ctx, params.model, self._load, size_gb=DEMO_MODEL_GB):
            return (await demo.generate(ctx, params)).data

    async def _load(self) -> str:
        await asyncio.sleep(self.load_s)
        return "loaded"


#: The memory a demo model takes, for KILN_MODEL_MEMORY_GB.
DEMO_MODEL_GB = 2.0


def _demo(settings: Settings, metrics: UpstreamMetrics) -> Backend:
    return DemoBackend(
        load_s=settings.demo_model_load_s,
        memory_gb=settings.model_memory_gb,
        max_models=settings.max_loaded_models,
    )


def _openai_images(settings: Settings, metrics: UpstreamMetrics) -> Backend:
    from kiln.backends.openai_images import OpenAIImagesBackend

    return OpenAIImagesBackend.from_settings(settings, metrics)


def _comfyui(settings: Settings, metrics: UpstreamMetrics) -> Backend:
    from kiln.backends.comfyui import ComfyUIBackend

    return ComfyUIBackend.from_settings(settings, metrics)


def _diffusers(settings: Settings, metrics: UpstreamMetrics) -> Backend:
    from kiln.backends.diffusers import DiffusersBackend

    return DiffusersBackend.from_settings(settings, metrics)


#: KILN_BACKEND names and their factories.
BACKENDS: Mapping[str, Factory] = {
    "demo": _demo,
    "openai-images": _openai_images,
    "comfyui": _comfyui,
    "diffusers": _diffusers,
}


def backend_for(name: str, settings: Settings, metrics: UpstreamMetrics | None = None) -> Backend:
    """The backend ``name`` configured from ``settings``; InvalidRequest for an unknown
    name or a backend that cannot start (a missing workflow file, say)."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise InvalidRequest(f"KILN_BACKEND must be one of {', '.join(BACKENDS)}; got {name!r}")
    return factory(settings, metrics or UpstreamMetrics(settings))


class ImageGenerate:
    """The `image.generate` handler on one backend: params in, one image output."""

    def __init__(self, backend: Backend, metrics: UpstreamMetrics) -> None:
        self.backend = backend
        self.metrics = metrics

    def model_of(self, params: JSON) -> str | None:
        """The model a task needs, as the backend names it (``model_of(params)``; None
        for a backend that holds no model of its own, as a remote API)."""
        found = getattr(self.backend, "model_of", None)
        return found(params) if callable(found) else None

    def loaded_models(self) -> list[str]:
        """The models the backend holds loaded, when it says (``loaded_models()``)."""
        loaded = getattr(self.backend, "loaded_models", None)
        return [str(model) for model in loaded()] if callable(loaded) else []

    async def __call__(self, ctx: Context, params: GenerateParams) -> Output:
        return await self.output(await self.backend.generate(ctx, params), params.format)

    @staticmethod
    async def output(data: bytes, fmt: str) -> Output:
        """The image as the task's output, re-encoded (in a thread) when not in ``fmt``."""
        if sniff(data) == fmt:
            name, content_type = OUTPUT_NAMES[fmt]
            return Output(name, data, content_type)
        return await asyncio.to_thread(as_output, data, fmt)


def as_output(data: bytes, fmt: str) -> Output:
    """The image as the task's output: its bytes as they are when already in ``fmt``,
    else decoded and encoded again."""
    name, content_type = OUTPUT_NAMES[fmt]
    if sniff(data) == fmt:
        return Output(name, data, content_type)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            encoded = encode(image, fmt)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise Retryable(
            f"the backend's image could not be decoded: {exc}", code=BAD_RESPONSE
        ) from exc
    return Output(name, encoded, content_type)


def register(
    app: Registry,
    *,
    backend: Backend | None = None,
    metrics: UpstreamMetrics | None = None,
    resources: dict[str, int] | None = None,
) -> ImageGenerate:
    """Register `image.generate` on ``app``, served by ``backend`` or else by the one
    ``app.settings.backend`` names (KILN_BACKEND; the demo by default).

    Pass the ``metrics`` a given ``backend`` was built with, so they are exposed.
    """
    metrics = metrics or UpstreamMetrics(app.settings)
    chosen = backend or backend_for(app.settings.backend, app.settings, metrics)
    batching = app.settings.generate_batch
    handler = (ImageGenerate if batching is None else BatchedImageGenerate)(chosen, metrics)
    app.task(
        demo.KIND,
        params=GenerateParams,
        resources=dict(chosen.resources) if resources is None else resources,
        review=demo.flagged_for_review,
        normalize=demo.normalize,
        model=handler.model_of,
        amounts=memory_amounts(app.settings.generate_memory),
        batch=None if batching is None else BatchPolicy(*batching, key=BATCH_KEY),
    )(handler)
    return handler


#: The params the tasks of one `image.generate` batch share: one pipeline call.
BATCH_KEY = ("model", "width", "height", "steps")


class BatchedImageGenerate(ImageGenerate):
    """`image.generate` in batches (KILN_GENERATE_BATCH): a backend with
    ``generate_batch(ctxs, params)`` makes the batch's images in one call (the diffusers
    backend: one pipeline call); another makes them one by one, at the same time."""

    async def __call__(  # type: ignore[override]
        self, ctxs: Sequence[Context], params: Sequence[GenerateParams]
    ) -> list[Output | BaseException]:
        together = getattr(self.backend, "generate_batch", None)
        made: Sequence[bytes | BaseException]
        if callable(together):
            made = await together(ctxs, params)
        else:
            made = await asyncio.gather(
                *(self._alone(c, p) for c, p in zip(ctxs, params, strict=True)),
                return_exceptions=True,
            )
        return [
            data if isinstance(data, BaseException) else await self.output(data, p.format)
            for data, p in zip(made, params, strict=True)
        ]

    async def _alone(self, ctx: Context, params: GenerateParams) -> bytes:
        """One member's picture, dropped when that member stops (a cancel, a lost lease):
        the others' go on."""
        job = asyncio.ensure_future(self.backend.generate(ctx, params))
        stop = asyncio.ensure_future(ctx.stopped())
        try:
            await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not job.done():
                job.cancel()
        return await job


def memory_amounts(rule: MemoryRule | None) -> AmountsOf | None:
    """What a task takes of a pool of memory under KILN_GENERATE_MEMORY, from its size."""
    if rule is None:
        return None

    def amounts(params: JSON) -> dict[str, int]:
        width, height = int(params.get("width", 512)), int(params.get("height", 512))
        return {rule.pool: rule.units(width, height)}

    return amounts


def collectors(app: Registry) -> list[UpstreamMetrics]:
    """The Prometheus collectors of the backends registered on ``app``."""
    return [
        kind.handler.metrics
        for kind in app.kinds.values()
        if isinstance(kind.handler, ImageGenerate)
    ]
