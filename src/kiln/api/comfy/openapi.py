"""``GET /api/v2/openapi.json``: the v2 routes kiln serves, as an OpenAPI 3.1 document.

kiln's ``/openapi.json`` describes ``/v1``; this one describes the Comfy API v2 face as
kiln serves it (docs/comfy.md): its paths, the job, output, asset and error shapes, and
kiln's extensions (``sha256``, ``tags``, ``metadata``, ``create_time``/``update_time``,
``deduplicated``). The shapes carry the field names and required fields of Comfy's own v2
spec (the models ``comfy-sdk`` is generated from); tests/api/test_api_comfy_openapi.py
checks both against the routes and real answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from kiln.api.comfy import shapes
from kiln.api.comfy.errors import V2Route
from kiln.presence import version

router = APIRouter(prefix=shapes.PREFIX, route_class=V2Route, include_in_schema=False)

Schema = dict[str, Any]

STRING: Schema = {"type": "string"}
INTEGER: Schema = {"type": "integer"}
TIME: Schema = {"type": "string", "format": "date-time"}
URL: Schema = {"type": "string", "format": "uri"}
HASH: Schema = {"type": "string", "pattern": "^blake3:[0-9a-f]{64}$"}
SHA256: Schema = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
LABELS: Schema = {"type": "object", "additionalProperties": {"type": "string"}}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _null(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _object(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    return {
        "type": "object",
        "required": list(required),
        "properties": {**required, **(optional or {})},
    }


def _schemas() -> dict[str, Schema]:
    return {
        **_job_part_schemas(),
        **_job_schemas(),
        "Asset": _asset(),
        **_request_schemas(),
        **_error_schemas(),
    }


def _job_part_schemas() -> dict[str, Schema]:
    """A job's status, progress, error and links."""
    return {
        "JobStatus": {"type": "string", "enum": list(shapes.STATUSES)},
        "Progress": _object(
            {"value": {"type": "number"}, "nodes_done": INTEGER, "nodes_total": INTEGER},
            {
                "current_node": _null(STRING),
                "current_node_class": _null(STRING),
                "step": _null(INTEGER),
                "steps": _null(INTEGER),
                "message": _null(STRING),
            },
        ),
        "JobError": _object(
            {"code": STRING, "message": STRING},
            {"node_id": _null(STRING), "class_type": _null(STRING), "traceback": _null(STRING)},
        ),
        "JobUrls": _object({"self": URL, "events": URL, "cancel": URL}),
    }


def _job_schemas() -> dict[str, Schema]:
    """A job's outputs, the job, and a page of jobs."""
    return {
        "Output": _object(
            {
                "node_id": STRING,
                "name": STRING,
                "type": {"type": "string", "enum": ["image", "video", "audio", "text", "file"]},
                "content_type": STRING,
                "size_bytes": INTEGER,
                "id": STRING,
                "hash": _null(HASH),
                "url": URL,
                "url_expires_at": TIME,
            },
            {"job_id": STRING, "sha256": SHA256},
        ),
        "Job": _job(),
        "JobList": _object(
            {"jobs": {"type": "array", "items": _ref("Job")}}, {"next_cursor": STRING}
        ),
    }


def _asset() -> Schema:
    return _object(
        {
            "id": STRING,
            "hash": HASH,
            "size_bytes": INTEGER,
            "content_type": STRING,
            "created_at": TIME,
            "url": URL,
            "url_expires_at": TIME,
        },
        {
            "file_path": STRING,
            "created_new": {"type": "boolean"},
            "expires_at": _null(TIME),
            "job_id": STRING,
            "sha256": SHA256,
            "tags": {"type": "array", "items": STRING},
        },
    )


def _request_schemas() -> dict[str, Schema]:
    """A job's workflow, the bodies a client sends, and the health answer."""
    return {
        "JobWorkflowResponse": _object(
            {"workflow": {"type": "object"}, "format": {"type": "string", "enum": ["api"]}}
        ),
        "SubmitJob": _object(
            {"workflow": {"type": "object", "additionalProperties": {"type": "object"}}},
            {"extra_data": {"type": "object"}, "metadata": LABELS, "dedup": {"type": "boolean"}},
        ),
        "FromHash": _object(
            {"hash": HASH},
            {"file_path": STRING, "tags": {"type": "array", "items": STRING}},
        ),
        "Health": _object({"status": {"type": "string", "enum": ["healthy"]}}),
    }


def _error_schemas() -> dict[str, Schema]:
    return {
        "Error": _object(
            {"code": STRING, "message": STRING}, {"details": _null({"type": "object"})}
        ),
        "ErrorEnvelope": _object({"error": _ref("Error")}),
    }


def _job() -> Schema:
    job = _object(
        {
            "id": STRING,
            "status": _ref("JobStatus"),
            "created_at": TIME,
            "started_at": _null(TIME),
            "completed_at": _null(TIME),
            "expires_at": _null(TIME),
            "queue_position": _null(INTEGER),
            "progress": _null(_ref("Progress")),
            "outputs": {"type": "array", "items": _ref("Output")},
            "error": _null(_ref("JobError")),
            "urls": _ref("JobUrls"),
        },
        {
            "metrics": _object({"queue_ms": _null(INTEGER), "execution_ms": _null(INTEGER)}),
            "metadata": LABELS,
            "create_time": TIME,
            "update_time": TIME,
            "deduplicated": {"type": "boolean"},
        },
    )
    return job


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Schema]:
    return {str(s): _json(_ref("ErrorEnvelope"), "an error (docs/comfy.md)") for s in statuses}


