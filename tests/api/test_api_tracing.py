"""The API's request spans (kiln/api/request_spans.py) and the trace context a task keeps
from the request that made it: one submission, a batch, a rerun; a new trace when the
request brings none; nothing at all with tracing off."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from api_support import ApiUnderTest, image_body, make_kiln, running_api
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kiln.config import Settings
from kiln.tracing import Tracing, parse_traceparent

TRACE = 0x5B8EFFF798038103D269B633813FC60C
SUBMITTER = 0xEEE19B7EC3C1B174


@pytest.fixture
async def traced_api(
    settings: Settings,
) -> AsyncIterator[tuple[ApiUnderTest, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    app = make_kiln(settings)
    app.engine.tracing = Tracing(SimpleSpanProcessor(memory))
    async with running_api(settings, kiln_app=app) as under_test:
        yield under_test, memory


async def test_a_submission_s_request_span_is_the_submitter_s_child_and_the_task_keeps_it(
    traced_api: tuple[ApiUnderTest, InMemorySpanExporter],
) -> None:
    api, memory = traced_api
    # Given a request with the submitter's traceparent and tracestate
    headers = {"traceparent": f"00-{TRACE:032x}-{SUBMITTER:016x}-01", "tracestate": "acme=7"}
    answer = await api.submit(headers=headers)
    assert answer.status_code == 201
    task_id = answer.json()["id"]
    # Then the request's span is a SERVER span under the submitter's, named by its route
    (span,) = memory.get_finished_spans()
    assert (span.name, span.kind) == ("POST /v1/tasks", SpanKind.SERVER)
    assert span.context is not None and span.parent is not None
    assert (span.context.trace_id, span.parent.span_id) == (TRACE, SUBMITTER)
    attributes = span.attributes or {}
    assert attributes["http.route"] == "/v1/tasks"
    assert attributes["http.response.status_code"] == 201
    # And the task keeps that span's context, with the submitter's tracestate
    stored = await api.kiln.engine.store.trace(task_id)
    assert stored is not None and stored.tracestate == "acme=7"
    assert parse_traceparent(stored.traceparent) == (TRACE, span.context.span_id, 1)


async def test_a_request_without_a_traceparent_starts_a_trace_and_a_batch_keeps_it_per_item(
    traced_api: tuple[ApiUnderTest, InMemorySpanExporter],
) -> None:
    api, memory = traced_api
    # Given a batch of two items and no traceparent
    items = [image_body("a heron"), image_body("a crane")]
    answer = await api.client.post("/v1/tasks/batch", json={"tasks": items})
    assert answer.status_code == 200
    ids = [item["task"]["id"] for item in answer.json()["items"]]
    # Then the request's span is the root of a new trace, and both tasks keep its context
    (span,) = memory.get_finished_spans()
    assert span.name == "POST /v1/tasks/batch" and span.parent is None
    assert span.context is not None
    for task_id in ids:
        stored = await api.kiln.engine.store.trace(task_id)
        assert stored is not None
        assert parse_traceparent(stored.traceparent) == (
            span.context.trace_id, span.context.span_id, 1,
        )  # fmt: skip
    # And a rerun's request keeps its own, another read is named by its route template
    memory.clear()
    rerun = await api.client.post(f"/v1/tasks/{ids[0]}/rerun", json={"dedup": False})
    assert rerun.status_code == 201
    missing = await api.client.get("/v1/tasks/tsk_nothing")
    assert missing.status_code == 404
    rerun_span, read_span = memory.get_finished_spans()
    assert rerun_span.name == "POST /v1/tasks/{task_id}/rerun"
    assert rerun_span.context is not None
    stored = await api.kiln.engine.store.trace(rerun.json()["id"])
    assert stored is not None
    assert parse_traceparent(stored.traceparent) == (
        rerun_span.context.trace_id, rerun_span.context.span_id, 1,
    )  # fmt: skip
    assert read_span.name == "GET /v1/tasks/{task_id}"
    assert (read_span.attributes or {})["http.response.status_code"] == 404
    assert read_span.status.status_code is StatusCode.UNSET  # a 4xx is the caller's


async def test_with_tracing_off_the_api_stores_no_trace_context(api: ApiUnderTest) -> None:
    assert api.kiln.engine.tracing is None
    headers = {"traceparent": f"00-{TRACE:032x}-{SUBMITTER:016x}-01"}
    answer = await api.submit(headers=headers)
    assert answer.status_code == 201
    assert await api.kiln.engine.store.trace(answer.json()["id"]) is None
