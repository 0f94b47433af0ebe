"""Image files for the upload and transform tests: real encodings, and crafted headers."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def picture(width: int = 40, height: int = 30, mode: str = "RGB") -> Image.Image:
    """A picture whose quadrants differ, so crops and turns can be told apart."""
    image = Image.new(mode, (width, height))
    colours = {"RGB": [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)],
               "RGBA": [(255, 0, 0, 255), (0, 255, 0, 128), (0, 0, 255, 0), (9, 9, 9, 255)],
               "L": [10, 80, 160, 240]}[mode]  # fmt: skip
    half_w, half_h = width // 2, height // 2
    boxes = [(0, 0, half_w, half_h), (half_w, 0, width, half_h),
             (0, half_h, half_w, height), (half_w, half_h, width, height)]  # fmt: skip
    for box, colour in zip(boxes, colours, strict=True):
        image.paste(colour, box)  # type: ignore[arg-type]
    return image


def encoded(image: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def png(width: int = 40, height: int = 30, mode: str = "RGB") -> bytes:
    return encoded(picture(width, height, mode), "PNG")


def jpeg(width: int = 40, height: int = 30, *, orientation: int | None = None) -> bytes:
    """A JPEG, with an EXIF orientation tag when given (6: displayed turned 90° clockwise)."""
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    return encoded(picture(width, height), "JPEG", quality=95, exif=exif.tobytes())


def webp(width: int = 40, height: int = 30) -> bytes:
    return encoded(picture(width, height, "RGBA"), "WEBP", lossless=True)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_claiming(width: int, height: int, *, padding: int = 0) -> bytes:
    """A tiny PNG whose header says width×height pixels (a decompression bomb's header).

    Its single IDAT holds a few compressed bytes (plus ``padding`` zero bytes after them,
    to make the file as long as wanted): decoding it would need width×height×3 bytes.
    """
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    data = zlib.compress(b"\x00" * 1024) + b"\x00" * padding
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", data)
        + _chunk(b"IEND", b"")
    )


def opened(data: bytes) -> Image.Image:
    """The decoded image of ``data`` (fully loaded)."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image
