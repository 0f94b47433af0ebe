"""The built-in `image.transform` kind: resize, thumbnail, crop or convert an uploaded image.

The task is submitted as ``multipart/form-data`` with one file part, ``image`` (API.md,
"Uploads"). The handler reads that input from storage by its recorded sha256 (and checks
it), decodes it with Pillow under the pixel limit, applies the operation and encodes the
result as ``image.png``, ``image.webp`` or ``image.jpg``. EXIF orientation is applied
first, so sizes and crop boxes are those of the picture as it is displayed.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Literal, Self

from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln import inputs
from kiln.demo import OUTPUT_NAMES
from kiln.errors import InvalidRequest, KilnError, Permanent
from kiln.kinds import Handler, Registry
from kiln.models import JSON, Output
from kiln.paint import encode

if TYPE_CHECKING:
    from kiln.worker import Context

__all__ = [
    "KIND",
    "SHEET",
    "SheetParams",
    "TransformParams",
    "apply",
    "check_sheet_size",
    "outputs_of",
    "register",
    "sheet",
]

KIND = "image.transform"
INPUT = "image"
#: A contact sheet of many pictures: a pipeline's fan-in (docs/pipelines.md).
SHEET = "image.contact_sheet"
SHEET_INPUT = "images"
FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/webp": "webp"}
STAGES = ("load", "transform", "encode")

Side = Annotated[int, Field(ge=1, le=8192)]
Coordinate = Annotated[int, Field(ge=0)]


class TransformParams(BaseModel):
    """Parameters of an `image.transform` task (API.md)."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["resize", "thumbnail", "crop", "convert"]
    width: Side | None = None
    height: Side | None = None
    box: tuple[Coordinate, Coordinate, Coordinate, Coordinate] | None = Field(
        default=None, description="[left, top, right, bottom] in pixels, for crop"
    )
    format: Literal["png", "webp", "jpeg"] | None = Field(
        default=None, description="default: the input's format"
    )

    @model_validator(mode="after")
    def _fits_the_op(self) -> Self:
        sized = self.op in ("resize", "thumbnail")
        if sized and (self.width is None or self.height is None):
            raise ValueError(f"{self.op} needs width and height")
        if not sized and (self.width is not None or self.height is not None):
            raise ValueError(f"width and height apply to resize and thumbnail, not {self.op}")
        if self.op == "crop":
            if self.box is None:
                raise ValueError("crop needs box: [left, top, right, bottom]")
            left, top, right, bottom = self.box
            if right <= left or bottom <= top:
                raise ValueError("box must have right > left and bottom > top")
        elif self.box is not None:
            raise ValueError(f"box applies to crop, not {self.op}")
        return self


def box_error(box: tuple[int, int, int, int], width: int, height: int) -> str | None:
    """Why the crop box does not fit a width×height picture, or None when it does."""
    if box[2] > width or box[3] > height:
        return f"box {list(box)} is outside the {width}×{height} image"
    return None


def check_box(params: TransformParams, items: list[JSON]) -> None:
    """At submission, when the input's size is known: a crop box outside it is refused."""
    if params.op != "crop" or params.box is None:
        return
    for item in items:
        width, height = item.get("width"), item.get("height")
        if item["name"] == INPUT and isinstance(width, int) and isinstance(height, int):
            problem = box_error(params.box, width, height)
            if problem:
                detail = {"loc": ["params", "box"], "msg": problem, "type": "box_outside_image"}
                raise InvalidRequest(problem, details=[detail])


def upright(image: Image.Image) -> Image.Image:
    """The decoded picture as displayed (EXIF orientation applied), in a mode the
    operations and encoders handle (RGB, RGBA, L or LA)."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGB", "RGBA", "L", "LA"):
        return image
    transparent = "A" in image.getbands() or "transparency" in image.info
    return image.convert("RGBA" if transparent else "RGB")


def apply(image: Image.Image, params: TransformParams) -> Image.Image:
    """The operation of ``params`` on a decoded, upright picture."""
    if params.op == "resize":
        assert params.width is not None and params.height is not None
        return image.resize((params.width, params.height), Image.Resampling.LANCZOS)
    if params.op == "thumbnail":
        assert params.width is not None and params.height is not None
        fitted = image.copy()
        fitted.thumbnail((params.width, params.height), Image.Resampling.LANCZOS)
        return fitted
    if params.op == "crop":
        assert params.box is not None
        problem = box_error(params.box, *image.size)
        if problem:
            raise Permanent(problem, code="box_outside_image")
        return image.crop(params.box)
    return image


def encoded(image: Image.Image, fmt: str) -> bytes:
    """The picture as ``fmt`` bytes; transparency is laid on white for JPEG."""
    if fmt == "jpeg" and image.mode in ("RGBA", "LA"):
        background = Image.new("RGB", image.size, "white")
        background.paste(image.convert("RGBA"), mask=image.getchannel("A"))
        image = background
    elif fmt == "webp" and image.mode == "LA":
        image = image.convert("RGBA")
    return encode(image, fmt)


def make_handler(app: Registry) -> Handler:
    """The handler, reading inputs from ``app``'s storage under its pixel limit."""

    async def transform(ctx: Context, params: TransformParams) -> Output:
        item = inputs.named(ctx.task.inputs, INPUT)
        total = len(STAGES)
        await ctx.progress(0, total, stage="load")
        data = await inputs.load(app.storage, item)
        try:
            lazy = inputs.open_image(data, app.settings.max_image_pixels)
        except KilnError as exc:  # over the pixel limit, or not an image: for good
            raise Permanent(exc.message, code=exc.code) from None
        try:
            picture = await asyncio.to_thread(upright, lazy)
        except (OSError, SyntaxError, ValueError) as exc:  # a header fine, the pixels not
            raise Permanent(
                f"the input cannot be decoded: {exc}", code="input_unreadable"
            ) from None
        await ctx.progress(1, total, stage="transform")
        result = await asyncio.to_thread(apply, picture, params)
        await ctx.progress(2, total, stage="encode")
        fmt = params.format or FORMATS[str(item["content_type"])]
        name, content_type = OUTPUT_NAMES[fmt]
        body = await asyncio.to_thread(encoded, result, fmt)
        await ctx.progress(total, total, stage="encode")
        return Output(name, body, content_type)

    return transform


