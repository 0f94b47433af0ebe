"""The OpenAPI document: FastAPI's, plus the JSON bodies the routes read themselves.

The routes read their bodies themselves (to bound their size and parse strict JSON), so
their request schemas are added here. The JSON submission body is one variant per kind
(``oneOf`` with a ``discriminator`` on ``kind``), each with that kind's params: every
registered kind, plus ``pipeline``. A kind that takes inputs has a JSON variant whose
``inputs`` name each input by reference (``sha256:<64 hex>``), and a
``multipart/form-data`` variant (``SubmitUploadRequest``, the schema of the ``request``
part) for uploads. What only the server can judge stays with the server: a cron
expression is checked by the scheduler's own parser (:class:`kiln.timing.Cron`), a
webhook's address by the private-address policy (``KILN_WEBHOOK_ALLOW_PRIVATE``), a
moment by how far ahead it is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.routing import BaseRoute

from kiln import pipelines
from kiln.api.bulk_actions import CancelRequest, RetryRequest
from kiln.api.schedules import ScheduleRequest
from kiln.api.schemas import (
    BatchItemIn,
    BatchRequest,
    RerunRequest,
    ReviewRequest,
    SubmitRequest,
)
from kiln.app import App
from kiln.config import Settings
from kiln.inputs import REFERENCE_PATTERN
from kiln.kinds import ANY_INPUTS, TaskKind

REF_TEMPLATE = "#/components/schemas/{model}"
#: What the document says of a cron expression: the server's parser decides.
CRON_DESCRIPTION = (
    "five fields (minute hour day-of-month month day-of-week), or six with seconds first; "
    "ranges, lists, steps, names (MON, JAN), L and # as cron has them (docs/schedules.md). "
    "Checked by the scheduler's own parser: one that never fires is 422"
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    components.update(schema.pop("$defs", {}))
    return schema


def _by_reference(names: tuple[str, ...]) -> dict[str, Any]:
    """The ``inputs`` of a kind's JSON variant: each input it takes, named by content."""
    reference = {
        "type": "string",
        "pattern": REFERENCE_PATTERN,
        "description": "sha256:<64 hex> of an earlier upload or output of this tenant's tasks",
    }
    if ANY_INPUTS in names:  # inputs of any name, none required
        return {
            "type": "object",
            "additionalProperties": reference,
            "description": "inputs of any name, named by content instead of uploaded",
        }
    return {
        "type": "object",
        "properties": {name: reference for name in names},
        "required": list(names),
        "additionalProperties": False,
        "description": "inputs named by content instead of uploaded (docs/uploads.md)",
    }


def _pipeline_step(name: str, kind: TaskKind) -> dict[str, Any]:
    """A step of a pipeline of kind ``name``: its params are that kind's, its inputs name
    outputs of earlier steps (docs/pipelines.md)."""
    reference = {"type": "string", "pattern": pipelines.REF.pattern}
    properties: dict[str, Any] = {
        "name": {"type": "string", "pattern": pipelines.NAME.pattern},
        "kind": {"type": "string", "const": name},
        "params": {"type": "object", "additionalProperties": True}
        if kind.params is None
        else _ref(f"{name}.params"),
        "repeat": {"type": "integer", "minimum": 1, "maximum": pipelines.MAX_REPEAT},
    }
    if kind.inputs:
        named = [n for n in kind.inputs if n != ANY_INPUTS]
        properties["inputs"] = {
            "type": "object",
            "properties": {input_name: reference for input_name in named},
            "additionalProperties": reference if ANY_INPUTS in kind.inputs else False,
            "description": "input name → step:NAME/OUTPUT or step:NAME/* (an earlier step)",
        }
    for planned in sorted(pipelines.PLANNED_KEYS):  # a pipeline's stored params, sent again
        properties[planned] = {"description": "what kiln planned; ignored, planned anew"}
    return {
        "title": f"PipelineStep {name}",
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "kind"],
        "properties": properties,
    }


