"""The v2 asset routes: upload, from-hash, by-hash, get, content (with Range), delete.

A job's outputs are assets too (ids ``<task id>.<name in base64url>``): readable by id and
by content, under the same tenant rule, never deleted on their own.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, Header
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.api.comfy import shapes
from kiln.api.comfy.book import AssetBook, AssetRecord, blake3_of, normal_hash
from kiln.api.comfy.common import Caller, base_of, book_of, job_task
from kiln.api.comfy.errors import V2Error, V2Route
from kiln.api.state import api_state
from kiln.api.tasks import read_body
from kiln.errors import NotFound
from kiln.models import JSON, StoredOutput, iso

# Not in kiln's /openapi.json (API.md's /v1): the v2 contract is Comfy's (docs/comfy.md).
router = APIRouter(
    prefix=shapes.PREFIX, route_class=V2Route, tags=["Comfy API v2"], include_in_schema=False
)

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
#: The most form fields (tags included) an upload may carry.
MAX_FIELDS = 64


def asset_json(record: AssetRecord, base: str, created_new: bool | None = None) -> JSON:
    body: JSON = {
        "id": record.id,
        "hash": record.hash,
        "sha256": record.sha256,
        "size_bytes": record.size_bytes,
        "content_type": record.content_type,
        "file_path": record.file_path,
        "created_at": iso(record.created_at),
        "url": f"{base}{shapes.PREFIX}/assets/{record.id}/content",
        "url_expires_at": shapes.now_plus(shapes.URL_TTL_S),
        "expires_at": None,
        "tags": record.tags,
    }
    if created_new is not None:
        body["created_new"] = created_new
    return body


def _bad(message: str) -> V2Error:
    return V2Error("invalid_request", message, 422)


async def _form_text(form: Any, name: str) -> str | None:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else None


@router.post("/assets", status_code=201, summary="Upload an asset (multipart)")
async def upload_asset(request: Request, principal: Caller) -> Response:
    state = api_state(request)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _bad("send the asset as multipart/form-data")
    request._body = await read_body(request, state.settings.max_upload_bytes)
    async with request.form(max_files=1, max_fields=MAX_FIELDS) as form:
        upload = form.get("file")
        file_path = await _form_text(form, "file_path")
        if not isinstance(upload, UploadFile):
            raise _bad("the 'file' part is missing")
        if not file_path:
            raise _bad("the 'file_path' field is missing")
        data = await upload.read()
        content_type = (
            await _form_text(form, "content_type")
            or upload.content_type
            or shapes.guess_type(file_path)
        )
        expected = await _form_text(form, "expected_hash")
        tags = [t.strip() for t in form.getlist("tags") if isinstance(t, str) and t.strip()]
    book = book_of(request)
    if expected and blake3_of(data) != normal_hash(expected):
        raise V2Error("hash_mismatch", "the bytes received do not hash to expected_hash")
    record, new = await book.add(
        principal.tenant, data, content_type=content_type, file_path=file_path, tags=tags
    )
    return JSONResponse(asset_json(record, base_of(request), new), status_code=201 if new else 200)


@router.post("/assets/from-hash", summary="An asset over content the tenant already has")
async def asset_from_hash(request: Request, principal: Caller) -> Response:
    state = api_state(request)
    try:
        body = json.loads(await read_body(request, state.settings.max_body_bytes))
    except ValueError:
        raise V2Error("invalid_request", "the body must be a JSON object", 400) from None
    digest = body.get("hash") if isinstance(body, dict) else None
    if not isinstance(digest, str):
        raise _bad("'hash' is missing")
    found = await book_of(request).by_hash(principal.tenant, digest)
    if found is None:
        raise V2Error("blob_not_found", "you have no asset with this content: upload it")
    return JSONResponse(asset_json(found, base_of(request), False))


@router.head("/assets/by-hash/{digest}", summary="Whether the tenant has this content")
async def head_by_hash(digest: str, request: Request, principal: Caller) -> Response:
    try:
        found = await book_of(request).by_hash(principal.tenant, digest)
    except V2Error:
        found = None
    return Response(status_code=200 if found is not None else 404)


async def _output(request: Request, principal: Caller, asset_id: str) -> tuple[Any, StoredOutput]:
    """The task and output an output's asset id names; NotFound otherwise."""
    parsed = shapes.parse_output_id(asset_id)
    if parsed is None:
        raise NotFound(f"no asset {asset_id}")
    task = await job_task(api_state(request), parsed[0], principal)
    for output in shapes.outputs_of(task):
        if output.name == parsed[1]:
            return task, output
    raise NotFound(f"no asset {asset_id}")


