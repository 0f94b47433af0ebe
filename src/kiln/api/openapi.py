"""The OpenAPI document: FastAPI's, plus the JSON bodies the routes read themselves.

The routes read their bodies themselves (to bound their size and parse strict JSON), so
their request schemas are added here: the submission body has one variant per registered
kind, each with that kind's params, so a client or a fuzzer can build valid requests.
Kinds that take uploaded inputs are submitted as ``multipart/form-data`` instead: their
variants are ``SubmitUploadRequest``, the schema of the ``request`` part.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kiln import timing
from kiln.api.bulk_actions import CancelRequest, RetryRequest
from kiln.api.schedules import ScheduleRequest
from kiln.api.schemas import BatchRequest, RerunRequest, ReviewRequest, SubmitRequest
from kiln.app import App
from kiln.config import Settings

REF_TEMPLATE = "#/components/schemas/{model}"


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    components.update(schema.pop("$defs", {}))
    return schema


def submit_schema(app: App, components: dict[str, Any], *, uploads: bool = False) -> dict[str, Any]:
    """The submission body: one variant per registered kind, with that kind's params (the
    kinds that take inputs with ``uploads``, the others without)."""
    base = _model_schema(SubmitRequest, components)
    variants = []
    for name, kind in sorted(app.kinds.items()):
        if bool(kind.inputs) != uploads:
            continue
        variant = copy.deepcopy(base)
        variant["title"] = f"Submit {name}"
        variant["properties"]["kind"] = {"type": "string", "const": name}
        if not kind.inputs:  # nothing to name by reference
            variant["properties"].pop("inputs", None)
        if kind.params is not None:
            components[f"{name}.params"] = _model_schema(kind.params, components)
            variant["properties"]["params"] = {"$ref": REF_TEMPLATE.format(model=f"{name}.params")}
        variants.append(variant)
    if not variants:
        return base
    title = "SubmitUploadRequest" if uploads else "SubmitRequest"
    return {"title": title, "description": base.get("description", ""),
            "oneOf": variants}  # fmt: skip


def upload_body(app: App) -> dict[str, Any] | None:
    """The ``multipart/form-data`` submission, when a registered kind takes inputs."""
    names = sorted({name for kind in app.kinds.values() for name in kind.inputs})
    if not names:
        return None
    files = {
        name: {"type": "string", "format": "binary", "description": "a PNG, JPEG or WebP image"}
        for name in names
    }
    request = {"$ref": REF_TEMPLATE.format(model="SubmitUploadRequest")}
    return {
        "schema": {
            "type": "object",
            "required": ["request"],
            "properties": {"request": request, **files},
        },
        "encoding": {"request": {"contentType": "application/json"}},
    }


def _schedule_schemas(components: dict[str, Any]) -> None:
    """A schedule's task is a submission without ``run_at`` and ``delay_s`` (its ticks say
    when) nor inputs by reference, in a zone the server knows."""
    task = copy.deepcopy(components["SubmitRequest"])
    for variant in task.get("oneOf", [task]):
        for name in ("run_at", "delay_s", "inputs"):
            variant.get("properties", {}).pop(name, None)
        variant.pop("not", None)
    task["title"] = "ScheduleTask"
    components["ScheduleTask"] = task
    properties = components["ScheduleRequest"]["properties"]
    properties["task"] = {"$ref": REF_TEMPLATE.format(model="ScheduleTask")}
    properties["timezone"]["enum"] = sorted(timing.zone_names())


def _without_security(schema: dict[str, Any]) -> None:
    """With no keys configured nothing asks for a key: say so in the document."""
    schema.get("components", {}).pop("securitySchemes", None)
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.pop("security", None)


def openapi_builder(api: FastAPI, app: App, settings: Settings) -> Callable[[], dict[str, Any]]:
    """OpenAPI with the JSON bodies the routes read themselves (size limit, strict JSON)."""

    def build() -> dict[str, Any]:
        if api.openapi_schema:
            return api.openapi_schema
        schema = get_openapi(
            title=api.title, version=api.version, description=api.description, routes=api.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        # First: its task's plain SubmitRequest is then replaced by the one with variants.
        components["ScheduleRequest"] = _model_schema(ScheduleRequest, components)
        components["SubmitRequest"] = submit_schema(app, components)
        _schedule_schemas(components)
        upload = upload_body(app)
        if upload is not None:
            components["SubmitUploadRequest"] = submit_schema(app, components, uploads=True)
            body = schema["paths"]["/v1/tasks"]["post"]["requestBody"]
            body["content"]["multipart/form-data"] = upload
        for model in (ReviewRequest, BatchRequest, RerunRequest, CancelRequest, RetryRequest):
            components[model.__name__] = _model_schema(model, components)
        if not settings.auth_enabled:
            _without_security(schema)
        api.openapi_schema = schema
        return schema

    return build