def _pipeline_params(app: App, components: dict[str, Any]) -> dict[str, Any]:
    """A pipeline's params (docs/pipelines.md): its steps, each of a registered kind."""
    steps: dict[str, str] = {}
    for name, kind in sorted(app.kinds.items()):
        components[f"PipelineStep.{name}"] = _pipeline_step(name, kind)
        steps[name] = f"PipelineStep.{name}"
    step = _one_of("PipelineStep", "a step: a task of its kind", steps)
    components["PipelineStep"] = step
    return {
        "title": "PipelineParams",
        "type": "object",
        "additionalProperties": False,
        "required": ["steps"],
        "properties": {
            "steps": {
                "type": "array",
                "items": _ref("PipelineStep"),
                "minItems": 1,
                "maxItems": pipelines.MAX_STEPS,
            },
            "on_failure": {"type": "string", "enum": list(pipelines.POLICIES), "default": "stop"},
        },
    }


def _variant(base: dict[str, Any], name: str, title: str) -> dict[str, Any]:
    variant = copy.deepcopy(base)
    variant["title"] = title
    variant["properties"]["kind"] = {"type": "string", "const": name}
    variant["properties"].pop("inputs", None)
    return variant


def _one_of(title: str, description: str, variants: dict[str, str]) -> dict[str, Any]:
    """``oneOf`` the variants (kind → component), told apart by ``kind``."""
    return {
        "title": title,
        "description": description,
        "oneOf": [_ref(component) for component in variants.values()],
        "discriminator": {
            "propertyName": "kind",
            "mapping": {kind: REF_TEMPLATE.format(model=c) for kind, c in variants.items()},
        },
    }


def submit_schema(app: App, components: dict[str, Any], *, uploads: bool = False) -> dict[str, Any]:
    """The submission body: one variant per kind, with that kind's params. JSON: every
    registered kind (those that take inputs name them by reference) and ``pipeline``;
    ``uploads``: the kinds that take inputs, as the ``request`` part of a multipart body."""
    base = _model_schema(SubmitRequest, components)
    prefix = "SubmitUpload" if uploads else "Submit"
    variants: dict[str, str] = {}
    for name, kind in sorted(app.kinds.items()):
        if uploads and not kind.inputs:
            continue
        variant = _variant(base, name, f"{prefix} {name}")
        if kind.inputs:
            uploaded = copy.deepcopy(base["properties"]["inputs"])
            variant["properties"]["inputs"] = uploaded if uploads else _by_reference(kind.inputs)
            if not uploads and ANY_INPUTS not in kind.inputs:
                variant["required"] = [*variant.get("required", []), "inputs"]
        if kind.params is not None:
            components[f"{name}.params"] = _model_schema(kind.params, components)
            variant["properties"]["params"] = _ref(f"{name}.params")
        components[f"{prefix}.{name}"] = variant
        variants[name] = f"{prefix}.{name}"
    if not uploads:
        variant = _variant(base, pipelines.KIND, f"{prefix} {pipelines.KIND}")
        for field in ("run_at", "delay_s"):  # a pipeline starts when it is submitted
            variant["properties"].pop(field, None)
        variant.pop("not", None)
        components["PipelineParams"] = _pipeline_params(app, components)
        variant["properties"]["params"] = _ref("PipelineParams")
        components[f"{prefix}.{pipelines.KIND}"] = variant
        variants[pipelines.KIND] = f"{prefix}.{pipelines.KIND}"
    title = "SubmitUploadRequest" if uploads else "SubmitRequest"
    return _one_of(title, base.get("description", ""), variants)


def batch_item_schema(components: dict[str, Any]) -> dict[str, Any]:
    """An item of ``POST /v1/tasks/batch``: a JSON submission of any kind, plus its own
    ``idempotency_key`` (one variant per variant of ``SubmitRequest``)."""
    key = _model_schema(BatchItemIn, components)["properties"]["idempotency_key"]
    variants: dict[str, str] = {}
    for kind, ref in components["SubmitRequest"]["discriminator"]["mapping"].items():
        variant = copy.deepcopy(components[ref.rsplit("/", 1)[1]])
        variant["title"] = f"BatchItem {kind}"
        variant["properties"]["idempotency_key"] = key
        components[f"BatchItem.{kind}"] = variant
        variants[kind] = f"BatchItem.{kind}"
    return _one_of("BatchItem", "a submission, plus its own Idempotency-Key", variants)