@router.get("/assets/{asset_id}", summary="An asset, with a content URL")
async def get_asset(asset_id: str, request: Request, principal: Caller) -> Response:
    book, base = book_of(request), base_of(request)
    if shapes.parse_output_id(asset_id) is None:
        return JSONResponse(asset_json(await book.get(principal.tenant, asset_id), base))
    task, output = await _output(request, principal, asset_id)
    body = shapes.output_json(
        task, output, base, await book.blake3_of_object(output.key, output.sha256, output.size)
    )
    body.update(
        file_path=shapes.split_output_name(output.name)[1],
        created_at=iso(task.finished_at),
        expires_at=None,
    )
    return JSONResponse(body)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) of a single ``Range: bytes=a-b``; None for the whole; 416 outside."""
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None  # not a single bytes range: the whole body (RFC 9110 allows it)
    first_text, last_text = match.groups()
    if first_text == "":  # the last N bytes
        first, last = max(size - int(last_text), 0), size - 1
    else:
        first = int(first_text)
        last = min(int(last_text), size - 1) if last_text else size - 1
    if size == 0 or first >= size or last < first:
        raise V2Error(
            "range_not_satisfiable",
            f"the range is outside the content ({size} bytes)",
            headers={"Content-Range": f"bytes */{size}"},
        )
    return first, last


async def _content_of(
    request: Request, principal: Caller, asset_id: str, book: AssetBook
) -> tuple[bytes, str, str, str]:
    """(bytes, content type, sha256, file name) of an asset or output."""
    if shapes.parse_output_id(asset_id) is None:
        record = await book.get(principal.tenant, asset_id)
        data = await book.content(record.sha256, record.size_bytes)
        return data, record.content_type, record.sha256, record.file_path
    _, output = await _output(request, principal, asset_id)
    data = await book.content(output.sha256, output.size, output.key)
    return data, output.content_type, output.sha256, shapes.split_output_name(output.name)[1]


@router.get("/assets/{asset_id}/content", summary="An asset's bytes (Range: 206)")
async def get_content(
    asset_id: str,
    request: Request,
    principal: Caller,
    range_header: Annotated[str | None, Header(alias="Range")] = None,
) -> Response:
    book = book_of(request)
    data, content_type, sha256, _ = await _content_of(request, principal, asset_id, book)
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": f'"{sha256}"',
        "Cache-Control": "private, no-cache",
        "X-Content-Type-Options": "nosniff",
    }
    span = byte_range(range_header, len(data))
    if span is None:
        return Response(data, media_type=content_type, headers=headers)
    first, last = span
    headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
    return Response(data[first : last + 1], 206, media_type=content_type, headers=headers)


@router.delete("/assets/{asset_id}", status_code=204, summary="Delete an uploaded asset")
async def delete_asset(asset_id: str, request: Request, principal: Caller) -> Response:
    if shapes.parse_output_id(asset_id) is not None:
        await _output(request, principal, asset_id)  # 404 for another tenant's
        raise _bad("an output goes with its job: it cannot be deleted on its own")
    await book_of(request).delete(principal.tenant, asset_id)
    return Response(status_code=204)


@router.get("/health", summary="The v2 face answers (no key needed)")
async def health() -> Response:
    return JSONResponse({"status": "healthy"})
