"""Structured logs: a stable event name per line plus the ids, as text or JSON.

Engine code logs ``log.info("transition", extra={"task_id": ..., "from": ..., ...})``;
these formatters print the extras, so one line per transition carries task id, attempt,
epoch, from, to and the time spent in the previous status. Keys that could carry secrets
are never printed.

A busy worker logs thousands of lines a second (docs/benchmarks-history.md, "Engine logs"). So
a line is built in one pass over the record; the per-transition lines go through
:func:`line`, which skips the LogRecord when kiln's own handler is their only sink; and
:class:`StderrHandler` writes lines in batches: within ``FLUSH_INTERVAL_S`` of the first
one waiting, at once for a warning or worse, and all of them when the process exits
normally (kiln's commands handle SIGTERM and exit normally). Only a process killed
outright (SIGKILL, or a signal nothing handles) can lose the lines of its last
``FLUSH_INTERVAL_S``.
"""

from __future__ import annotations

import atexit
import json
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

#: Attributes every LogRecord has; anything else on a record came in through ``extra``.
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys() | {"message", "asctime", "taskName"}
)
#: Never printed, whatever a caller passes.
SECRET_KEYS = frozenset({"api_key", "access_token", "authorization", "password", "secret", "key"})
REDACTED = "[redacted]"
#: A line waits at most this long before it is written.
FLUSH_INTERVAL_S = 0.1
#: Lines written at once, without waiting, when this many are waiting.
FLUSH_LINES = 512
#: The writer thread ends after this long with nothing to write.
WRITER_IDLE_S = 30.0

_encode = json.JSONEncoder(default=str).encode  # json.dumps(..., default=str), built once


def extras(record: logging.LogRecord) -> dict[str, Any]:
    return {
        name: REDACTED if name.lower() in SECRET_KEYS else value
        for name, value in vars(record).items()
        if name not in _STANDARD and name[:1] != "_"
    }


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind is str or kind is int:  # the usual case first, without isinstance
        return value
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, str | int | bool) or value is None:
        return value
    return str(value)


class _Stamp:
    """``strftime`` of a second, computed once per second, plus the milliseconds."""

    def __init__(self, pattern: str, convert: Any, end: str = "") -> None:
        self.pattern, self.convert, self.end = pattern, convert, end
        self.cached: tuple[int, str] = (-1, "")

    def __call__(self, created: float, msecs: float) -> str:
        second = int(created)
        cached = self.cached  # one tuple, read and replaced whole: safe across threads
        if cached[0] != second:
            cached = (second, time.strftime(self.pattern, self.convert(created)))
            self.cached = cached
        return f"{cached[1]}.{int(msecs):03d}{self.end}"


def _record_extras(record: logging.LogRecord) -> Iterator[tuple[str, Any]]:
    for name, value in vars(record).items():
        if name not in _STANDARD and name[:1] != "_":
            yield name, value


class LineFormatter(logging.Formatter):
    """A formatter that also builds a line from its parts, with no LogRecord (see :func:`line`)."""

    def format(self, record: logging.LogRecord) -> str:
        exc = self.formatException(record.exc_info) if record.exc_info else None
        return self.build(
            record.created,
            record.msecs,
            record.levelname,
            record.name,
            record.getMessage(),
            _record_extras(record),
            exc,
        )

    def build(
        self,
        created: float,
        msecs: float,
        level: str,
        logger: str,
        event: str,
        fields: Iterable[tuple[str, Any]],
        exc: str | None = None,
    ) -> str:
        raise NotImplementedError


class JsonFormatter(LineFormatter):
    """One JSON object per line: ts, level, logger, event, then the extras."""

    def __init__(self) -> None:
        super().__init__()
        self._stamp = _Stamp("%Y-%m-%dT%H:%M:%S", time.gmtime, "Z")

    def build(
        self,
        created: float,
        msecs: float,
        level: str,
        logger: str,
        event: str,
        fields: Iterable[tuple[str, Any]],
        exc: str | None = None,
    ) -> str:
        body: dict[str, Any] = {
            "ts": self._stamp(created, msecs),
            "level": level.lower(),
            "logger": logger,
            "event": event,
        }
        for name, value in fields:
            body[name] = REDACTED if name.lower() in SECRET_KEYS else _plain(value)
        if exc is not None:
            body["exc"] = exc
        return _encode(body)


class TextFormatter(LineFormatter):
    """``time level logger event key=value ...``, readable in a terminal."""

    def __init__(self) -> None:
        super().__init__()
        self._stamp = _Stamp("%H:%M:%S", time.localtime)

    def build(
        self,
        created: float,
        msecs: float,
        level: str,
        logger: str,
        event: str,
        fields: Iterable[tuple[str, Any]],
        exc: str | None = None,
    ) -> str:
        parts = [f"{self._stamp(created, msecs)} {level:<5} {logger} {event}"]
        for name, value in fields:
            shown = REDACTED if name.lower() in SECRET_KEYS else _plain(value)
            parts.append(f"{name}={shown}")
        text = " ".join(parts)
        return text if exc is None else f"{text}\n{exc}"


#: A line logged through :func:`line`, formatted when it is written: time, logger, event, fields.
_Pending = tuple[float, str, str, dict[str, Any]]