def upload_body(app: App) -> dict[str, Any] | None:
    """The ``multipart/form-data`` submission, when a registered kind takes inputs."""
    names = sorted({name for kind in app.kinds.values() for name in kind.inputs})
    if not names:
        return None
    file = {"type": "string", "format": "binary", "description": "a PNG, JPEG or WebP image"}
    files = {name: file for name in names if name != ANY_INPUTS}
    return {
        "schema": {
            "type": "object",
            "required": ["request"],
            "properties": {"request": _ref("SubmitUploadRequest"), **files},
            **({"additionalProperties": file} if ANY_INPUTS in names else {}),
        },
        "encoding": {"request": {"contentType": "application/json"}},
    }


def _schedule_schemas(app: App, components: dict[str, Any]) -> None:
    """A schedule's task is a submission of a kind that takes no inputs (its ticks submit
    none), without ``run_at`` and ``delay_s`` (its ticks say when), in a zone the server
    knows, on a cron expression the server's parser reads."""
    variants: dict[str, str] = {}
    for name in [*sorted(app.kinds), pipelines.KIND]:
        if name != pipelines.KIND and app.kinds[name].inputs:
            continue
        variant = copy.deepcopy(components[f"Submit.{name}"])
        for field in ("run_at", "delay_s", "inputs"):
            variant["properties"].pop(field, None)
        variant.pop("not", None)
        variant["title"] = f"ScheduleTask {name}"
        components[f"ScheduleTask.{name}"] = variant
        variants[name] = f"ScheduleTask.{name}"
    components["ScheduleTask"] = _one_of("ScheduleTask", "what each tick submits", variants)
    properties = components["ScheduleRequest"]["properties"]
    properties["task"] = _ref("ScheduleTask")
    # No enum of zones: the list is the machine's tz database, so a document written from it
    # (and a client generated from the document) would differ from machine to machine. The
    # server checks the name against its own database (422 for a name it does not know).
    properties["timezone"]["description"] = "an IANA time zone name (Europe/Paris, UTC)"
    properties["cron"]["description"] = CRON_DESCRIPTION


def _without_security(schema: dict[str, Any]) -> None:
    """With no keys configured nothing asks for a key: say so in the document."""
    schema.get("components", {}).pop("securitySchemes", None)
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.pop("security", None)


def openapi_builder(
    api: FastAPI, app: App, settings: Settings, routes: list[BaseRoute] | None = None
) -> Callable[[], dict[str, Any]]:
    """OpenAPI with the JSON bodies the routes read themselves (size limit, strict JSON),
    listing ``routes`` (default: the app's) in their order."""

    def build() -> dict[str, Any]:
        if api.openapi_schema:
            return api.openapi_schema
        schema = get_openapi(
            title=api.title,
            version=api.version,
            description=api.description,
            routes=api.routes if routes is None else routes,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        # First: its task's plain SubmitRequest is then replaced by the one with variants.
        components["ScheduleRequest"] = _model_schema(ScheduleRequest, components)
        components["SubmitRequest"] = submit_schema(app, components)
        _schedule_schemas(app, components)
        upload = upload_body(app)
        if upload is not None:
            components["SubmitUploadRequest"] = submit_schema(app, components, uploads=True)
            body = schema["paths"]["/v1/tasks"]["post"]["requestBody"]
            body["content"]["multipart/form-data"] = upload
        for model in (ReviewRequest, BatchRequest, RerunRequest, CancelRequest, RetryRequest):
            components[model.__name__] = _model_schema(model, components)
        components["BatchItem"] = batch_item_schema(components)
        components["BatchRequest"]["properties"]["tasks"]["items"] = _ref("BatchItem")
        if not settings.auth_enabled:
            _without_security(schema)
        api.openapi_schema = schema
        return schema

    return build
