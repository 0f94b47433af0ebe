"""Structured logs: a stable event name per line plus the ids, as text or JSON.

Engine code logs ``log.info("transition", extra={"task_id": ..., "from": ..., ...})``;
these formatters print the extras, so one line per transition carries task id, attempt,
epoch, from, to and the time spent in the previous status. Keys that could carry secrets
are never printed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

#: Attributes every LogRecord has; anything else on a record came in through ``extra``.
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys() | {"message", "asctime", "taskName"}
)
#: Never printed, whatever a caller passes.
SECRET_KEYS = frozenset({"api_key", "access_token", "authorization", "password", "secret", "key"})


def extras(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, value in vars(record).items():
        if name in _STANDARD or name.startswith("_"):
            continue
        fields[name] = "[redacted]" if name.lower() in SECRET_KEYS else value
    return fields


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, str | int | bool) or value is None:
        return value
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, then the extras."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        body.update({k: _plain(v) for k, v in extras(record).items()})
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger event key=value ...``, readable in a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        pairs = " ".join(f"{k}={_plain(v)}" for k, v in extras(record).items())
        line = f"{stamp}.{int(record.msecs):03d} {record.levelname:<5} {record.name} "
        line += record.getMessage() + (f" {pairs}" if pairs else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes, not when it was built."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup(*, fmt: str = "text", level: str = "INFO") -> None:
    """Configure the ``kiln`` loggers: ``fmt`` is ``text`` or ``json``."""
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger = logging.getLogger("kiln")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
