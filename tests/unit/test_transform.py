"""image.transform and uploaded inputs: params, header probing, the operations, and the
handler on a real App, worker and local storage."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
from PIL import Image

import kiln
from images import jpeg, opened, picture, png, png_header_claiming, webp
from kiln import inputs, transform
from kiln.app import running
from kiln.bus import ProgressEvent
from kiln.config import Settings
from kiln.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from kiln.models import Task
from kiln.storage import open_storage
from kiln.transform import TransformParams, apply


@pytest.fixture
async def app(settings: Settings) -> AsyncIterator[kiln.App]:
    """An App serving image.transform only, on a fresh SQLite file and folder."""
    instance = kiln.App(settings=settings)
    transform.register(instance)
    async with instance:
        yield instance


async def run_one(app: kiln.App, task_id: str) -> Task:
    """Run a worker until the task is final."""
    worker = app.worker(concurrency=1, resources={})
    async with running(worker.run()):
        return await app.wait(task_id, timeout_s=30)


async def submit(app: kiln.App, data: bytes, **params: Any) -> str:
    item = await inputs.store(app.storage, "image", data, max_pixels=1_000_000)
    result = await app.submit("image.transform", params, inputs=[item])
    return result.task.id


async def output_of(app: kiln.App, task: Task) -> tuple[str, bytes]:
    assert task.status == "SUCCESS", task.error
    assert task.result is not None
    [output] = task.result["outputs"]
    return output["name"], await app.storage.get(output["key"])


# Params ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"op": "resize", "width": 1, "height": 8192},
        {"op": "thumbnail", "width": 100, "height": 100, "format": "webp"},
        {"op": "crop", "box": [0, 0, 1, 1]},
        {"op": "convert", "format": "jpeg"},
        {"op": "convert"},
    ],
)
def test_valid_params_are_accepted(params: dict[str, Any]) -> None:
    assert TransformParams.model_validate(params).model_dump(mode="json", exclude_none=True) == (
        params
    )


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"op": "rotate"},
        {"op": "resize", "width": 10},
        {"op": "thumbnail", "height": 10},
        {"op": "resize", "width": 0, "height": 10},
        {"op": "resize", "width": 8193, "height": 10},
        {"op": "crop"},
        {"op": "crop", "box": [0, 0, 10]},
        {"op": "crop", "box": [5, 0, 5, 10]},
        {"op": "crop", "box": [0, 9, 10, 2]},
        {"op": "crop", "box": [-1, 0, 10, 10]},
        {"op": "convert", "width": 10, "height": 10},
        {"op": "resize", "width": 10, "height": 10, "box": [0, 0, 1, 1]},
        {"op": "convert", "format": "gif"},
        {"op": "convert", "quality": 80},
    ],
)
def test_invalid_params_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        TransformParams.model_validate(params)


# Probing uploaded bytes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (png(40, 30), ("image/png", 40, 30)),
        (jpeg(40, 30), ("image/jpeg", 40, 30)),
        (webp(40, 30), ("image/webp", 40, 30)),
        (jpeg(40, 30, orientation=6), ("image/jpeg", 30, 40)),
    ],
    ids=["png", "jpeg", "webp", "jpeg-turned-by-exif"],
)
def test_probe_reads_type_and_displayed_size(data: bytes, expected: tuple[str, int, int]) -> None:
    header = inputs.probe(data, max_pixels=10_000)

    assert (header.content_type, header.width, header.height) == expected


def test_probe_allows_exactly_the_pixel_limit_and_refuses_one_more() -> None:
    assert inputs.probe(png(100, 100), max_pixels=10_000).width == 100
    with pytest.raises(PayloadTooLarge):
        inputs.probe(png(101, 100), max_pixels=10_000)


@pytest.mark.parametrize("limit", [40_000_000, 1_000])
def test_probe_refuses_a_bomb_header_without_decoding(limit: int) -> None:
    # 50,000×50,000 is 2.5 billion pixels: far past twice the limit (Pillow's own error)
    with pytest.raises(PayloadTooLarge):
        inputs.probe(png_header_claiming(50_000, 50_000), max_pixels=limit)
    # 1.5× the limit: past it, under twice it (Pillow would only warn)
    side = int((limit * 1.5) ** 0.5)
    with pytest.raises(PayloadTooLarge):
        inputs.probe(png_header_claiming(side, side), max_pixels=limit)


def test_probe_leaves_pillows_own_guard_as_it_found_it() -> None:
    before = Image.MAX_IMAGE_PIXELS

    inputs.probe(png(), max_pixels=5_000)
    with pytest.raises(PayloadTooLarge):
        inputs.probe(png_header_claiming(50_000, 50_000), max_pixels=5_000)

    assert before == Image.MAX_IMAGE_PIXELS


@pytest.mark.parametrize(
    "data",
    [b"", b"GIF89a" + b"\0" * 20, b"hello world, not an image", b"\x89PNG\r\n\x1a\n" + b"x" * 50,
     b"RIFF\0\0\0\0WEBPVP8 garbage", png()[:30]],
    ids=["empty", "gif", "text", "png-signature-only", "webp-signature-only", "truncated-png"],
)  # fmt: skip
def test_probe_refuses_what_is_not_a_png_jpeg_or_webp(data: bytes) -> None:
    with pytest.raises(UnsupportedMediaType):
        inputs.probe(data, max_pixels=1_000_000)


async def test_inputs_are_kept_once_under_their_sha256(tmp_path: Path) -> None:
    storage = open_storage((tmp_path / "objects").as_uri())
    data = png()

    first = await inputs.store(storage, "image", data, max_pixels=10_000)
    again = await inputs.keep(storage, data, first["sha256"])

    assert again is False
    assert [info.key async for info in storage.list("")] == [inputs.input_key(first["sha256"])]
    assert await inputs.load(storage, first) == data


# The operations -------------------------------------------------------------------------


def test_resize_gives_exactly_the_size_asked() -> None:
    result = apply(picture(40, 30), TransformParams(op="resize", width=7, height=50))

    assert result.size == (7, 50)


@pytest.mark.parametrize(
    ("box", "expected"), [((20, 20), (20, 15)), ((100, 10), (13, 10)), ((400, 300), (40, 30))]
)
def test_thumbnail_fits_inside_keeping_the_aspect_ratio(
    box: tuple[int, int], expected: tuple[int, int]
) -> None:
    result = apply(picture(40, 30), TransformParams(op="thumbnail", width=box[0], height=box[1]))

    assert result.size == expected


def test_crop_takes_the_box() -> None:
    # The picture's quadrants: red, green / blue, yellow
    result = apply(picture(40, 30), TransformParams(op="crop", box=(20, 15, 40, 30)))

    assert result.size == (20, 15)
    assert result.getpixel((0, 0)) == (255, 255, 0)


def test_a_crop_box_outside_the_input_is_refused_at_submission() -> None:
    params = TransformParams(op="crop", box=(0, 0, 41, 30))
    item = {"name": "image", "sha256": "0" * 64, "size": 1, "content_type": "image/png"}

    with pytest.raises(InvalidRequest):
        transform.check_box(params, [{**item, "width": 40, "height": 30}])
    transform.check_box(params, [{**item, "width": 41, "height": 30}])
    transform.check_box(params, [item])  # size unknown: the handler decides


# The handler on a real worker -----------------------------------------------------------


async def test_the_handler_reports_each_stage(app: kiln.App) -> None:
    # Given a submitted task, and a subscription to what is published about it
    task_id = await submit(app, png(), op="thumbnail", width=10, height=10)
    async with app.hub.subscribe(task_id=task_id) as subscription:
        # When a worker runs it
        task = await run_one(app, task_id)
        published = [subscription.queue.get_nowait() for _ in range(subscription.queue.qsize())]

    # Then its live progress went through load, transform and encode, in that order
    assert task.status == "SUCCESS"
    stages = [m.stage for m in published if isinstance(m, ProgressEvent)]
    assert list(dict.fromkeys(stages)) == ["load", "transform", "encode"]
    assert [m.progress for m in published if isinstance(m, ProgressEvent)][-1] == {
        "step": 3,
        "total": 3,
        "fraction": 1.0,
    }


@pytest.mark.parametrize(
    ("data", "params", "name", "size"),
    [
        (png(40, 30), {"op": "convert"}, "image.png", (40, 30)),
        (jpeg(40, 30), {"op": "resize", "width": 8, "height": 6}, "image.jpg", (8, 6)),
        (webp(40, 30), {"op": "thumbnail", "width": 20, "height": 20}, "image.webp", (20, 15)),
        (png(40, 30), {"op": "convert", "format": "jpeg"}, "image.jpg", (40, 30)),
    ],
    ids=["png-stays-png", "jpeg-stays-jpeg", "webp-stays-webp", "png-to-jpeg"],
)
async def test_the_output_format_defaults_to_the_inputs(
    app: kiln.App, data: bytes, params: dict[str, Any], name: str, size: tuple[int, int]
) -> None:
    task = await run_one(app, await submit(app, data, **params))

    output_name, body = await output_of(app, task)
    assert output_name == name
    assert opened(body).size == size


async def test_exif_orientation_is_applied_before_the_operation(app: kiln.App) -> None:
    # Given a 40×30 JPEG displayed turned a quarter (EXIF orientation 6): 30×40 on screen
    data = jpeg(40, 30, orientation=6)

    # When it is cropped to a box that only fits the upright picture (40 high)
    task = await run_one(app, await submit(app, data, op="crop", box=[0, 10, 30, 40]))

    # Then the crop is of the upright picture
    _, body = await output_of(app, task)
    assert opened(body).size == (30, 30)


async def test_transparency_is_laid_on_white_for_jpeg(app: kiln.App) -> None:
    # Given an RGBA PNG whose bottom-left quadrant is fully transparent
    task = await run_one(app, await submit(app, png(40, 30, "RGBA"), op="convert", format="jpeg"))

    _, body = await output_of(app, task)
    image = opened(body)
    assert image.mode == "RGB"
    assert all(channel > 240 for channel in image.getpixel((5, 25)))  # type: ignore[union-attr]


async def test_a_crop_box_outside_an_input_of_unknown_size_fails_for_good(
    app: kiln.App,
) -> None:
    # Given an input recorded without its size (a record made by hand)
    data = png(40, 30)
    item = await inputs.store(app.storage, "image", data, max_pixels=10_000)
    del item["width"], item["height"]
    submitted = await app.submit(
        "image.transform", {"op": "crop", "box": [0, 0, 50, 50]}, inputs=[item]
    )

    # When a worker runs it
    task = await run_one(app, submitted.task.id)

    # Then the first attempt fails permanently with the reason
    assert task.status == "FAILED" and task.attempt == 1
    assert task.error is not None and task.error["code"] == "box_outside_image"
    assert task.error["retryable"] is False


async def test_an_input_whose_pixels_cannot_be_decoded_fails_for_good(app: kiln.App) -> None:
    # Given a PNG with a sound 40×30 header but too little pixel data (accepted at upload)
    data = png_header_claiming(40, 30)
    assert inputs.probe(data, max_pixels=10_000).width == 40

    # When a worker runs it
    task = await run_one(app, await submit(app, data, op="convert"))

    # Then the first attempt fails for good, saying why
    assert task.status == "FAILED" and task.attempt == 1
    assert task.error is not None and task.error["code"] == "input_unreadable"


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
async def test_an_input_gone_or_changed_in_storage_fails_for_good(
    app: kiln.App, damage: str
) -> None:
    # Given a task whose stored input is then deleted or overwritten
    data = png(40, 30)
    task_id = await submit(app, data, op="convert")
    key = inputs.input_key((await app.get(task_id)).inputs[0]["sha256"])
    if damage == "missing":
        await app.storage.delete(key)
    else:
        await app.storage.put(key, png(40, 31)[: len(data)].ljust(len(data), b"\0"))

    # When a worker runs it
    task = await run_one(app, task_id)

    # Then it fails at once, saying why
    assert task.status == "FAILED" and task.attempt == 1
    assert task.error is not None and task.error["code"] == f"input_{damage}"


async def test_image_transform_without_its_input_is_refused(app: kiln.App) -> None:
    with pytest.raises(InvalidRequest, match="multipart/form-data"):
        await app.submit("image.transform", {"op": "convert"})
