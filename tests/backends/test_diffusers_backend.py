"""The `diffusers` backend on a tiny random pipeline saved to a folder and loaded back.

Tests marked `diffusers` need torch and the `diffusers` extra (``make test-diffusers``
installs both, CPU torch); torch is imported only inside them, so ``make test`` collects
this file without it. The others check the settings and need neither.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from PIL import Image
from tiny_diffusers import RecordingContext, held, make_params

import kiln
from kiln import backends
from kiln.app import running
from kiln.backends.diffusers import DiffusersBackend, gpu_errors, load_pipeline
from kiln.backends.upstream import UpstreamMetrics, sniff
from kiln.bus import ProgressEvent
from kiln.config import Settings
from kiln.demo import GenerateParams
from kiln.errors import ConfigError, InvalidRequest, Permanent, Retryable
from kiln.models import StoredOutput
from kiln.states import Status
from kiln.storage import verify

diffusers = pytest.mark.diffusers
#: Loading torch and building the pipeline takes a while on a busy CI machine.
slow_start = pytest.mark.timeout(300)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline, saved once per run with save_pretrained."""
    from tiny_diffusers import save_tiny_pipeline

    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny-sd") / "pipeline")


def backend_on(model_dir: Path, *, preview_every: int = 0) -> DiffusersBackend:
    return DiffusersBackend(model_dir, device="cpu", preview_every=preview_every)


async def generate(backend: DiffusersBackend, params: GenerateParams) -> bytes:
    return await backend.generate(RecordingContext(), params)  # type: ignore[arg-type]


# Loading -----------------------------------------------------------------------------------


@diffusers
@slow_start
def test_saved_pipeline_loads_back_on_the_cpu_in_float32(model_dir: Path) -> None:
    # Given a pipeline saved to a folder / When it is loaded
    loaded = load_pipeline(model_dir, "cpu")

    # Then it is a Stable Diffusion pipeline on the CPU in float32
    import torch
    from diffusers import StableDiffusionPipeline

    assert isinstance(loaded.pipe, StableDiffusionPipeline)
    assert loaded.device == "cpu"
    assert loaded.pipe.unet.dtype == torch.float32


@diffusers
@slow_start
async def test_a_backend_loads_its_model_once_for_all_its_tasks(model_dir: Path) -> None:
    # Given a backend that has loaded nothing
    backend = backend_on(model_dir)
    first, second = RecordingContext(), RecordingContext()

    # When two tasks run on it, one after the other
    await backend.generate(first, make_params(steps=1))  # type: ignore[arg-type]
    await backend.generate(second, make_params(steps=1, seed=8))  # type: ignore[arg-type]

    # Then the first loaded the default model, named after its folder; the second found it
    assert first.loads == [model_dir.name] and second.loads == []
    assert backend.loaded_models() == [model_dir.name]


async def test_folder_without_a_pipeline_is_model_not_found(tmp_path: Path) -> None:
    # Given a backend on a folder that holds no model_index.json
    backend = backend_on(tmp_path / "nowhere")

    # When it generates / Then it fails for good, saying the model was not found
    with pytest.raises(Permanent) as raised:
        await generate(backend, make_params())
    assert raised.value.code == "model_not_found"
    assert not raised.value.retryable


# Generating --------------------------------------------------------------------------------


@diffusers
@slow_start
async def test_generates_an_image_with_progress_for_each_step(model_dir: Path) -> None:
    # Given the backend with a preview every 2 steps
    backend = backend_on(model_dir, preview_every=2)
    ctx = RecordingContext()

    # When it generates a 64×64 PNG in 4 steps
    data = await backend.generate(ctx, make_params(steps=4))  # type: ignore[arg-type]

    # Then the PNG has the asked size, and each step reported n of 4 with a preview at 2
    assert sniff(data) == "png"
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (64, 64)
    assert [(step, total, stage) for step, total, stage, _ in ctx.reports] == [
        (n, 4, "denoise") for n in range(1, 5)
    ]
    previews = [shown for *_, shown in ctx.reports]
    assert previews[0] is None and previews[2] is None and previews[3] is None
    assert previews[1] is not None and previews[1].startswith("data:image/jpeg;base64,")


@diffusers
@slow_start
async def test_same_seed_gives_same_bytes_and_another_seed_other_bytes(model_dir: Path) -> None:
    backend = backend_on(model_dir)

    first = await generate(backend, make_params(seed=11, steps=2))
    again = await generate(backend, make_params(seed=11, steps=2))
    other = await generate(backend, make_params(seed=12, steps=2))

    assert first == again
    assert other != first


