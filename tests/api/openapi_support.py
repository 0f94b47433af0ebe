"""The served OpenAPI document as a validator of request bodies (jsonschema), and a kiln
app with every kind `kiln serve` registers."""

from __future__ import annotations

import datetime as dt
from typing import Any

import jsonschema

import kiln
from kiln.cli.base import with_builtin_kinds
from kiln.config import Settings

FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _rfc3339(value: object) -> bool:
    """An RFC 3339 time with its offset (jsonschema checks date-time only with an extra)."""
    if not isinstance(value, str) or "T" not in value.upper():
        return False
    return dt.datetime.fromisoformat(value.replace("z", "Z")).tzinfo is not None


def served_kiln(settings: Settings) -> kiln.App:
    """A kiln App with the kinds `kiln serve` has: image.generate (on the settings'
    backend, the demo by default), image.transform and image.contact_sheet (the two take
    inputs), comfy.workflow."""
    return with_builtin_kinds(kiln.App(settings=settings))


def body_schema(document: dict[str, Any], method: str, path: str, media: str) -> dict[str, Any]:
    """The schema of an operation's body (of the ``request`` part, for multipart), with
    the document's components beside it so that its references resolve."""
    operation = document["paths"][path][method.lower()]
    schema = operation["requestBody"]["content"][media]["schema"]
    if media == "multipart/form-data":
        schema = schema["properties"]["request"]
    return {**schema, "components": document["components"]}


def body_errors(
    document: dict[str, Any], method: str, path: str, body: Any, *, multipart: bool = False
) -> list[str]:
    """Why the document refuses ``body``, or [] when it takes it."""
    media = "multipart/form-data" if multipart else "application/json"
    validator = jsonschema.Draft202012Validator(
        body_schema(document, method, path, media), format_checker=FORMATS
    )
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]
