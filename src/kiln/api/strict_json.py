"""Strict JSON in, renderable JSON out.

What a request body may hold: finite numbers only (no ``NaN``, ``Infinity`` or a literal
such as ``1e400`` that overflows to infinity), no lone surrogates, and at most
:data:`MAX_DEPTH` levels of nesting. What the API answers with must always render: a
stored value that is not plain JSON (a non-finite number written past the API, nesting
too deep for the encoder) is shown as null rather than failing the whole answer.

Both walks are iterative, so no input can exhaust the interpreter's stack here.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from starlette.responses import JSONResponse

from kiln.errors import InvalidRequest

log = logging.getLogger("kiln.api")

#: The deepest nesting of arrays and objects a request body may have.
MAX_DEPTH = 64


class _NotFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"the number {text[:40]} is not finite")
    return value


def _no_constant(name: str) -> Any:
    raise _NotFinite(f"{name} is not a finite number")


def _what(where: str) -> str:
    return "the request body" if where == "body" else f"the {where!r} part"


def _refusal(where: str, message: str, msg: str, kind: str) -> InvalidRequest:
    detail = {"loc": [where], "msg": msg[:300], "type": kind}
    return InvalidRequest(message, details=[detail])


def depth_of(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep ``value`` nests (a scalar is 0), counted up to ``limit + 1`` at most."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if depth > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth) for child in children)
    return deepest


#: ``json.dumps(data, ensure_ascii=False)``, its encoder made once.
_SURROGATES = json.JSONEncoder(ensure_ascii=False)


def parse_json(body: bytes, where: str = "body") -> Any:
    """The JSON in ``body``, or InvalidRequest (422) saying exactly what is wrong."""
    what = _what(where)
    if not body.strip():
        raise InvalidRequest(f"{what} is empty: send a JSON object")
    try:
        data = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
        if b"\\u" in body:  # a lone surrogate reaches the data only as an escape
            _SURROGATES.encode(data).encode("utf-8")
    except _NotFinite as exc:
        message = f"{what} holds a number that is not finite: {exc}"
        raise _refusal(where, message, str(exc), "finite_number") from None
    except RecursionError:
        raise _too_deep(where) from None
    except ValueError as exc:
        raise _refusal(where, f"{what} is not valid JSON", str(exc), "json_invalid") from None
    # Nesting is at most as deep as the text has brackets (those in strings counted too).
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and depth_of(data) > MAX_DEPTH:
        raise _too_deep(where)
    return data


def _too_deep(where: str) -> InvalidRequest:
    message = f"{_what(where)} is nested deeper than {MAX_DEPTH} levels of arrays and objects"
    return _refusal(where, message, message, "too_deep")


def _cleaned(value: Any) -> Any:
    """A copy of ``value`` with every unrenderable leaf (or subtree) replaced by None."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any, int]] = [(value, root, 0, 0)]
    while stack:
        item, parent, key, depth = stack.pop()
        if isinstance(item, dict | list) and depth >= 4 * MAX_DEPTH:
            parent[key] = None
        elif isinstance(item, dict):
            parent[key] = copy = {str(k): None for k in item}
            stack.extend((v, copy, str(k), depth + 1) for k, v in item.items())
        elif isinstance(item, list):
            parent[key] = copy_list = [None] * len(item)
            stack.extend((v, copy_list, i, depth + 1) for i, v in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            parent[key] = None
        elif item is None or isinstance(item, str | int | float | bool):
            parent[key] = item
        else:
            parent[key] = None
    return root[0]


class RenderedJSON(JSONResponse):
    """A JSON answer that always renders: when the content is not plain JSON (a stored
    non-finite number, say), the offending values are shown as null and it is logged."""

    def render(self, content: Any) -> bytes:
        try:
            return _RENDER.encode(content).encode("utf-8")
        except (ValueError, RecursionError, TypeError) as exc:
            log.warning("response_degraded", extra={"error": type(exc).__name__})
            return super().render(_cleaned(content))


#: What ``JSONResponse.render`` does (``json.dumps`` with these options), its encoder made
#: once instead of on every answer.
_RENDER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
