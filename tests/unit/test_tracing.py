"""Spans built from event rows (kiln/tracing.py), exported through the OpenTelemetry SDK's
in-memory exporter: names, parents, moments, attributes and outcomes of attempts."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kiln.config import Settings
from kiln.errors import ConfigError
from kiln.models import Task, TaskEvent, Timeouts, TraceContext
from kiln.states import Event, Status
from kiln.tracing import (
    Tracing,
    attempt_headers,
    attempt_span_id,
    open_tracing,
    parse_traceparent,
    spans_of,
    wanted,
)

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SUBMITTER = 0x00F067AA0BA902B7
STORED = TraceContext(f"00-{TRACE:032x}-{SUBMITTER:016x}-01", "vendor=1")
TASK_ID = "t_0001"


@pytest.fixture
def exported() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    tracing = Tracing(SimpleSpanProcessor(memory))
    yield tracing, memory
    tracing.close()


def make_task(**changes: Any) -> Task:
    task = Task(
        id=TASK_ID, tenant="acme", kind="image.generate", status=Status.SUCCESS, params={},
        metadata={}, inputs=[], priority=0, attempt=1, max_attempts=3, epoch=1, version=5,
        idempotency_key=None, dedup_key=None, fingerprint="f", lease_owner=None,
        lease_expires_at=None, state_deadline_at=None, deadline_s=3600.0, deadline_at=3700.0,
        timeouts=Timeouts(), stage=None, progress_step=None, progress_total=None,
        progress_at=None, cancel_requested=False, cancel_requested_at=None, next_retry_at=None,
        ready_at=100.0, result_prefix=None, error=None, result=None, created_at=100.0,
        updated_at=111.0, status_since=111.0, started_at=101.0, finished_at=111.0,
    )  # fmt: skip
    return replace(task, **changes)


class Log:
    """Event rows of one task, written as its states pass."""

    def __init__(self) -> None:
        self.rows: list[TaskEvent] = []

    def add(
        self, event: Event, source: Status | None, target: Status, at: float, dwell: float | None,
        *, attempt: int, epoch: int, error: dict[str, Any] | None = None,
    ) -> TaskEvent:  # fmt: skip
        seq = len(self.rows) + 1
        row = TaskEvent(seq, f"{TASK_ID}:{seq}", TASK_ID, "acme", event, source, target,
                        attempt, epoch, error, at, dwell, False)  # fmt: skip
        self.rows.append(row)
        return row


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


def test_an_attempt_is_one_span_with_a_child_per_state_at_the_log_s_moments(
    exported: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, memory = exported
    # Given a task's log: queued 3 s, waited 1 s for a GPU, generated 6 s (a model load
    # inside), uploaded 1 s
    log = Log()
    log.add(Event.SUBMIT, None, Status.PENDING, 100.0, None, attempt=0, epoch=0)
    log.add(Event.CLAIM, Status.PENDING, Status.WAITING_FOR_RESOURCE, 103.0, 3.0, attempt=1,
            epoch=1)  # fmt: skip
    log.add(Event.ACQUIRE, Status.WAITING_FOR_RESOURCE, Status.GENERATING, 104.0, 1.0,
            attempt=1, epoch=1)  # fmt: skip
    log.add(Event.GENERATED, Status.GENERATING, Status.UPLOADING, 110.0, 6.0, attempt=1, epoch=1)
    end = log.add(Event.UPLOADED, Status.UPLOADING, Status.SUCCESS, 111.0, 1.0, attempt=1,
                  epoch=1)  # fmt: skip
    # When the change that ended the attempt is traced
    tracing.emit(spans_of(make_task(model="m1"), log.rows, [end], STORED,
                          [("m1", 104.5, 106.0)]))  # fmt: skip
    spans = by_name(memory.get_finished_spans())
    # Then one attempt span under the submitter's span, and one child per state
    assert set(spans) == {"kiln.attempt", "kiln.queue", "kiln.resource_wait", "kiln.generate",
                          "kiln.upload", "kiln.load_model"}  # fmt: skip
    attempt = spans["kiln.attempt"]
    assert attempt.context is not None and attempt.parent is not None
    assert (attempt.context.trace_id, attempt.parent.span_id) == (TRACE, SUBMITTER)
    assert (attempt.start_time, attempt.end_time) == (ns(100.0), ns(111.0))
    assert attempt.kind is SpanKind.INTERNAL
    assert attempt.status.status_code is StatusCode.UNSET
    assert dict(attempt.attributes or {}) == {
        "kiln.task_id": TASK_ID, "kiln.tenant": "acme", "kiln.kind": "image.generate",
        "kiln.attempt": 1, "kiln.outcome": "success", "kiln.epoch": 1, "kiln.model": "m1",
    }  # fmt: skip
    moments = {name: (span.start_time, span.end_time) for name, span in spans.items()}
    assert moments["kiln.queue"] == (ns(100.0), ns(103.0))
    assert moments["kiln.resource_wait"] == (ns(103.0), ns(104.0))
    assert moments["kiln.generate"] == (ns(104.0), ns(110.0))
    assert moments["kiln.upload"] == (ns(110.0), ns(111.0))
    assert moments["kiln.load_model"] == (ns(104.5), ns(106.0))
    generate = spans["kiln.generate"]
    assert generate.context is not None
    for name in ("kiln.queue", "kiln.resource_wait", "kiln.generate", "kiln.upload"):
        parent = spans[name].parent
        assert parent is not None and parent.span_id == attempt.context.span_id, name
        assert spans[name].context.trace_id == TRACE  # type: ignore[union-attr]
        assert (spans[name].attributes or {})["kiln.attempt"] == 1
    load = spans["kiln.load_model"]
    assert load.parent is not None and load.parent.span_id == generate.context.span_id
    assert (load.attributes or {})["kiln.model"] == "m1"
    # And the worker's outgoing HTTP during the attempt names that very generate span
    headers = attempt_headers(TASK_ID, 1, STORED)
    assert headers == {"traceparent": f"00-{TRACE:032x}-{generate.context.span_id:016x}-01",
                       "tracestate": "vendor=1"}  # fmt: skip


def test_a_failed_attempt_then_its_retry_are_two_attempt_spans_of_one_trace(
    exported: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, memory = exported
    log = Log()
    log.add(Event.SUBMIT, None, Status.PENDING, 100.0, None, attempt=0, epoch=0)
    log.add(Event.CLAIM, Status.PENDING, Status.GENERATING, 101.0, 1.0, attempt=1, epoch=1)
    error = {"code": "upstream_unavailable", "message": "no answer", "retryable": True}
    failed = log.add(Event.FAIL, Status.GENERATING, Status.FAILED, 105.0, 4.0, attempt=1,
                     epoch=1, error=error)  # fmt: skip
    retrying = log.add(Event.SCHEDULE_RETRY, Status.FAILED, Status.RETRYING, 105.0, 0.0,
                       attempt=1, epoch=1, error=error)  # fmt: skip
    tracing.emit(spans_of(make_task(), log.rows, [failed, retrying], STORED))
    first = by_name(memory.get_finished_spans())
    memory.clear()
    log.add(Event.CLAIM, Status.RETRYING, Status.GENERATING, 107.0, 2.0, attempt=2, epoch=2)
    log.add(Event.GENERATED, Status.GENERATING, Status.UPLOADING, 109.0, 2.0, attempt=2, epoch=2)
    end = log.add(Event.UPLOADED, Status.UPLOADING, Status.SUCCESS, 110.0, 1.0, attempt=2,
                  epoch=2)  # fmt: skip
    tracing.emit(spans_of(make_task(attempt=2, epoch=2), log.rows, [end], STORED))
    second = by_name(memory.get_finished_spans())

    # The first attempt failed (an error span, a retry planned); a claim that acquired at
    # once has no resource wait
    assert set(first) == {"kiln.attempt", "kiln.queue", "kiln.generate"}
    attempt = first["kiln.attempt"]
    assert attempt.status.status_code is StatusCode.ERROR
    assert attempt.status.description == "no answer"
    attrs = attempt.attributes or {}
    assert (attrs["kiln.outcome"], attrs["kiln.error_code"]) == ("retry", "upstream_unavailable")
    # The second waited in RETRYING (its backoff) and succeeded, in the same trace
    assert set(second) == {"kiln.attempt", "kiln.queue", "kiln.generate", "kiln.upload"}
    again = second["kiln.attempt"]
    assert (again.attributes or {})["kiln.outcome"] == "success"
    assert (again.attributes or {})["kiln.attempt"] == 2
    assert (second["kiln.queue"].attributes or {})["kiln.state"] == "RETRYING"
    assert second["kiln.queue"].start_time == ns(105.0)
    assert attempt.context is not None and again.context is not None
    assert attempt.context.trace_id == again.context.trace_id == TRACE
    assert attempt.context.span_id != again.context.span_id


def test_a_task_without_a_stored_context_has_a_trace_of_its_own_and_unsampled_ones_none(
    exported: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, memory = exported
    log = Log()
    log.add(Event.SUBMIT, None, Status.PENDING, 100.0, None, attempt=0, epoch=0)
    log.add(Event.CLAIM, Status.PENDING, Status.GENERATING, 101.0, 1.0, attempt=1, epoch=1)
    end = log.add(Event.STOPPED, Status.GENERATING, Status.CANCELLED, 102.0, 1.0, attempt=1,
                  epoch=1)  # fmt: skip
    # Given no stored context: the attempt is a root, in a trace derived from the task id
    tracing.emit(spans_of(make_task(), log.rows, [end], None))
    tracing.emit(spans_of(make_task(), log.rows, [end], None))  # the same attempt, twice
    spans = [s for s in memory.get_finished_spans() if s.name == "kiln.attempt"]
    assert len(spans) == 2 and spans[0].parent is None
    assert spans[0].context == spans[1].context  # the same ids: the same span
    assert (spans[0].attributes or {})["kiln.outcome"] == "cancelled"
    # Given a submitter that did not sample its trace: nothing is emitted
    memory.clear()
    unsampled = TraceContext(f"00-{TRACE:032x}-{SUBMITTER:016x}-00")
    tracing.emit(spans_of(make_task(), log.rows, [end], unsampled))
    assert memory.get_finished_spans() == ()


def test_a_review_is_a_child_of_the_attempt_that_made_the_outputs(
    exported: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, memory = exported
    log = Log()
    log.add(Event.SUBMIT, None, Status.PENDING, 100.0, None, attempt=0, epoch=0)
    log.add(Event.CLAIM, Status.PENDING, Status.GENERATING, 101.0, 1.0, attempt=1, epoch=1)
    log.add(Event.GENERATED, Status.GENERATING, Status.UPLOADING, 102.0, 1.0, attempt=1, epoch=1)
    flagged = log.add(Event.UPLOADED, Status.UPLOADING, Status.NEEDS_REVIEW, 103.0, 1.0,
                      attempt=1, epoch=1)  # fmt: skip
    tracing.emit(spans_of(make_task(status=Status.NEEDS_REVIEW), log.rows, [flagged], STORED))
    rejected = log.add(Event.REJECT, Status.NEEDS_REVIEW, Status.FAILED, 160.0, 57.0,
                       attempt=1, epoch=1)  # fmt: skip
    tracing.emit(spans_of(make_task(status=Status.FAILED), log.rows, [rejected], STORED))
    spans = by_name(memory.get_finished_spans())
    assert (spans["kiln.attempt"].attributes or {})["kiln.outcome"] == "needs_review"
    review = spans["kiln.review"]
    assert review.parent is not None and spans["kiln.attempt"].context is not None
    assert review.parent.span_id == spans["kiln.attempt"].context.span_id
    assert (review.start_time, review.end_time) == (ns(103.0), ns(160.0))
    assert (review.attributes or {})["kiln.outcome"] == "rejected"


def test_a_released_attempt_and_the_next_claim_of_the_same_number_are_distinct_spans() -> None:
    # A drain gives attempt 1 back (its number goes back by one); the next claim is attempt
    # 1 again, at another epoch: its spans have ids of their own
    assert attempt_span_id(TASK_ID, 1) != attempt_span_id(TASK_ID, 3)
    assert attempt_span_id(TASK_ID, 1) != attempt_span_id(TASK_ID, 1, "kiln.generate")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (f"00-{TRACE:032x}-{SUBMITTER:016x}-01", (TRACE, SUBMITTER, 1)),
        (f"00-{TRACE:032X}-{SUBMITTER:016x}-00", (TRACE, SUBMITTER, 0)),
        (f"ff-{TRACE:032x}-{SUBMITTER:016x}-01", None),
        (f"00-{0:032x}-{SUBMITTER:016x}-01", None),
        (f"00-{TRACE:032x}-{0:016x}-01", None),
        ("00-abc-def-01", None),
        ("", None),
    ],
)
def test_traceparent_is_read_as_w3c_says(text: str, parsed: tuple[int, int, int] | None) -> None:
    assert parse_traceparent(text) == parsed


@pytest.mark.parametrize(
    ("mode", "env", "on"),
    [
        ("auto", {}, False),
        ("auto", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ("auto", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ("auto", {"OTEL_TRACES_EXPORTER": "console"}, True),
        ("auto", {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "c"}, False),
        ("auto", {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ("on", {}, True),
        ("on", {"OTEL_SDK_DISABLED": "TRUE"}, False),
        ("off", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
    ],
)
def test_tracing_is_switched_by_kiln_tracing_and_the_otel_variables(
    mode: str, env: dict[str, str], on: bool
) -> None:
    assert wanted(mode, env) is on


def test_tracing_off_opens_nothing_and_a_bad_exporter_or_a_missing_extra_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert open_tracing(Settings(tracing="auto"), {}) is None
    with pytest.raises(ConfigError) as exporter:
        open_tracing(Settings(tracing="on"), {"OTEL_TRACES_EXPORTER": "zipkin"})
    assert exporter.value.variable == "OTEL_TRACES_EXPORTER"
    # Given the SDK cannot be imported (the extra is missing)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace.export", None)
    with pytest.raises(ConfigError) as missing:
        open_tracing(Settings(tracing="on"), {})
    assert missing.value.variable == "KILN_TRACING"
    assert "kiln[otel]" in missing.value.message
    # Under auto, a missing extra leaves tracing off (with a warning) instead
    assert open_tracing(Settings(tracing="auto"), {"OTEL_TRACES_EXPORTER": "otlp"}) is None
