"""Inputs sent with a submission: by content (:func:`input_reference`, a
``sha256:`` reference the server already holds) or as files in a
``multipart/form-data`` body (:func:`multipart_parts`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

#: An input named by its content: ``sha256:<64 hex>`` (docs/uploads.md, "Inputs by
#: reference").
REFERENCE_PREFIX = "sha256:"


def input_reference(source: bytes | str | os.PathLike[str]) -> str:
    """The reference that names these bytes (or the file at this path) as an input of a
    submission, ``sha256:<hex>``, so that content the tenant already uploaded, or a task
    of its made, is not sent again: ``client.submit(kind, params, inputs={"image": ref})``.
    A reference the server does not know for the tenant is 422: upload the file then."""
    digest = hashlib.sha256()
    if isinstance(source, bytes):
        digest.update(source)
    else:
        with open(source, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    return REFERENCE_PREFIX + digest.hexdigest()


def multipart_parts(body: Mapping[str, Any], files: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a submission with files: the body as the JSON part ``request``, then
    the files, as httpx takes them (``{"image": ("fox.png", data)}``)."""
    parts: dict[str, Any] = {"request": (None, json.dumps(body), "application/json")}
    parts.update(files)
    return parts