class StderrHandler(logging.Handler):
    """Writes lines to ``sys.stderr`` (whatever it is when a line comes) in batches.

    A line waits in a list, and a daemon thread writes the list ``FLUSH_INTERVAL_S`` after
    its first line. A warning or worse, ``FLUSH_LINES`` waiting lines, a change of
    ``sys.stderr``, :meth:`flush` and the exit of the process write them at once, in the
    order they were logged; after the exit has begun, each line is written as it comes. A
    record is formatted when it is logged; a line that came through :func:`line` is
    formatted when it is written, with the others of its batch.
    """

    def __init__(self) -> None:
        super().__init__()
        assert self.lock is not None  # made by Handler.__init__, re-made in a forked child
        self._mutex = self.lock
        self._lines: list[str | _Pending] = []
        self._stream: Any = None
        self._due = threading.Event()
        self._writer: threading.Thread | None = None
        self._exiting = False
        atexit.register(self._at_exit)  # runs before logging.shutdown, which was registered first

    def handle(self, record: logging.LogRecord) -> bool:
        # logging.Handler.handle holds the lock around emit; emit takes it itself, only
        # around the list, and not while it formats.
        if self.filters:
            kept = self.filter(record)
            if not kept:
                return False
            if isinstance(kept, logging.LogRecord):  # Python 3.12+: a filter may replace it
                record = kept
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self._add(text, now=record.levelno >= logging.WARNING)

    def put(self, logger: str, event: str, fields: dict[str, Any]) -> None:
        """Queue an INFO line of ``event`` with ``fields`` (not changed afterwards)."""
        self._add((time.time(), logger, event, fields), now=False)

    def _add(self, item: str | _Pending, now: bool) -> None:
        stream = sys.stderr
        with self._mutex:
            if stream is not self._stream:
                self._write()  # what waits goes where it was meant to go
                self._stream = stream
            self._lines.append(item)
            waiting = len(self._lines)
            if now or waiting >= FLUSH_LINES or self._exiting:
                self._write()
            elif waiting == 1:
                self._wake_writer()

    def flush(self) -> None:
        with self._mutex:
            self._write()

    def close(self) -> None:
        # Not the end of the lines: logging.config.dictConfig (uvicorn at start) closes every
        # handler, and kiln's loggers go on using this one.
        self.flush()
        super().close()

    def _at_exit(self) -> None:
        with self._mutex:
            self._exiting = True  # from now on every line is written at once
            self._write()

    def _write(self) -> None:
        """Write the waiting lines (the caller holds the lock)."""
        items, self._lines = self._lines, []
        if not items or self._stream is None:  # no stderr at all (pythonw): lines are dropped
            return
        texts = [text for text in map(self._text, items) if text is not None]
        if not texts:
            return
        try:
            self._stream.write("\n".join(texts) + "\n")
            self._stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: nowhere left to write
            pass

    def _text(self, item: str | _Pending) -> str | None:
        if isinstance(item, str):
            return item
        created, logger, event, fields = item
        record = None
        try:
            if isinstance(self.formatter, LineFormatter):
                msecs = (created - int(created)) * 1000
                return self.formatter.build(created, msecs, "INFO", logger, event, fields.items())
            record = logging.makeLogRecord({**fields, "name": logger, "msg": event})
            return self.format(record)
        except Exception:  # as logging does with a record it cannot format
            self.handleError(record or logging.makeLogRecord({"name": logger, "msg": event}))
            return None

    def _wake_writer(self) -> None:
        """Have the writer write the waiting lines soon (the caller holds the lock)."""
        if self._writer is None or not self._writer.is_alive():  # none yet, idle, or forked
            self._due = threading.Event()
            self._writer = threading.Thread(
                target=self._run_writer, args=(self._due,), name="kiln-logs", daemon=True
            )
            self._writer.start()
        self._due.set()

    def _run_writer(self, due: threading.Event) -> None:
        while True:
            if not due.wait(WRITER_IDLE_S):
                with self._mutex:
                    if not due.is_set():  # still nothing to write: end; the next line starts one
                        self._writer = None
                        return
            due.clear()
            time.sleep(FLUSH_INTERVAL_S)
            self.flush()


def line(logger: logging.Logger, event: str, fields: dict[str, Any]) -> None:
    """``logger.info(event, extra=fields)`` for the lines of the hot path (one per transition).

    When the line can only end in kiln's own handler (set up by :func:`setup`, with no
    filter on the way), it goes there with no LogRecord, and is formatted when written.
    Otherwise, as with a host application's own handlers or pytest's ``caplog``, it is a
    plain ``logger.info``. ``fields`` must not change afterwards.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _sole_handler(logger)
    if handler is None:
        logger.info(event, extra=fields)
    else:
        handler.put(logger.name, event, fields)


def _sole_handler(logger: logging.Logger) -> StderrHandler | None:
    """The handler every line of ``logger`` ends in, when it is kiln's only one."""
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters or current.disabled:
            return None
        handlers = current.handlers
        if handlers:
            if current.propagate or len(handlers) != 1:
                return None
            handler = handlers[0]
            if type(handler) is not StderrHandler or handler.filters:
                return None
            return handler if handler.level <= logging.INFO else None
        if not current.propagate:
            return None
        current = current.parent
    return None


def setup(*, fmt: str = "text", level: str = "INFO") -> None:
    """Configure the ``kiln`` loggers: ``fmt`` is ``text`` or ``json``."""
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger = logging.getLogger("kiln")
    for old in logger.handlers:
        old.flush()
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
