"""Engine log lines: their text and JSON shapes, and when they reach stderr."""

from __future__ import annotations

import json
import logging
import logging.config
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from logging import LogRecord
from pathlib import Path

import pytest

from kiln import logs

SRC = Path(__file__).resolve().parents[2] / "src"
TRANSITION = {
    "task_id": "tsk_01", "attempt": 1, "epoch": 2, "from": "PENDING",
    "to": "WAITING_FOR_RESOURCE", "event": "claim", "duration_s": 0.12345678, "worker": "w:1",
}  # fmt: skip
TEXT_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (\w+) +(\S+) (\S+)(?: (.*))?$")


@pytest.fixture(autouse=True)
def _kiln_logger_restored() -> Iterator[None]:
    """Each test configures the ``kiln`` logger; put it back as it was."""
    logger = logging.getLogger("kiln")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    for handler in logger.handlers:
        handler.flush()
    logger.handlers[:], logger.level, logger.propagate = saved


def record(msg: str = "transition", level: int = logging.INFO, **extra: object) -> LogRecord:
    return logging.getLogger("kiln.store").makeRecord(
        "kiln.store", level, __file__, 1, msg, (), None, extra=extra
    )


def test_json_line_carries_ts_level_logger_event_then_the_extras_in_order() -> None:
    line = logs.JsonFormatter().format(record(**TRANSITION))

    body = json.loads(line)
    extra_keys = [k for k in TRANSITION if k != "event"]
    assert list(body) == ["ts", "level", "logger", "event", *extra_keys]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", body["ts"])
    assert body["level"] == "info"
    assert body["logger"] == "kiln.store"
    assert body["event"] == "claim"  # an extra named event wins over the message
    assert body["duration_s"] == 0.123457  # floats rounded to 6 places
    assert {k: body[k] for k in ("task_id", "attempt", "epoch", "from", "to", "worker")} == {
        k: TRANSITION[k] for k in ("task_id", "attempt", "epoch", "from", "to", "worker")
    }


def test_json_line_prints_other_values_as_text_and_redacts_secret_keys() -> None:
    rec = record(
        "request_failed", logging.WARNING, code=None, ok=True, path=Path("/a"),
        api_key="k", Password="p", signals=[1, 2],
    )  # fmt: skip
    line = logs.JsonFormatter().format(rec)

    body = json.loads(line)
    assert body["event"] == "request_failed"
    assert body["level"] == "warning"
    assert body["code"] is None and body["ok"] is True
    assert body["path"] == "/a"
    assert body["signals"] == "[1, 2]"
    assert body["api_key"] == "[redacted]" and body["Password"] == "[redacted]"


def test_json_line_carries_the_exception() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.getLogger("kiln").makeRecord(
            "kiln", logging.ERROR, __file__, 1, "sweep_failed", (), sys.exc_info()
        )

    body = json.loads(logs.JsonFormatter().format(rec))
    assert body["event"] == "sweep_failed"
    assert body["exc"].startswith("Traceback") and "ValueError: boom" in body["exc"]


def test_text_line_is_time_level_logger_event_then_key_values() -> None:
    line = logs.TextFormatter().format(record(**TRANSITION))

    match = TEXT_LINE.match(line)
    assert match is not None, line
    assert match.groups() == (
        "INFO", "kiln.store", "transition",
        "task_id=tsk_01 attempt=1 epoch=2 from=PENDING to=WAITING_FOR_RESOURCE event=claim"
        " duration_s=0.123457 worker=w:1",
    )  # fmt: skip
    assert line[13:19] == "INFO  "  # the level padded to 5


def test_text_line_without_extras_ends_with_the_event_and_redacts_secrets() -> None:
    assert logs.TextFormatter().format(record("signalled")).endswith(" kiln.store signalled")
    assert logs.TextFormatter().format(record("x", secret="s")).endswith(" x secret=[redacted]")


def test_text_line_time_is_local_and_changes_with_the_record() -> None:
    first, later = record("a"), record("b")
    later.created, later.msecs = first.created + 61.25, 250.0

    stamp = logs.TextFormatter().format(later)[:12]

    expected = time.strftime("%H:%M:%S", time.localtime(later.created)) + ".250"
    assert stamp == expected


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_line_reaches_stderr_promptly_without_more_logging(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given logs set up as `kiln worker` does
    logs.setup(fmt=fmt, level="INFO")

    # When one line is logged and nothing else
    logging.getLogger("kiln.worker").info("worker_drained", extra={"worker_id": "w"})

    # Then it is on stderr within a fraction of a second
    deadline = time.monotonic() + 1.0
    seen = ""
    while "worker_drained" not in seen and time.monotonic() < deadline:
        time.sleep(0.02)
        seen += capsys.readouterr().err
    assert "worker_drained" in seen
    assert seen.count("\n") == 1


def test_warnings_reach_stderr_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup(fmt="text", level="INFO")
    log = logging.getLogger("kiln.worker")

    log.info("attempt_released", extra={"task_id": "t"})
    log.warning("lease_lost", extra={"task_id": "t"})

    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[3] for line in lines] == ["attempt_released", "lease_lost"]