@diffusers
@slow_start
@pytest.mark.parametrize("fmt", ["webp", "jpeg"])
async def test_encodes_the_asked_format(model_dir: Path, fmt: str) -> None:
    data = await generate(backend_on(model_dir), make_params(steps=1, format=fmt))

    assert sniff(data) == fmt


@diffusers
@slow_start
async def test_cancel_stops_the_run_at_the_next_step(model_dir: Path) -> None:
    # Given a long run that has reported its first step
    backend = backend_on(model_dir)
    ctx = RecordingContext()
    ctx.on_report = asyncio.Event()
    run = asyncio.create_task(backend.generate(ctx, make_params(steps=50)))  # type: ignore[arg-type]
    await asyncio.wait_for(ctx.on_report.wait(), timeout=60)

    # When the task is cancelled
    run.cancel()

    # Then the run ends cancelled, its thread stopped within a step, the pipeline is free
    with pytest.raises(asyncio.CancelledError):
        await run
    assert len(ctx.reports) < 50
    loaded = await held(backend, model_dir.name)
    assert loaded.lock.acquire(blocking=False)
    loaded.lock.release()


# GPU memory and devices --------------------------------------------------------------------


def skip_without_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device here")


@diffusers
def test_running_out_of_gpu_memory_is_retryable() -> None:
    import torch

    with pytest.raises(Retryable) as raised, gpu_errors():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    assert raised.value.code == "gpu_out_of_memory"
    assert "Tried to allocate 20.00 GiB" in str(raised.value)


