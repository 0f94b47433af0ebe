"""The `diffusers` backend's models: by name, beside the default folder, within a budget.

The tests marked `diffusers` run two tiny random pipelines (``tiny_diffusers``, other
weights each) saved as sibling folders; the others check names and the size estimate on
plain files and need no torch.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
from PIL import Image
from tiny_diffusers import RecordingContext, held, make_params

import kiln
from kiln import backends
from kiln.backends.diffusers import DiffusersBackend, LoadedPipeline, weights_gb
from kiln.demo import GenerateParams
from kiln.errors import Permanent

diffusers = pytest.mark.diffusers
slow_start = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny pipelines, `tiny-a` and `tiny-b`, side by side in one folder."""
    from tiny_diffusers import save_tiny_pipeline

    root = tmp_path_factory.mktemp("models")
    save_tiny_pipeline(root / "tiny-a", seed=0)
    save_tiny_pipeline(root / "tiny-b", seed=1)
    return root


def backend_on(model_dir: Path, memory_gb: float | None = None) -> DiffusersBackend:
    return DiffusersBackend(model_dir, device="cpu", preview_every=0, memory_gb=memory_gb)


async def generate(
    backend: DiffusersBackend, params: GenerateParams
) -> tuple[RecordingContext, bytes]:
    """Run one task; its context (what it loaded) and its picture."""
    ctx = RecordingContext()
    data = await backend.generate(ctx, params)  # type: ignore[arg-type]
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (params.width, params.height)
    return ctx, data


# Names (no torch needed) --------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["/models/sd15", "/models/sd15/", "/models/x/../sd15"])
def test_the_default_model_is_named_after_its_folder(folder: str) -> None:
    backend = backend_on(Path(folder))

    assert backend.model_of({"prompt": "a kite"}) == "sd15"
    assert backend.model_of(make_params()) == "sd15"
    assert backend.folder_of("sd15") == Path("/models/sd15")


def test_a_tasks_model_is_its_name_and_a_folder_beside_the_default() -> None:
    backend = backend_on(Path("/models/sd15"))

    assert backend.model_of({"prompt": "a kite", "model": "sdxl-turbo"}) == "sdxl-turbo"
    assert backend.model_of(make_params(model="sdxl-turbo")) == "sdxl-turbo"
    assert backend.folder_of("sdxl-turbo") == Path("/models/sdxl-turbo")


async def test_a_submitted_task_records_the_model_name(settings: kiln.Settings) -> None:
    # Given an API node whose image.generate is served by the diffusers backend
    app = kiln.App(settings=settings)
    backends.register(app, backend=backend_on(Path("/models/sd15")))
    async with app:
        # When tasks are submitted with and without a model
        plain = (await app.submit("image.generate", {"prompt": "a kite"})).task
        named = (await app.submit("image.generate", {"prompt": "a kite", "model": "sdxl"})).task

    # Then each records the name its worker will route by, never a path
    assert (plain.model, named.model) == ("sd15", "sdxl")


async def test_a_model_without_a_pipeline_folder_is_model_not_found(tmp_path: Path) -> None:
    # Given a default pipeline folder with an empty folder beside it
    (tmp_path / "empty").mkdir()
    backend = backend_on(tmp_path / "default")

    # When tasks name a model with no folder, and one whose folder holds no pipeline
    for model in ("no-such-model", "empty"):
        with pytest.raises(Permanent) as raised:
            await backend.generate(RecordingContext(), make_params(model=model))  # type: ignore[arg-type]

        # Then each fails for good, with model_not_found, and nothing is loaded
        assert raised.value.code == "model_not_found"
        assert not raised.value.retryable
    assert backend.loaded_models() == []


# The size estimate (no torch needed) -----------------------------------------------------------


def write_safetensors(path: Path, dtype: str, data_bytes: int) -> None:
    """A file laid out as safetensors: a header naming one tensor, then its bytes."""
    header = json.dumps({"w": {"dtype": dtype, "shape": [data_bytes],
                               "data_offsets": [0, data_bytes]}}).encode()  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * data_bytes)


