"""A submitted task's trace, from the API's request span through a real `kiln worker`
process (kiln/tracing.py, docs/tracing.md).

The API runs in this process and exports through the SDK's in-memory exporter; the worker
process exports as it would in production, OTLP over HTTP (``OTEL_EXPORTER_OTLP_ENDPOINT``),
to a small OTLP/HTTP receiver on 127.0.0.1 in this test that decodes the protobuf
requests. So what is checked is what a collector would get.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import kiln
from kiln import demo
from kiln.api.app import create_app
from kiln.app import running
from kiln.config import Settings
from kiln.states import Status
from kiln.tracing import Tracing, parse_traceparent

from .cli_workers import CliWorkers
from .conftest import AdvancingClock, claim_generating, demo_params, wait_for_status, wait_until
from .webhook_receiver import receiving

pytestmark = pytest.mark.slow

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
SUBMITTER = 0xB7AD6B7169203331


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span POSTed to ``/v1/traces``,
    decoded, with its service name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.take(ExportTraceServiceRequest.FromString(body), self.path)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def take(self, request: ExportTraceServiceRequest, path: str) -> None:
        assert path == "/v1/traces"
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attrs = {a.key: _value(a.value) for a in span.attributes}
                    found.append({
                        "name": span.name, "service": resource.get("service.name"),
                        "scope": scope_spans.scope.name,
                        "trace_id": int.from_bytes(span.trace_id, "big"),
                        "span_id": int.from_bytes(span.span_id, "big"),
                        "parent_id": int.from_bytes(span.parent_span_id, "big") or None,
                        "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                        "status": span.status.code, "attributes": attrs,
                    })  # fmt: skip
        with self._lock:
            self.spans += found

    def of_task(self, task_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["attributes"].get("kiln.task_id") == task_id]


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value"))


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    found = OtlpReceiver()
    found.thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()


async def test_a_task_s_trace_runs_from_the_request_span_through_a_worker_process(
    tmp_path: Path, cli_workers: Callable[..., CliWorkers], receiver: OtlpReceiver
) -> None:
    # Given a worker process that exports to the receiver (OTLP/HTTP, as to a collector),
    # whose demo model takes 0.2 s to load, and an API in this process, tracing in memory
    workers = cli_workers(
        tmp_path, f"sqlite:///{tmp_path / 'kiln.db'}", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_BSP_SCHEDULE_DELAY="50", OTEL_SERVICE_NAME="kiln-worker",
        KILN_DEMO_MODEL_LOAD_S="0.2", KILN_RETRY_BASE_S="0.05", KILN_RETRY_MAX_S="0.05",
    )  # fmt: skip
    memory = InMemorySpanExporter()
    app = workers.app()
    app.engine.tracing = Tracing(SimpleSpanProcessor(memory))
    http = create_app(app)
    workers.start("--concurrency", "1", "--gpus", "1")
    simulate = {"step_ms": 10, "fail_attempts": 1}
    params = {"prompt": f"a kiln {uuid.uuid4().hex[:8]}", "width": 64, "height": 64,
              "steps": 2, "model": "m1", "simulate": simulate}  # fmt: skip
    submitter = f"00-{TRACE:032x}-{SUBMITTER:016x}-01"
    async with http.router.lifespan_context(http):
        transport = httpx.ASGITransport(app=http)
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln.test") as client:
            # When a task is submitted in the submitter's trace; its first attempt fails
            body = {"kind": "image.generate", "params": params}
            answer = await client.post("/v1/tasks", json=body, headers={"traceparent": submitter})
            assert answer.status_code == 201, answer.text
            task_id = answer.json()["id"]
            await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=60)
            stored = await app.engine.store.trace(task_id)

        async def both_attempts_exported() -> bool:
            return sum(s["name"] == "kiln.attempt" for s in receiver.of_task(task_id)) == 2

        await wait_until(both_attempts_exported, timeout_s=20, what="the attempts' spans")

    # Then the API's request span is a SERVER span in the submitter's trace, under its span
    (request,) = [s for s in memory.get_finished_spans() if s.name == "POST /v1/tasks"]
    assert request.kind is SpanKind.SERVER and request.context is not None
    assert request.parent is not None and request.parent.span_id == SUBMITTER
    assert request.context.trace_id == TRACE
    assert (request.attributes or {})["http.response.status_code"] == 201
    # And the task keeps the request span's context
    assert stored is not None
    assert parse_traceparent(stored.traceparent) == (TRACE, request.context.span_id, 1)
    # And the worker process exported one span per attempt under the request span, in the
    # same trace, with the task's attributes and each attempt's outcome
    spans = receiver.of_task(task_id)
    assert {s["trace_id"] for s in spans} == {TRACE}
    assert {s["service"] for s in spans} == {"kiln-worker"} and {s["scope"] for s in spans} == {
        "kiln"
    }
    attempts = sorted((s for s in spans if s["name"] == "kiln.attempt"),
                      key=lambda s: s["attributes"]["kiln.attempt"])  # fmt: skip
    assert [a["parent_id"] for a in attempts] == [request.context.span_id] * 2
    assert [(a["attributes"]["kiln.attempt"], a["attributes"]["kiln.outcome"])
            for a in attempts] == [(1, "retry"), (2, "success")]  # fmt: skip
    for attempt in attempts:
        assert attempt["attributes"]["kiln.tenant"] == "default"
        assert attempt["attributes"]["kiln.kind"] == "image.generate"
        assert attempt["attributes"]["kiln.model"] == "m1"
    assert attempts[0]["attributes"]["kiln.error_code"] == "simulated_failure"
    assert attempts[0]["status"] == 2  # STATUS_CODE_ERROR
    # And each attempt's states are its children, within it, one after the other
    for attempt, expected in zip(attempts, [
        ["kiln.queue", "kiln.resource_wait", "kiln.generate"],
        ["kiln.queue", "kiln.resource_wait", "kiln.generate", "kiln.upload"],
    ], strict=True):  # fmt: skip
        children = sorted((s for s in spans if s["parent_id"] == attempt["span_id"]),
                          key=lambda s: s["start"])  # fmt: skip
        assert [c["name"] for c in children if c["name"] != "kiln.resource_wait"] == [
            n for n in expected if n != "kiln.resource_wait"
        ]  # a resource wait too short to tell from the claim may be left out
        assert children[0]["start"] == attempt["start"]
        assert children[-1]["end"] == attempt["end"]
        for before, after in itertools.pairwise(children):
            assert before["end"] == after["start"]
    # And the model load is a child of the first attempt's generate span (the second
    # attempt found the model loaded), as long as the load took
    (load,) = [s for s in spans if s["name"] == "kiln.load_model"]
    (generate,) = [s for s in spans if s["name"] == "kiln.generate"
                   and s["parent_id"] == attempts[0]["span_id"]]  # fmt: skip
    assert load["parent_id"] == generate["span_id"]
    assert load["attributes"]["kiln.model"] == "m1"
    assert 0.2e9 <= load["end"] - load["start"] < 5e9
    assert generate["start"] <= load["start"] <= load["end"] <= generate["end"]
    # And a finished span of this task never came twice
    assert len({s["span_id"] for s in spans}) == len(spans)


async def test_a_webhook_delivery_is_a_client_span_whose_context_the_receiver_gets(
    settings: Settings,
) -> None:
    # Given an app with tracing on (in memory), webhooks to a receiver on 127.0.0.1
    memory = InMemorySpanExporter()
    app = kiln.App(settings=settings.with_(webhook_allow_private=True))
    demo.register(app)
    tracing = app.engine.tracing = Tracing(SimpleSpanProcessor(memory))
    params = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2,
              "simulate": {"step_ms": 0}}  # fmt: skip
    with receiving() as receiver:
        async with app, running(app.worker(concurrency=1).run(), app.supervisor().run()):
            # When a task submitted in a span finishes and its final event is posted
            with tracing.tracer.start_as_current_span("request") as request:
                made = await app.submit("image.generate", params, webhook_url=receiver.url)
            await wait_for_status(app.engine.store, made.task.id, Status.SUCCESS, timeout_s=30)

            async def posted() -> bool:
                return bool(receiver.received) and any(
                    s.name == "kiln.webhook" for s in memory.get_finished_spans()
                )

            await wait_until(posted, timeout_s=30, what="the delivery and its span")
        [delivery] = receiver.received
    # Then the delivery is a CLIENT span under the request's span, and the receiver got
    # its context, so its own spans join the task's trace
    (span,) = [s for s in memory.get_finished_spans() if s.name == "kiln.webhook"]
    assert span.kind is SpanKind.CLIENT and span.context is not None
    assert span.parent is not None
    assert span.parent.span_id == request.get_span_context().span_id
    assert span.context.trace_id == request.get_span_context().trace_id
    assert parse_traceparent(delivery.headers["traceparent"]) == (
        span.context.trace_id, span.context.span_id, 1,
    )  # fmt: skip
    attributes = span.attributes or {}
    assert attributes["kiln.task_id"] == made.task.id
    assert attributes["kiln.webhook.event_id"] == delivery.headers["kiln-webhook-id"]
    assert attributes["http.response.status_code"] == 200


async def test_an_attempt_the_supervisor_expires_is_emitted_by_the_supervisor(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    memory = InMemorySpanExporter()
    fake_app.engine.tracing = Tracing(SimpleSpanProcessor(memory))
    # Given a task claimed by a worker that then stopped heartbeating
    made = await fake_app.submit("image.generate", demo_params("a meadow"), max_attempts=3)
    claimed = await claim_generating(fake_app, lease_ttl_s=1.0)
    claimed_at = clock.now
    # When its lease lapses and the supervisor sweeps
    clock.advance(1.5)
    assert (await fake_app.supervisor().sweep()).expired == 1
    # Then the supervisor's process emitted the attempt, expired, with the fake clock's
    # moments: from the submission to the expiry
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"kiln.attempt", "kiln.queue", "kiln.generate"}
    attempt = spans["kiln.attempt"]
    attrs = attempt.attributes or {}
    assert (attrs["kiln.task_id"], attrs["kiln.attempt"]) == (made.task.id, claimed.attempt)
    assert (attrs["kiln.outcome"], attrs["kiln.error_code"]) == ("expired", "lease_expired")
    assert attempt.status.status_code is StatusCode.ERROR
    assert attempt.end_time == round(clock.now * 1e9)
    generate = spans["kiln.generate"]
    assert (generate.start_time, generate.end_time) == (round(claimed_at * 1e9), attempt.end_time)
