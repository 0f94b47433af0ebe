"""Uploaded inputs: what their bytes are, and where they are kept.

An input is kept once per content, under ``inputs/<sha256[:2]>/<sha256>``, whatever the
number of tasks that use it; a task records ``{"name", "content_type", "size", "sha256"}``
per input (plus ``width`` and ``height`` for images, which the API does not show).

Only PNG, JPEG and WebP are accepted, recognised from the bytes, and an image's size is
read from its header before anything is decoded, so a decompression bomb is refused
without ever being expanded.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from kiln.errors import (
    InvalidRequest,
    PayloadTooLarge,
    Permanent,
    StoreUnavailable,
    UnsupportedMediaType,
)
from kiln.models import JSON
from kiln.storage import Storage, sha256_hex
from kiln.store import Deletion, Store
from kiln.store.inputs import KnownObject

log = logging.getLogger("kiln.inputs")

INPUTS_PREFIX = "inputs/"
#: How long an upload waits for a deletion of the same content to end.
HOLD_WAIT_S = 10.0
HOLD_POLL_S = 0.2
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp")
#: Pillow's format names → the content type; camera JPEGs open as MPO.
PILLOW_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "WEBP": "image/webp"}
#: The only decoders Pillow may try on uploaded bytes.
PILLOW_FORMATS = ("PNG", "JPEG", "WEBP")
#: Bytes needed to tell the three formats apart (WebP's signature ends at byte 12).
SNIFF_BYTES = 12
#: An input named by its content instead of sent: ``sha256:`` and 64 hex digits.
REFERENCE_PREFIX = "sha256:"
REFERENCE_PATTERN = r"^sha256:[0-9a-fA-F]{64}$"
_REFERENCE = re.compile(REFERENCE_PATTERN)
#: EXIF orientations that turn the picture by 90 or 270 degrees.
_QUARTER_TURNS = frozenset({5, 6, 7, 8})
_ORIENTATION_TAG = 0x0112


def sniff(head: bytes) -> str | None:
    """The content type the first bytes announce (magic numbers), or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """What an image's header says: its type and its size as displayed."""

    content_type: str
    width: int
    height: int


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """The image, opened lazily (header only): refused past ``max_pixels`` before any decoding.

    Raises UnsupportedMediaType when the bytes are not a PNG, JPEG or WebP image, and
    PayloadTooLarge when it has more than ``max_pixels`` pixels.
    """
    # Pillow's own guard, set to our limit while it opens the file: past the limit Image.open
    # warns, past twice it raises; the warning is made an error, so either way nothing that
    # large is ever opened. (Set and put back with no await in between: this runs whole.)
    guard = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=PILLOW_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise PayloadTooLarge(f"the image has more than {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError):
        raise UnsupportedMediaType("the file is not a readable PNG, JPEG or WebP image") from None
    finally:
        Image.MAX_IMAGE_PIXELS = guard
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLarge(f"the image has {width}×{height} pixels, more than {max_pixels}")
    return image


def probe(data: bytes, max_pixels: int) -> ImageHeader:
    """Type and displayed size of an uploaded image, without decoding its pixels.

    The type is read from the magic numbers and confirmed by Pillow's header parser; both
    must agree. Raises UnsupportedMediaType or PayloadTooLarge as :func:`open_image` does.
    """
    announced = sniff(data[:SNIFF_BYTES])
    if announced is None:
        raise UnsupportedMediaType("the file is not a PNG, JPEG or WebP image")
    image = open_image(data, max_pixels)
    if PILLOW_TYPES.get(image.format or "") != announced:
        raise UnsupportedMediaType("the file's header does not match its content")
    width, height = image.size
    if orientation(image) in _QUARTER_TURNS:
        width, height = height, width
    return ImageHeader(announced, width, height)


def orientation(image: Image.Image) -> int:
    """The EXIF orientation found in the header (1, upright, when there is none).

    Only EXIF data already read with the header counts: nothing is decoded to look for it.
    """
    raw = image.info.get("exif")
    if not isinstance(raw, bytes):
        return 1
    exif = Image.Exif()
    try:
        exif.load(raw)
    except (SyntaxError, ValueError, OSError, struct.error):
        return 1
    value = exif.get(_ORIENTATION_TAG, 1)
    return value if isinstance(value, int) else 1


def input_key(sha256: str) -> str:
    """Where the input with this sha256 is kept."""
    return f"{INPUTS_PREFIX}{sha256[:2]}/{sha256}"


def record(name: str, data: bytes, header: ImageHeader, sha256: str | None = None) -> JSON:
    """The task's record of one input."""
    return {
        "name": name,
        "content_type": header.content_type,
        "size": len(data),
        "sha256": sha256 or sha256_hex(data),
        "width": header.width,
        "height": header.height,
    }


async def keep(storage: Storage, data: bytes, sha256: str) -> bool:
    """Store the input unless it is already there; True when this call wrote it."""
    key = input_key(sha256)
    found = await storage.stat(key)
    if found is not None and found.size == len(data):
        return False
    await storage.put(key, data)
    return True


async def store(storage: Storage, name: str, data: bytes, *, max_pixels: int) -> JSON:
    """Check an image and keep it: the record to pass in ``App.submit(..., inputs=[...])``."""
    item = record(name, data, probe(data, max_pixels))
    await keep(storage, data, item["sha256"])
    return item


async def load(storage: Storage, item: JSON) -> bytes:
    """The bytes of a recorded input, checked against its size and sha256.

    An input that is missing or does not match fails the attempt for good (``input_missing``,
    ``input_corrupt``): another attempt would read the same object. A record with a ``key``
    names an object kept elsewhere (an output of another task, passed by reference); any
    other is read from ``inputs/`` by its sha256.
    """
    sha256 = str(item["sha256"])
    key = str(item.get("key") or input_key(sha256))
    missing = Permanent(
        f"input {item['name']!r} is missing from storage: upload it again", code="input_missing"
    )
    if await storage.stat(key) is None:  # every backend answers a missing object here
        raise missing
    try:
        data = await storage.get(key)
    except FileNotFoundError:
        raise missing from None
    if len(data) != item["size"] or sha256_hex(data) != sha256:
        raise Permanent(f"input {item['name']!r} does not match its sha256", code="input_corrupt")
    return data


def named(inputs: Sequence[JSON], name: str) -> JSON:
    """The task's input called ``name``."""
    for item in inputs:
        if item.get("name") == name:
            return item
    raise Permanent(f"the task has no input {name!r}", code="input_missing")


@dataclass(frozen=True, slots=True)
class Held:
    """Inputs an upload holds (pinned in the store), and those it wrote itself."""

    sha256s: tuple[str, ...]
    written: tuple[str, ...]


async def hold(store: Store, storage: Storage, files: Sequence[tuple[str, bytes]]) -> Held:
    """Pin each input (by sha256) in the store, then make sure its object is there: written
    when the store did not know it, when its object is missing, or after a deletion of the
    same content ended. Retention never deletes a pinned input; release with
    :func:`release` once the task is submitted (or refused)."""
    data = dict(files)
    pending = sorted(data)
    pinned: list[str] = []
    written: list[str] = []
    deadline = asyncio.get_running_loop().time() + HOLD_WAIT_S
    while pending:
        pins = await store.inputs.pin(pending)
        for sha256 in (s for s in pending if s not in pins.busy):
            pinned.append(sha256)
            if sha256 in pins.write:
                await storage.put(input_key(sha256), data[sha256])
                written.append(sha256)
            elif await keep(storage, data[sha256], sha256):
                written.append(sha256)
        pending = sorted(pins.busy)
        if pending and asyncio.get_running_loop().time() > deadline:
            await release(store, storage, Held(tuple(pinned), tuple(written)), drop=True)
            raise StoreUnavailable("an input of this request is being deleted; try again")
        if pending:
            await asyncio.sleep(HOLD_POLL_S)  # a deletion takes one object delete
    return Held(tuple(pinned), tuple(written))


async def release(store: Store, storage: Storage, held: Held, *, drop: bool = False) -> None:
    """Unpin what :func:`hold` pinned. ``drop``: the request was refused, so the inputs it
    wrote go again at once, unless a task or another upload uses them by now."""
    await store.inputs.unpin(held.sha256s)
    if drop and held.written:
        deletion = await store.inputs.claim_unused(used_before=0.0, among=held.written)
        await delete(store, storage, deletion)


async def delete(store: Store, storage: Storage, deletion: Deletion) -> int:
    """Delete the objects of inputs the store marked for deletion, then forget them; an
    object that will not go keeps its mark, and a later pass takes it over."""
    gone: list[str] = []
    for sha256 in deletion.sha256s:
        try:
            await storage.delete(input_key(sha256))
        except Exception:
            log.warning("input_delete_failed", extra={"sha256": sha256}, exc_info=True)
            continue
        gone.append(sha256)
    await store.inputs.forget(deletion, gone)
    return len(gone)


# Inputs by reference ------------------------------------------------------------------------


def reference(data: bytes) -> str:
    """The reference that names these bytes as an input: ``sha256:<hex>``."""
    return REFERENCE_PREFIX + sha256_hex(data)


def referenced(value: str) -> str:
    """The sha256 (lower case hex) a reference names; InvalidRequest when it is not one."""
    if not isinstance(value, str) or not _REFERENCE.match(value):
        raise InvalidRequest(f"{value!r} is not a reference: give sha256: and 64 hex digits")
    return value[len(REFERENCE_PREFIX) :].lower()


def unknown_reference(name: str, sha256: str) -> InvalidRequest:
    return InvalidRequest(
        f"the input {name!r} names sha256:{sha256}, which is neither an upload nor an output "
        "of this tenant's tasks: upload the file instead",
        details=[{"loc": ["inputs", name], "msg": "unknown content", "type": "reference"}],
    )


async def refer(
    store: Store,
    storage: Storage,
    tenant: str,
    refs: Mapping[str, str],
    *,
    max_pixels: int,
) -> tuple[list[JSON], Held]:
    """The input records of ``refs`` (input name → sha256 hex), each content the tenant
    already has, pinned like an upload until :func:`release`.

    An earlier upload gives the very record its task has (the name aside): same sha256,
    same dedup key, same object under ``inputs/``. An output of a SUCCESS task is copied
    from its key into ``inputs/`` (size and sha256 checked, header probed), and is then an
    upload like any other. Unknown content, another tenant's, or an upload whose object is
    gone is InvalidRequest; an output that is not an image is UnsupportedMediaType, one
    over ``max_pixels`` PayloadTooLarge. A refusal leaves no pin and no object behind.
    """
    found: dict[str, KnownObject] = {}
    for name, sha256 in refs.items():
        if sha256 not in found:
            known = await store.inputs.find_object(tenant, sha256)
            if known is None:
                raise unknown_reference(name, sha256)
            found[sha256] = known
    pinned, fresh = await _pin(store, storage, sorted(found))
    written: list[str] = []
    try:
        records: dict[str, JSON] = {}
        for sha256, known in found.items():
            name = next(n for n, s in refs.items() if s == sha256)
            records[sha256] = await _kept(
                storage, name, known, sha256 in fresh, max_pixels, written
            )
    except BaseException:
        # A row the pin made for content nobody else had goes again too.
        dropped = tuple(dict.fromkeys([*written, *sorted(fresh)]))
        await release(store, storage, Held(tuple(pinned), dropped), drop=True)
        raise
    items = [{**records[sha256], "name": name} for name, sha256 in refs.items()]
    return items, Held(tuple(pinned), tuple(written))


async def _pin(
    store: Store, storage: Storage, sha256s: Sequence[str]
) -> tuple[list[str], set[str]]:
    """Pin every input (waiting for a deletion of the same content to end, as
    :func:`hold` does): the pinned ones, and those the store did not know (``write``)."""
    pending = list(sha256s)
    pinned: list[str] = []
    fresh: set[str] = set()
    deadline = asyncio.get_running_loop().time() + HOLD_WAIT_S
    while pending:
        pins = await store.inputs.pin(pending)
        pinned += [sha256 for sha256 in pending if sha256 not in pins.busy]
        fresh |= pins.write
        pending = sorted(pins.busy)
        if pending and asyncio.get_running_loop().time() > deadline:
            await release(store, storage, Held(tuple(pinned), tuple(sorted(fresh))), drop=True)
            raise StoreUnavailable("an input of this request is being deleted; try again")
        if pending:
            await asyncio.sleep(HOLD_POLL_S)  # a deletion takes one object delete
    return pinned, fresh


async def _kept(
    storage: Storage,
    name: str,
    known: KnownObject,
    fresh: bool,
    max_pixels: int,
    written: list[str],
) -> JSON:
    """The record of a referenced content whose input is pinned, its object under
    ``inputs/`` made sure of (copied from the output when it is one)."""
    sha256 = known.sha256
    key = input_key(sha256)
    if known.record is not None:
        info = await storage.stat(key)
        if info is None or info.size != known.record.get("size"):
            raise InvalidRequest(
                f"the input {name!r} names sha256:{sha256}, an upload that is no longer "
                "stored: upload the file again",
                details=[{"loc": ["inputs", name], "msg": "no longer stored", "type": "reference"}],
            )
        if all(k in known.record for k in ("content_type", "width", "height")):
            return known.record
        data = await storage.get(key)  # a record from before sizes were kept: read it
        return record(name, data, _probe(data, max_pixels), sha256)
    assert known.output is not None
    output = known.output
    gone = InvalidRequest(
        f"the input {name!r} names sha256:{sha256}, the output {output['name']!r} of task "
        f"{output['task_id']}, which is missing from storage or does not match its sha256",
        details=[{"loc": ["inputs", name], "msg": "output not readable", "type": "reference"}],
    )
    if await storage.stat(str(output["key"])) is None:
        raise gone
    try:
        data = await storage.get(str(output["key"]))
    except FileNotFoundError:
        raise gone from None
    if len(data) != output["size"] or sha256_hex(data) != sha256:
        raise gone
    header = _probe(data, max_pixels)
    if fresh:
        await storage.put(key, data)
        written.append(sha256)
    elif await keep(storage, data, sha256):
        written.append(sha256)
    return record(name, data, header, sha256)


def _probe(data: bytes, max_pixels: int) -> ImageHeader:
    try:
        return probe(data, max_pixels)
    except PayloadTooLarge as exc:
        raise PayloadTooLarge(f"{exc.message} (KILN_MAX_IMAGE_PIXELS allows more)") from None