def _param(name: str, where: str, schema: Schema = STRING) -> Schema:
    return {"name": name, "in": where, "required": where == "path", "schema": schema}


JOB_ID = _param("job_id", "path")
ASSET_ID = _param("asset_id", "path")
IDEMPOTENCY_KEY = _param("Idempotency-Key", "header", {"type": "string", "maxLength": 255})
BINARY: Schema = {"type": "string", "format": "binary"}


def _op(summary: str, answers: dict[str, Schema], *params: Schema, **more: Any) -> Schema:
    """One operation; ``security=[]`` for one that needs no key (else a 401 is listed)."""
    errors = {} if more.get("security") == [] else _errors(401)
    operation = {"summary": summary, "parameters": list(params)}
    return {**operation, "responses": {**answers, **errors}, **more}


def _job_paths() -> dict[str, Schema]:
    job = _json(_ref("Job"), "the job")
    body = {"required": True, "content": {"application/json": {"schema": _ref("SubmitJob")}}}
    events = {"text/event-stream": {"schema": STRING}}
    stream = {"description": "status, progress, preview, output and log events", "content": events}
    page = {"200": _json(_ref("JobList"), "a page"), **_errors(400)}
    limit = _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100})
    query = [limit, _param("cursor", "query"), _param("status", "query")]
    workflow = {"200": _json(_ref("JobWorkflowResponse"), "the workflow"), **_errors(404)}
    submitted = {"201": job, **_errors(400, 413, 422, 429, 503)}
    return {
        "/jobs": {
            "post": _op("Submit a workflow", submitted, IDEMPOTENCY_KEY, requestBody=body),
            "get": _op("List jobs, newest first", page, *query),
        },
        "/jobs/{job_id}": {"get": _op("Get a job", {"200": job, **_errors(404)}, JOB_ID)},
        "/jobs/{job_id}/cancel": {
            "post": _op("Cancel a job (idempotent)", {"200": job, **_errors(404)}, JOB_ID)
        },
        "/jobs/{job_id}/workflow": {"get": _op("The workflow behind a job", workflow, JOB_ID)},
        "/jobs/{job_id}/events": {
            "get": _op(
                "A job's events (server-sent events)",
                {"200": stream, **_errors(400, 404)},
                JOB_ID,
                _param("Last-Event-ID", "header"),
            )
        },
    }


def _asset_paths() -> dict[str, Schema]:
    asset = _ref("Asset")
    multipart = _object(
        {"file": BINARY, "file_path": STRING},
        {"content_type": STRING, "expected_hash": HASH, "tags": {"type": "array", "items": STRING}},
    )
    upload = {"required": True, "content": {"multipart/form-data": {"schema": multipart}}}
    from_hash = {"required": True, "content": {"application/json": {"schema": _ref("FromHash")}}}
    uploaded = {
        "201": _json(asset, "a new asset"),
        "200": _json(asset, "the tenant's asset with that content"),
        **_errors(409, 413, 422),
    }
    content = {"content": {"application/octet-stream": {"schema": BINARY}}}
    ranged = {
        "200": {"description": "the bytes", **content},
        "206": {"description": "the range asked", **content},
        **_errors(404, 416),
    }
    found = {"200": {"description": "the tenant has it"}, "404": {"description": "it has not"}}
    digest = _param("digest", "path", HASH)
    return {
        "/assets": {"post": _op("Upload an asset", uploaded, IDEMPOTENCY_KEY, requestBody=upload)},
        "/assets/from-hash": {
            "post": _op(
                "An asset over content the tenant has",
                {"200": _json(asset, "the asset"), **_errors(404, 422)},
                requestBody=from_hash,
            )
        },
        "/assets/by-hash/{digest}": {"head": _op("Whether the tenant has it", found, digest)},
        "/assets/{asset_id}": {
            "get": _op("An asset", {"200": _json(asset, "the asset"), **_errors(404)}, ASSET_ID),
            "delete": _op(
                "Delete an uploaded asset",
                {"204": {"description": "deleted"}, **_errors(404, 422)},
                ASSET_ID,
            ),
        },
        "/assets/{asset_id}/content": {"get": _op("An asset's bytes", ranged, ASSET_ID)},
    }


def document() -> Schema:
    """The OpenAPI document of the v2 routes kiln serves."""
    public: dict[str, Any] = {"security": []}
    health = {"200": _json(_ref("Health"), "the face answers")}
    spec = {"200": _json({"type": "object"}, "this document")}
    paths = {
        **_job_paths(),
        **_asset_paths(),
        "/health": {"get": _op("The v2 face answers", health, **public)},
        "/openapi.json": {"get": _op("This document", spec, **public)},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kiln: Comfy API v2",
            "version": version(),
            "description": "The Comfy API v2 as kiln serves it (docs/comfy.md).",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": {f"{shapes.PREFIX}{path}": item for path, item in paths.items()},
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


@router.get("/openapi.json", summary="The v2 routes kiln serves (OpenAPI 3.1)")
async def openapi_document() -> Response:
    return JSONResponse(document())
