"""Reading a ``multipart/form-data`` submission (API.md, "Uploads") as it streams in.

Parts: ``request`` (the JSON body, as a form field or a file part) and one file part per
input, named after it. Every limit is enforced while the bytes arrive, never after:

- the whole body: ``max_upload_bytes`` (the declared Content-Length first, then the bytes
  counted as they come, so a missing or lying header gets no further) → 413;
- the ``request`` part: ``max_body_bytes`` → 413;
- each file: its first bytes must be a PNG, JPEG or WebP signature → else 415, and its
  header may not announce more than ``max_image_pixels`` → 413; the header is read as soon
  as enough of the file is in, so a decompression bomb is refused before the rest of it
  is even received, and nothing is ever decoded.

Nothing is stored here: the caller stores the inputs once every check has passed.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from kiln import inputs
from kiln.config import Settings
from kiln.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from kiln.models import JSON

REQUEST_PART = "request"
#: At most this many parts (the request and the inputs) in one submission.
MAX_PARTS = 16
#: Once this much of a file is in, its header is read (an image header fits well within).
PROBE_AT_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class UploadedFile:
    """One input as received: its bytes, their sha256, and what the header says."""

    name: str
    data: bytes
    sha256: str
    header: inputs.ImageHeader

    def record(self) -> JSON:
        return inputs.record(self.name, self.data, self.header, self.sha256)


@dataclass(frozen=True, slots=True)
class Upload:
    request: bytes
    files: list[UploadedFile]


@dataclass
class _Part:
    name: str
    data: bytearray = field(default_factory=bytearray)
    digest: hashlib._Hash | None = None  # None for the request part
    signed: bool = False  # its signature was checked
    probed: bool = False  # its header was read early
    header: inputs.ImageHeader | None = None
    content: bytes = b""  # a file's bytes once the part is complete


class UploadReader:
    """Feeds a multipart body to python-multipart's streaming parser and checks every part
    as its bytes arrive. Use :meth:`feed` per chunk, then :meth:`finish`."""

    def __init__(self, boundary: bytes, settings: Settings) -> None:
        self.settings = settings
        self.received = 0
        self.parts: list[_Part] = []
        self.ended = False
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value_data,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
        )

    # feeding

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.settings.max_upload_bytes:
            raise too_large(self.settings.max_upload_bytes)
        try:
            self._parser.write(chunk)
        except FormParserError:
            raise InvalidRequest("the multipart/form-data body is malformed") from None

    def finish(self) -> Upload:
        if not self.ended:
            raise InvalidRequest("the multipart/form-data body ends before its last boundary")
        requests = [p for p in self.parts if p.name == REQUEST_PART]
        if not requests:
            raise InvalidRequest(
                "the multipart/form-data body has no 'request' part (the JSON body)",
                details=[{"loc": [REQUEST_PART], "msg": "missing part", "type": "missing"}],
            )
        files = [self._file(p) for p in self.parts if p.name != REQUEST_PART]
        return Upload(bytes(requests[0].data), files)

    @staticmethod
    def _file(part: _Part) -> UploadedFile:
        assert part.digest is not None and part.header is not None
        return UploadedFile(part.name, part.content, part.digest.hexdigest(), part.header)

    # parser callbacks (they raise to stop the parse)

    def _part_begin(self) -> None:
        if len(self.parts) >= MAX_PARTS:
            raise InvalidRequest(f"a submission has at most {MAX_PARTS} parts")
        self._disposition = b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.strip().lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if not name:
            raise InvalidRequest("every part needs a name (Content-Disposition: form-data)")
        if any(p.name == name for p in self.parts):
            raise InvalidRequest(f"the part {name!r} is sent twice")
        digest = None if name == REQUEST_PART else hashlib.sha256()
        self.parts.append(_Part(name, digest=digest))

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        part = self.parts[-1]
        chunk = data[start:end]
        part.data += chunk
        if part.digest is None:
            if len(part.data) > self.settings.max_body_bytes:
                raise PayloadTooLarge(
                    f"the 'request' part is larger than {self.settings.max_body_bytes} bytes "
                    "(KILN_MAX_BODY_BYTES allows more)"
                )
            return
        part.digest.update(chunk)
        self._check_early(part)

    def _part_end(self) -> None:
        part = self.parts[-1]
        if part.digest is not None:
            self._check_signature(part)
            part.content, part.data = bytes(part.data), bytearray()
            part.header = probe(part.content, self.settings.max_image_pixels)

    def _end(self) -> None:
        self.ended = True

    # early checks of a file part

    def _check_early(self, part: _Part) -> None:
        if not part.signed and len(part.data) >= inputs.SNIFF_BYTES:
            self._check_signature(part)
        if not part.probed and len(part.data) >= PROBE_AT_BYTES:
            part.probed = True
            # A header may run past this point: then the whole file decides.
            with contextlib.suppress(UnsupportedMediaType):
                probe(bytes(part.data), self.settings.max_image_pixels)

    @staticmethod
    def _check_signature(part: _Part) -> None:
        if part.signed:
            return
        part.signed = True
        if inputs.sniff(bytes(part.data[: inputs.SNIFF_BYTES])) is None:
            raise UnsupportedMediaType(f"the file {part.name!r} is not a PNG, JPEG or WebP image")


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the upload is larger than {limit} bytes (KILN_MAX_UPLOAD_BYTES allows more)"
    )


def probe(data: bytes, max_pixels: int) -> inputs.ImageHeader:
    """:func:`kiln.inputs.probe`, its pixel refusal naming the setting that allows more."""
    try:
        return inputs.probe(data, max_pixels)
    except PayloadTooLarge as exc:
        raise PayloadTooLarge(f"{exc.message} (KILN_MAX_IMAGE_PIXELS allows more)") from None


def boundary_of(request: Request) -> bytes:
    """The boundary of a multipart/form-data request; 422 without one."""
    _, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary", b"")
    if not boundary or len(boundary) > 70:
        raise InvalidRequest("multipart/form-data needs a boundary of 1 to 70 characters")
    return boundary


async def read_upload(request: Request, settings: Settings) -> Upload:
    """The parts of a multipart submission, every limit checked as the body streams in."""
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(limit)
    reader = UploadReader(boundary_of(request), settings)
    async for chunk in request.stream():
        reader.feed(chunk)
    return reader.finish()