def test_the_size_counts_the_weights_a_load_reads(tmp_path: Path) -> None:
    # Given a pipeline folder whose unet has float32 safetensors beside .bin, a variant and
    # a loose checkpoint, and a text encoder of float16 safetensors
    mib = 2**20
    write_safetensors(tmp_path / "unet" / "diffusion_pytorch_model.safetensors", "F32", 8 * mib)
    write_safetensors(tmp_path / "unet" / "diffusion_pytorch_model.fp16.safetensors", "F16", mib)
    (tmp_path / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"\0" * 8 * mib)
    (tmp_path / "model.ckpt").write_bytes(b"\0" * 8 * mib)
    write_safetensors(tmp_path / "text_encoder" / "model.safetensors", "F16", 2 * mib)
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"\0" * 4 * mib)
    files = {"unet": 8 * mib, "text_encoder": 2 * mib, "vae": 4 * mib}
    headers = 2 * (8 + len(json.dumps({"w": {"dtype": "F32", "shape": [0],
                                             "data_offsets": [0, 0]}})))  # fmt: skip

    # When its size is estimated for float32, and for a float16 load
    full, half = weights_gb(tmp_path), weights_gb(tmp_path, half=True)

    # Then only the files from_pretrained reads count (safetensors first, no variants,
    # no loose checkpoints); in float16 the float32 ones count half, the float16 one whole
    assert full * 2**30 == pytest.approx(sum(files.values()) + headers, abs=64)
    assert half * 2**30 == pytest.approx(4 * mib + 2 * mib + 2 * mib + headers, abs=mib)


# Loading by name --------------------------------------------------------------------------------


@diffusers
@slow_start
async def test_tasks_run_on_the_model_they_name(models: Path) -> None:
    # Given a backend whose default is tiny-a, with tiny-b beside it
    backend = backend_on(models / "tiny-a")

    # When one task names no model and another names tiny-b, with the same params
    default, default_data = await generate(backend, make_params(steps=2))
    other, other_data = await generate(backend, make_params(steps=2, model="tiny-b"))
    again, again_data = await generate(backend, make_params(steps=2, model="tiny-a"))

    # Then each loaded its model once, by name, and tiny-b (other weights) drew another picture
    assert (default.loads, other.loads, again.loads) == (["tiny-a"], ["tiny-b"], [])
    assert other_data != default_data
    assert again_data == default_data
    # And the backend holds both, least recently used first
    assert backend.loaded_models() == ["tiny-b", "tiny-a"]


@diffusers
@slow_start
async def test_with_room_for_one_model_the_other_is_unloaded(models: Path) -> None:
    # Given a memory budget that holds one tiny pipeline but not two
    size_gb = weights_gb(models / "tiny-a")
    backend = backend_on(models / "tiny-a", memory_gb=1.5 * size_gb)
    await generate(backend, make_params(steps=1))
    first = await held(backend, "tiny-a")

    # When a task needs tiny-b
    ctx, _ = await generate(backend, make_params(steps=1, model="tiny-b"))

    # Then tiny-a was unloaded first (its pipeline dropped), and only tiny-b is held
    assert ctx.loads == ["tiny-b"]
    assert backend.loaded_models() == ["tiny-b"]
    assert backend.models.evictions == 1
    assert first.pipe is None
    # And a task on tiny-a loads it again, in place of tiny-b
    back, _ = await generate(backend, make_params(steps=1))
    assert back.loads == ["tiny-a"] and backend.loaded_models() == ["tiny-a"]


@diffusers
async def test_unloading_a_cuda_pipeline_gives_its_memory_back_to_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    # Given a backend with room for one model, holding a pipeline on CUDA
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    backend = backend_on(Path("/models/a"), memory_gb=1.0)
    on_cuda = LoadedPipeline(pipe=object(), device="cuda")

    async def load_on_cuda() -> LoadedPipeline:
        return on_cuda

    async def load_another() -> LoadedPipeline:
        return LoadedPipeline(pipe=object(), device="cuda")

    ctx = RecordingContext()
    async with backend.models.use(ctx, "a", load_on_cuda, size_gb=1.0):  # type: ignore[arg-type]
        pass

    # When another model needs the room
    async with backend.models.use(ctx, "b", load_another, size_gb=1.0):  # type: ignore[arg-type]
        pass

    # Then the first pipeline was dropped and the CUDA cache emptied
    assert on_cuda.pipe is None
    assert emptied == [True]
    assert backend.loaded_models() == ["b"]
