"""With tracing on, an attempt's calls to its upstream carry its trace context: the
``traceparent`` of the attempt's exported ``kiln.generate`` span (kiln/tracing.py); with
tracing off they carry none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from backend_support import kiln_on, kiln_settings, run_task
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_comfyui import PARAMS as COMFY_PARAMS
from test_comfyui import comfyui_env
from test_openai_images import PARAMS as OPENAI_PARAMS
from test_openai_images import openai_env
from upstream_fakes import FakeComfyUI, FakeOpenAI

from kiln.states import Status
from kiln.tracing import Tracing, parse_traceparent


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    yield InMemorySpanExporter()


def generate_span(memory: InMemorySpanExporter, task_id: str) -> ReadableSpan:
    (span,) = [s for s in memory.get_finished_spans() if s.name == "kiln.generate"
               and (s.attributes or {}).get("kiln.task_id") == task_id]  # fmt: skip
    return span


def assert_names(traceparent: str, span: ReadableSpan) -> None:
    assert span.context is not None
    assert parse_traceparent(traceparent) == (span.context.trace_id, span.context.span_id, 1)


async def test_an_openai_images_call_carries_the_attempt_s_generate_span(
    tmp_path: Path, openai_fake: FakeOpenAI, memory: InMemorySpanExporter
) -> None:
    async with kiln_on(kiln_settings(tmp_path, openai_env(openai_fake))) as (app, _):
        tracing = Tracing(SimpleSpanProcessor(memory))
        app.engine.tracing = tracing
        # Given a task submitted inside a span of the caller's (as the API's request span)
        with tracing.tracer.start_as_current_span("submitter") as submitter:
            task, _ = await run_task(app, OPENAI_PARAMS)
        assert task.status is Status.SUCCESS
    # Then the upstream was called with the traceparent of the attempt's generate span,
    # in the submitter's trace
    (headers,) = openai_fake.headers
    span = generate_span(memory, task.id)
    assert_names(headers["traceparent"], span)
    assert span.context is not None
    assert span.context.trace_id == submitter.get_span_context().trace_id


async def test_a_comfyui_prompt_and_its_progress_socket_carry_the_attempt_s_generate_span(
    tmp_path: Path, comfyui_fake: tuple[FakeComfyUI, str], workflow_path: Path,
    memory: InMemorySpanExporter,
) -> None:  # fmt: skip
    fake, url = comfyui_fake
    async with kiln_on(kiln_settings(tmp_path, comfyui_env(url, workflow_path))) as (app, _):
        app.engine.tracing = Tracing(SimpleSpanProcessor(memory))
        task, _ = await run_task(app, COMFY_PARAMS)
    assert task.status is Status.SUCCESS
    span = generate_span(memory, task.id)
    assert_names(fake.prompt_headers[0]["traceparent"], span)
    assert_names(fake.socket_headers[0]["traceparent"], span)


async def test_with_tracing_off_an_upstream_call_carries_no_trace_context(
    tmp_path: Path, openai_fake: FakeOpenAI
) -> None:
    async with kiln_on(kiln_settings(tmp_path, openai_env(openai_fake))) as (app, _):
        assert app.engine.tracing is None  # no OTEL_* variable: off
        task, _ = await run_task(app, OPENAI_PARAMS)
    assert task.status is Status.SUCCESS
    (headers,) = openai_fake.headers
    assert "traceparent" not in headers and "tracestate" not in headers