class SheetParams(BaseModel):
    """Parameters of an `image.contact_sheet` task: tiles of ``tile`` pixels, ``columns``
    a row."""

    model_config = ConfigDict(extra="forbid")

    columns: Annotated[int, Field(ge=1, le=20)] = 5
    tile: Annotated[int, Field(ge=16, le=1024)] = 128


def sheet_size(params: SheetParams, count: int) -> tuple[int, int]:
    """The width and height of the sheet of ``count`` pictures."""
    columns = min(params.columns, count)
    rows = -(-count // columns)
    return columns * params.tile, rows * params.tile


def sheet_problem(params: SheetParams, count: int, max_pixels: int) -> str | None:
    """Why a sheet of ``count`` pictures is too large for ``max_pixels``, or None."""
    width, height = sheet_size(params, max(count, 1))
    if width * height <= max_pixels:
        return None
    return (
        f"a contact sheet of {count} images in tiles of {params.tile} pixels, "
        f"{min(params.columns, count)} a row, is {width}×{height} = {width * height} pixels, "
        f"more than KILN_MAX_IMAGE_PIXELS ({max_pixels}): use a smaller tile or fewer images"
    )


def check_sheet_size(kind: str, params: JSON, count: int, max_pixels: int) -> None:
    """At submission, when the number of pictures is known (a pipeline step reading the
    outputs of kiln's own image kinds, or inputs given with the task): a sheet over the
    pixel limit is refused, with the size it would have."""
    if kind != SHEET:
        return
    problem = sheet_problem(SheetParams.model_validate(params), count, max_pixels)
    if problem:
        detail = {"loc": ["params", "tile"], "msg": problem, "type": "sheet_too_large"}
        raise InvalidRequest(problem, details=[detail])


def sheet(pictures: list[Image.Image], params: SheetParams) -> Image.Image:
    """The pictures as thumbnails on a white grid, in order, ``columns`` a row."""
    columns = min(params.columns, len(pictures))
    canvas = Image.new("RGB", sheet_size(params, len(pictures)), "white")
    for index, picture in enumerate(pictures):
        tile = upright(picture).convert("RGB")
        tile.thumbnail((params.tile, params.tile), Image.Resampling.LANCZOS)
        x, y = (index % columns) * params.tile, (index // columns) * params.tile
        canvas.paste(tile, (x, y))
    return canvas


def make_sheet_handler(app: Registry) -> Handler:
    """The `image.contact_sheet` handler: every input named ``images``, one PNG."""

    async def contact_sheet(ctx: Context, params: SheetParams) -> Output:
        items = [item for item in ctx.task.inputs if item.get("name") == SHEET_INPUT]
        if not items:
            raise Permanent("the task has no input 'images'", code="input_missing")
        problem = sheet_problem(params, len(items), app.settings.max_image_pixels)
        if problem:  # known only now: a fan-in of outputs whose number the submit did not know
            raise Permanent(problem, code="sheet_too_large")
        pictures = []
        for index, item in enumerate(items):
            await ctx.progress(index, len(items) + 1, stage="load")
            data = await inputs.load(app.storage, item)
            try:
                pictures.append(inputs.open_image(data, app.settings.max_image_pixels))
            except KilnError as exc:
                raise Permanent(exc.message, code=exc.code) from None
        result = await asyncio.to_thread(sheet, pictures, params)
        body = await asyncio.to_thread(encode, result, "png")
        await ctx.progress(len(items) + 1, len(items) + 1, stage="encode")
        return Output("image.png", body, "image/png")

    return contact_sheet


def outputs_of(kind: str, params: JSON, read: list[str]) -> set[str] | None:
    """The output names of kiln's own image kinds (what a pipeline's references are
    checked against at submit); None for any other kind."""
    names = {name for name, _ in OUTPUT_NAMES.values()}
    if kind == "image.generate":
        return {OUTPUT_NAMES[str(params.get("format", "png"))][0]}
    if kind == SHEET:
        return {"image.png"}
    if kind != KIND:
        return None
    if params.get("format"):
        return {OUTPUT_NAMES[str(params["format"])][0]}
    same = {name for name in read if name in names}  # the input's format
    return same if len(read) == 1 and same else None


def register(app: Registry) -> None:
    """Register `image.transform` on ``app`` (one input, ``image``) and
    `image.contact_sheet` (inputs named ``images``, any number); no resource slot."""
    app.task(KIND, params=TransformParams, inputs=(INPUT,), check=check_box)(make_handler(app))

    def check_sheet(params: SheetParams, items: list[JSON]) -> None:
        count = sum(1 for item in items if item["name"] == SHEET_INPUT)
        limit = app.settings.max_image_pixels
        check_sheet_size(SHEET, params.model_dump(), count, limit)

    app.task(SHEET, params=SheetParams, inputs=(SHEET_INPUT,), check=check_sheet)(
        make_sheet_handler(app)
    )