def test_lines_wait_for_the_batch_even_after_dict_config_closed_the_handler(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given logs set up, then logging.config.dictConfig run (uvicorn does, at start): it
    # closes every handler, kiln's included, and kiln's loggers go on using it
    monkeypatch.setattr(logs, "FLUSH_INTERVAL_S", 5.0)
    logs.setup(fmt="text", level="INFO")
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})

    # When an INFO line is logged
    logs.line(logging.getLogger("kiln.store"), "transition", dict(TRANSITION))

    # Then it still waits for its batch, and is written by the next flush
    assert capsys.readouterr().err == ""
    logging.getLogger("kiln").handlers[0].flush()
    assert " transition task_id=tsk_01 " in capsys.readouterr().err


def test_lines_below_the_level_are_not_written(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup(fmt="text", level="WARNING")

    logging.getLogger("kiln").info("transition", extra=TRANSITION)
    logging.getLogger("kiln").error("sweep_failed")

    assert [line.split()[3] for line in capsys.readouterr().err.splitlines()] == ["sweep_failed"]


SCRIPT = """
import logging, sys
from kiln import logs
logs.setup(fmt=sys.argv[1])
log = logging.getLogger("kiln.store")
for n in range(int(sys.argv[2])):
    log.info("transition", extra={"task_id": f"tsk_{n}", "attempt": 1, "epoch": 1,
             "from": "PENDING", "to": "WAITING_FOR_RESOURCE", "event": "claim",
             "duration_s": 0.5, "worker": "w"})
"""


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_every_line_is_written_before_a_process_exits(fmt: str) -> None:
    # Given a process that logs many lines quickly and exits at once
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, fmt, "5000"], capture_output=True, text=True,
        env={"PYTHONPATH": str(SRC)}, timeout=60, check=True,
    )  # fmt: skip

    # Then every line is there, whole and in order
    lines = done.stderr.splitlines()
    assert len(lines) == 5000
    if fmt == "json":
        bodies = [json.loads(line) for line in lines]
        assert [b["task_id"] for b in bodies] == [f"tsk_{n}" for n in range(5000)]
        assert {tuple(b) for b in bodies} == {
            ("ts", "level", "logger", "event", "task_id", "attempt", "epoch", "from", "to",
             "duration_s", "worker")
        }  # fmt: skip
    else:
        assert [line.split()[4] for line in lines] == [f"task_id=tsk_{n}" for n in range(5000)]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_hot_path_line_is_the_line_log_info_writes(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given logs set up as `kiln worker` does
    logs.setup(fmt=fmt, level="INFO")
    log = logging.getLogger("kiln.store")

    # When the same transition goes through log.info and through logs.line
    log.info("transition", extra=TRANSITION)
    logs.line(log, "transition", dict(TRANSITION))
    logging.getLogger("kiln").handlers[0].flush()

    # Then both lines are the same but for the time
    first, second = capsys.readouterr().err.splitlines()
    if fmt == "json":
        assert {**json.loads(first), "ts": ""} == {**json.loads(second), "ts": ""}
        assert list(json.loads(first)) == list(json.loads(second))
    else:
        assert first[12:] == second[12:]


def test_a_hot_path_line_reaches_other_handlers_as_a_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given the kiln logger left to propagate, as a library in a host application
    logger = logging.getLogger("kiln")
    logger.handlers[:], logger.propagate = [], True

    # When a transition is logged on the hot path
    with caplog.at_level(logging.INFO, logger="kiln"):
        logs.line(logging.getLogger("kiln.store"), "transition", dict(TRANSITION))

    # Then the host's handlers get the usual record, extras and all
    (rec,) = caplog.records
    assert rec.getMessage() == "transition" and rec.name == "kiln.store"
    assert logs.extras(rec) == TRANSITION


def test_a_hot_path_line_below_the_level_is_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup(fmt="text", level="WARNING")

    logs.line(logging.getLogger("kiln.store"), "transition", dict(TRANSITION))
    logging.getLogger("kiln").handlers[0].flush()

    assert capsys.readouterr().err == ""


def test_a_hot_path_line_that_cannot_be_formatted_leaves_the_others(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    monkeypatch.setattr(logging, "raiseExceptions", False)  # as in production
    logs.setup(fmt="json", level="INFO")
    log = logging.getLogger("kiln.store")

    logs.line(log, "transition", {"task_id": "a"})
    logs.line(log, "transition", {"task_id": "b", "odd": Unprintable()})
    logs.line(log, "transition", {"task_id": "c"})
    logging.getLogger("kiln").handlers[0].flush()

    lines = capsys.readouterr().err.splitlines()
    assert [json.loads(line)["task_id"] for line in lines] == ["a", "c"]
