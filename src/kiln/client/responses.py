"""A response read back: the error envelope to the matching
:class:`~kiln.errors.KilnError` (:func:`error_from_response`), a broken connection to
:class:`ConnectionFailed`, and the readers a :class:`~kiln.client.calls.Call` names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from kiln import errors, wire
from kiln.errors import KilnError

JSON = dict[str, Any]


class ConnectionFailed(KilnError):
    """The server could not be reached, or the connection broke and could not be resumed."""

    code = "connection_failed"


def _error_classes() -> dict[str, type[KilnError]]:
    found: dict[str, type[KilnError]] = {}
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, KilnError) and value is not KilnError:
            found.setdefault(value.code, value)
    return found


#: API error code → the error class the client raises for it.
ERROR_CLASSES: Mapping[str, type[KilnError]] = _error_classes()

#: Used when a response carries no recognisable error envelope.
STATUS_CLASSES: Mapping[int, type[KilnError]] = {
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    413: errors.PayloadTooLarge,
    415: errors.UnsupportedMediaType,
    422: errors.InvalidRequest,
    429: errors.RateLimited,
}


# responses and errors


def _envelope(response: httpx.Response) -> tuple[str | None, str, list[Any]]:
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        details = error.get("details")
        return (
            str(error.get("code") or "") or None,
            str(error.get("message") or response.reason_phrase),
            details if isinstance(details, list) else [],
        )
    text = response.text.strip()[:200] if response.content else ""
    return None, text or f"HTTP {response.status_code} {response.reason_phrase}".strip(), []


def _retry_after_s(response: httpx.Response) -> float:
    try:
        return max(float(response.headers.get("Retry-After", "1")), 0.0)
    except ValueError:
        return 1.0


def error_from_response(response: httpx.Response) -> KilnError:
    """The KilnError subclass an error response's ``error.code`` names, with ``status_code``."""
    code, message, details = _envelope(response)
    cls = ERROR_CLASSES.get(code or "") or STATUS_CLASSES.get(response.status_code, KilnError)
    exc: KilnError
    if cls is errors.RateLimited:
        exc = errors.RateLimited(message, retry_after_s=_retry_after_s(response))
        exc.details = details
    else:
        exc = cls(message, details=details)
    if code and code != cls.code:
        exc.code = code  # a code this client does not know keeps its name
    exc.status_code = response.status_code  # type: ignore[attr-defined]
    return exc


def connection_failed(server: str, exc: httpx.TransportError) -> ConnectionFailed:
    reason = str(exc) or type(exc).__name__
    if "Connection refused" in reason or "Errno 111" in reason:
        reason = "connection refused"
    return ConnectionFailed(f"cannot reach {server}: {reason}")


def read_json(response: httpx.Response) -> Any:
    if response.is_error:
        raise error_from_response(response)
    return response.json()


def read_bytes(response: httpx.Response) -> bytes:
    if response.is_error:
        raise error_from_response(response)
    return response.content


def read_submitted(response: httpx.Response) -> JSON:
    """The task, plus whether this request created it, replayed a key or hit a duplicate."""
    task: JSON = read_json(response)
    task["created"] = response.status_code == 201
    task["replayed"] = response.headers.get(wire.REPLAYED_HEADER, "").lower() == "true"
    task["deduplicated"] = bool(task.get("deduplicated", False))
    return task