@diffusers
def test_cuda_asked_on_a_worker_without_a_gpu_is_retryable(model_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    with pytest.raises(Retryable) as raised:
        load_pipeline(model_dir, "cuda")
    assert raised.value.code == "device_unavailable"


@diffusers
@pytest.mark.gpu
@slow_start
async def test_on_a_gpu_auto_runs_the_pipeline_in_float16(model_dir: Path) -> None:
    skip_without_cuda()
    import torch

    # Given a GPU / When the backend on device auto generates
    backend = DiffusersBackend(model_dir, device="auto", preview_every=2)
    ctx = RecordingContext()
    data = await backend.generate(ctx, make_params(steps=4))  # type: ignore[arg-type]
    again = await generate(backend, make_params(steps=4))

    # Then the pipeline is on CUDA in float16, and it made the image step by step
    loaded = await held(backend, model_dir.name)
    assert loaded.device == "cuda"
    assert loaded.pipe.unet.dtype == torch.float16
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (64, 64)
    assert [step for step, *_ in ctx.reports] == [1, 2, 3, 4]
    assert ctx.reports[1][3] is not None
    assert again == data


@diffusers
@pytest.mark.gpu
def test_a_real_gpu_allocation_failure_is_retryable() -> None:
    skip_without_cuda()
    import torch

    with pytest.raises(Retryable) as raised, gpu_errors():
        torch.empty(2**50, dtype=torch.uint8, device="cuda")  # a pebibyte

    assert raised.value.code == "gpu_out_of_memory"


# Through the engine ------------------------------------------------------------------------


def diffusers_settings(settings: Settings, model_dir: Path) -> Settings:
    return settings.with_(
        backend="diffusers",
        diffusers_model_dir=model_dir,
        diffusers_device="cpu",
        diffusers_preview_every=1,
    )


async def run_to_the_end(
    app: kiln.App, params: dict[str, object]
) -> tuple[kiln.Task, list[ProgressEvent]]:
    """Submit one `image.generate` task, run a worker until it is final; its progress too."""
    task_id = (await app.submit("image.generate", params, max_attempts=2)).task.id
    progress: list[ProgressEvent] = []

    async def follow() -> None:
        async for message in app.watch(task_id):
            if isinstance(message, ProgressEvent):
                progress.append(message)

    worker = app.worker(concurrency=1, resources={"gpu": 1}, idle_poll_s=(0.01, 0.05))
    async with running(worker.run()):
        await asyncio.wait_for(follow(), timeout=240)
    return await app.get(task_id), progress


@diffusers
@slow_start
async def test_worker_runs_a_task_on_the_pipeline_folder(
    settings: Settings, model_dir: Path
) -> None:
    # Given an app whose image.generate is served by KILN_BACKEND=diffusers on the folder
    app = kiln.App(settings=diffusers_settings(settings, model_dir))
    backends.register(app)
    async with app:
        # When a worker runs a 3-step task
        params = {"prompt": "a red kite", "width": 64, "height": 64, "steps": 3, "seed": 5}
        done, progress = await run_to_the_end(app, params)

        # Then it is SUCCESS with a verified 64×64 PNG, after progress 1/3, 2/3, 3/3
        assert done.status is Status.SUCCESS, done.error
        assert done.result is not None
        outputs = [StoredOutput.from_json(o) for o in done.result["outputs"]]
        assert [o.name for o in outputs] == ["image.png"]
        assert await verify(app.storage, outputs[0])
        with Image.open(io.BytesIO(await app.storage.get(outputs[0].key))) as image:
            assert image.size == (64, 64)
    steps = [(e.progress["step"], e.progress["total"]) for e in progress if e.progress]
    assert steps == [(1, 3), (2, 3), (3, 3)]
    # (the app's backend is new, so the task loaded the pipeline first)
    assert next(e.stage for e in progress) == "loading_model"
    assert {e.stage for e in progress} == {"loading_model", "denoise"}
    assert any(e.preview for e in progress)
    # And a worker of this process lists the pipeline, by its folder's name, as loaded
    assert app.worker(concurrency=1).presence().models == (model_dir.name,)


@diffusers
@slow_start
async def test_the_first_task_loads_the_pipeline_as_its_loading_model_stage(
    settings: Settings, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a process that has loaded no pipeline yet (a backend holds its own)
    app = kiln.App(settings=diffusers_settings(settings, model_dir))
    backends.register(app)
    stages: list[str | None] = []
    publish = app.engine.publish_progress

    def published(event: ProgressEvent) -> None:  # every live progress, as streams get it
        stages.append(event.stage)
        publish(event)

    monkeypatch.setattr(app.engine, "publish_progress", published)
    async with app:
        # When a worker runs a task
        params = {"prompt": "a red kite", "width": 64, "height": 64, "steps": 2, "seed": 5}
        task_id = (await app.submit("image.generate", params)).task.id
        worker = app.worker(concurrency=1, resources={"gpu": 1}, idle_poll_s=(0.01, 0.05))
        async with running(worker.run()):
            done = await app.wait(task_id, timeout_s=240)
    # Then it loaded the pipeline first, as its own stage, and the load was timed once
    assert done.status is Status.SUCCESS, done.error
    assert stages[0] == "loading_model" and "denoise" in stages
    assert worker.model_loads.by_model[model_dir.name].count == 1
    assert worker.model_loads.by_model[model_dir.name].total_s > 0


@diffusers
@slow_start
async def test_task_on_a_missing_folder_fails_permanently(
    settings: Settings, tmp_path: Path
) -> None:
    # Given KILN_BACKEND=diffusers on a folder that does not exist
    app = kiln.App(settings=diffusers_settings(settings, tmp_path / "no-such-model"))
    backends.register(app)
    async with app:
        # When a worker runs a task
        done, _ = await run_to_the_end(app, {"prompt": "a red kite", "width": 64, "height": 64})

    # Then it failed on its first attempt, for good, with model_not_found
    assert done.status is Status.FAILED
    assert done.attempt == 1
    assert done.error is not None
    assert done.error["code"] == "model_not_found"
    assert done.error["retryable"] is False


# Settings (no torch needed) -----------------------------------------------------------------


def test_settings_read_the_diffusers_variables() -> None:
    settings = Settings.from_env(
        {
            "KILN_BACKEND": "diffusers",
            "KILN_DIFFUSERS_MODEL_DIR": "/models/sd15",
            "KILN_DIFFUSERS_DEVICE": "CUDA",
            "KILN_DIFFUSERS_PREVIEW_EVERY": "0",
        }
    )

    assert settings.backend == "diffusers"
    assert settings.diffusers_model_dir == Path("/models/sd15")
    assert settings.diffusers_device == "cuda"
    assert settings.diffusers_preview_every == 0


def test_diffusers_defaults_are_auto_device_and_a_preview_every_5_steps() -> None:
    settings = Settings.from_env({})

    assert settings.diffusers_model_dir is None
    assert settings.diffusers_device == "auto"
    assert settings.diffusers_preview_every == 5


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KILN_DIFFUSERS_DEVICE", "tpu"),
        ("KILN_DIFFUSERS_PREVIEW_EVERY_STEPS", "-1"),
        ("KILN_DIFFUSERS_PREVIEW_EVERY", "often"),
    ],
)
def test_bad_diffusers_settings_are_refused(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: value})


def test_diffusers_backend_needs_a_model_folder(settings: Settings) -> None:
    with pytest.raises(InvalidRequest, match="KILN_DIFFUSERS_MODEL_DIR"):
        backends.backend_for("diffusers", settings, UpstreamMetrics())
