"""OpenTelemetry traces: the optional extra ``kiln[otel]`` (docs/tracing.md).

This is the only module that imports ``opentelemetry``, and only when tracing is on
(:func:`open_tracing`): without the extra, or with tracing off, kiln never imports it and
nothing changes (no statement, no header, no span).

What a trace holds:

- the API's request span (``SERVER``), a child of the submitter's ``traceparent`` or the
  root of a new trace; a task submitted inside it keeps that span's context in
  ``task_traces`` (the submit transaction writes it, retention deletes it);
- one span per attempt, ``kiln.attempt``, a child of that stored context, with a child span
  per state the attempt passed through: ``kiln.queue`` (PENDING or RETRYING until the
  claim), ``kiln.resource_wait``, ``kiln.load_model`` (inside ``kiln.generate``, where the
  handler timed a load), ``kiln.generate``, ``kiln.upload``, and ``kiln.review`` when an
  admin decides on a NEEDS_REVIEW task;
- ``kiln.webhook`` (``CLIENT``) for each webhook delivery attempt.

Attempt spans are built after the fact from the event log (each event row has its moment
and the seconds spent in the state it left), by the process that records the change that
ends the attempt: the worker, or the supervisor for an expired attempt. Their ids are
derived from the task id and the attempt's lease epoch, so the worker knows during the
attempt which span its outgoing HTTP calls (upstream backends) belong to, and the same
attempt emitted twice is the same span. A task with no stored context (a schedule's tick,
an API process with tracing off) gets a trace id derived from its id: its attempts still
share one trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.config import Settings, otel_env
from kiln.errors import ConfigError
from kiln.models import Task, TaskEvent, TraceContext
from kiln.states import RUNNING, Event, Status
from kiln.store.usage import outcome_of

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

log = logging.getLogger("kiln.tracing")

#: The instrumentation scope of kiln's spans.
SCOPE = "kiln"
#: Span names, by the state the span covers.
STATE_SPANS = {
    Status.PENDING: "kiln.queue",
    Status.RETRYING: "kiln.queue",
    Status.WAITING_FOR_RESOURCE: "kiln.resource_wait",
    Status.GENERATING: "kiln.generate",
    Status.UPLOADING: "kiln.upload",
    Status.NEEDS_REVIEW: "kiln.review",
}
ATTEMPT_SPAN = "kiln.attempt"
LOAD_SPAN = "kiln.load_model"
WEBHOOK_SPAN = "kiln.webhook"
#: Outcomes that mark an attempt span as an error.
ERROR_OUTCOMES = frozenset({"failed", "retry", "timeout", "expired"})
#: The most event rows of one task read to build an attempt's spans.
EVENTS_READ = 10_000
#: The exporters ``OTEL_TRACES_EXPORTER`` may name (``none`` turns tracing off).
EXPORTERS = ("otlp", "console")

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_FALSE = ("", "0", "false", "no", "off")

#: The trace headers of the attempt running in this context, for its outgoing HTTP.
_outgoing: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "kiln_trace_headers", default=None
)

Attributes = dict[str, str | int | float | bool]
#: A model load an attempt's handler timed: (model, started, ended), store clock seconds.
Load = tuple[str, float, float]


# W3C trace context ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Parent:
    """A parsed ``traceparent``: the trace, the span a child hangs under, whether sampled."""

    trace_id: int
    span_id: int | None
    sampled: bool = True
    tracestate: str | None = None

    def child(
        self,
        name: str,
        span_id: int,
        parent_id: int | None,
        moments: tuple[float, float],
        attributes: Attributes,
        *,
        error: str | None = None,
        kind: str = "internal",
    ) -> SpanPlan:
        """A span of this trace (sampled and ``tracestate`` as it), hung under ``parent_id``,
        from ``moments[0]`` to ``moments[1]``."""
        start, end = moments
        return SpanPlan(
            name=name,
            trace_id=self.trace_id,
            span_id=span_id,
            parent_id=parent_id,
            start=start,
            end=end,
            attributes=attributes,
            error=error,
            kind=kind,
            sampled=self.sampled,
            tracestate=self.tracestate,
        )


def parse_traceparent(text: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a W3C ``traceparent`` header, or None when invalid."""
    match = _TRACEPARENT.match(text.strip().lower())
    if match is None or match.group(1) == "ff":
        return None
    trace_id, span_id = int(match.group(2), 16), int(match.group(3), 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, int(match.group(4), 16)


def traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def derived_id(bits: int, *parts: object) -> int:
    """A stable nonzero id of ``bits`` bits from ``parts`` (trace and span ids of a task)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[: bits // 8], "big") or 1


def parent_of(task_id: str, stored: TraceContext | None) -> Parent:
    """Where a task's spans hang: the stored context, or a trace of its own (derived
    from its id) with no parent span."""
    if stored is not None:
        parsed = parse_traceparent(stored.traceparent)
        if parsed is not None:
            trace_id, span_id, flags = parsed
            return Parent(trace_id, span_id, bool(flags & 1), stored.tracestate)
    return Parent(derived_id(128, "trace", task_id), None)


def attempt_span_id(task_id: str, epoch: int, name: str = ATTEMPT_SPAN) -> int:
    """The id of the span ``name`` of the attempt claimed at lease ``epoch``."""
    return derived_id(64, task_id, epoch, name)


def attempt_headers(task_id: str, epoch: int, stored: TraceContext | None) -> dict[str, str]:
    """The headers outgoing HTTP of the attempt at ``epoch`` carries: its generate span."""
    parent = parent_of(task_id, stored)
    span_id = attempt_span_id(task_id, epoch, STATE_SPANS[Status.GENERATING])
    headers = {"traceparent": traceparent(parent.trace_id, span_id, parent.sampled)}
    if parent.tracestate:
        headers["tracestate"] = parent.tracestate
    return headers


@contextlib.contextmanager
def outgoing(headers: Mapping[str, str]) -> Iterator[None]:
    """Within this block (this task and those it starts), :func:`outgoing_headers` gives
    ``headers``: the worker sets its attempt's while the handler runs."""
    token = _outgoing.set(dict(headers))
    try:
        yield
    finally:
        _outgoing.reset(token)


def outgoing_headers() -> dict[str, str]:
    """The trace headers for an HTTP request made now (empty unless an attempt is traced)."""
    return dict(_outgoing.get() or {})


# spans from the event log -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpanPlan:
    """A span to emit: ids, parent, moments (store clock seconds), attributes."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int | None
    start: float
    end: float
    attributes: Attributes = field(default_factory=dict)
    error: str | None = None
    kind: str = "internal"
    sampled: bool = True
    tracestate: str | None = None


def ended_attempt(events: Sequence[TaskEvent]) -> TaskEvent | None:
    """The event among ``events`` (one change's) that ends a running attempt, if any."""
    for event in events:
        if event.from_status in RUNNING and event.status not in RUNNING:
            return event
    return None


def ended_review(events: Sequence[TaskEvent]) -> TaskEvent | None:
    """The event among ``events`` that ends a review (approve, reject), if any."""
    for event in events:
        if event.from_status is Status.NEEDS_REVIEW and event.event in (
            Event.APPROVE,
            Event.REJECT,
        ):
            return event
    return None


def _claim_before(history: Sequence[TaskEvent], seq: int) -> TaskEvent | None:
    claims = [e for e in history if e.event is Event.CLAIM and e.seq < seq]
    return claims[-1] if claims else None


def _base(task: Task, claim: TaskEvent) -> Attributes:
    return {
        "kiln.task_id": task.id,
        "kiln.tenant": task.tenant,
        "kiln.kind": task.kind,
        "kiln.attempt": claim.attempt,
    }


def attempt_spans(
    task: Task,
    history: Sequence[TaskEvent],
    change: Sequence[TaskEvent],
    stored: TraceContext | None,
    loads: Sequence[Load] = (),
) -> list[SpanPlan]:
    """The spans of the attempt that ``change`` (one change's event rows) ended: the
    attempt's span and one child per state, with the moments of ``history`` (the task's
    event rows, in seq order). Empty when ``change`` ends no attempt."""
    end = ended_attempt(change)
    claim = None if end is None else _claim_before(history, end.seq)
    if end is None or claim is None:
        return []
    parent = parent_of(task.id, stored)
    attempt_id = attempt_span_id(task.id, claim.epoch)
    base = _base(task, claim)
    code = (end.error or {}).get("code")
    retried = any(e.event is Event.SCHEDULE_RETRY for e in change)
    outcome = outcome_of(end.event, end.status, retried=retried, error_code=code)

    def span(name: str, start: float, stop: float, parent_id: int, **attrs: Any) -> SpanPlan:
        span_id = attempt_span_id(task.id, claim.epoch, name)
        return parent.child(name, span_id, parent_id, (start, stop), {**base, **attrs})

    children: list[SpanPlan] = []
    queued = claim.at - (claim.dwell_s or 0.0)
    if claim.from_status is not None:
        state = {"kiln.state": str(claim.from_status)}
        children.append(span(STATE_SPANS[claim.from_status], queued, claim.at, attempt_id, **state))
    steps = [e for e in history if claim.seq < e.seq <= end.seq]
    before = claim
    for event in steps:
        name = STATE_SPANS.get(event.from_status) if event.from_status is not None else None
        skip = event.from_status is Status.WAITING_FOR_RESOURCE and event.at == before.at
        if name is not None and not skip:  # a claim that acquired at once waited for nothing
            state = {"kiln.state": str(event.from_status)}
            children.append(span(name, before.at, event.at, attempt_id, **state))
        before = event
    generate_id = attempt_span_id(task.id, claim.epoch, STATE_SPANS[Status.GENERATING])
    for n, (model, started, ended) in enumerate(loads):
        load_id = derived_id(64, task.id, claim.epoch, "load", n)
        loaded = {**base, "kiln.model": model}
        children.append(parent.child(LOAD_SPAN, load_id, generate_id, (started, ended), loaded))
    attrs: Attributes = {**base, "kiln.outcome": outcome, "kiln.epoch": claim.epoch}
    if code:
        attrs["kiln.error_code"] = str(code)
    if task.model:
        attrs["kiln.model"] = task.model
    error = None
    if outcome in ERROR_OUTCOMES:
        error = str((end.error or {}).get("message") or code or outcome)
    moments = (queued, end.at)
    attempt = parent.child(ATTEMPT_SPAN, attempt_id, parent.span_id, moments, attrs, error=error)
    return [attempt, *children]


def review_spans(
    task: Task,
    history: Sequence[TaskEvent],
    change: Sequence[TaskEvent],
    stored: TraceContext | None,
) -> list[SpanPlan]:
    """``kiln.review`` for a review that ``change`` ended: from the upload that asked for
    it to the decision, a child of the attempt that made the outputs."""
    end = ended_review(change)
    claim = None if end is None else _claim_before(history, end.seq)
    if end is None or claim is None:
        return []
    parent = parent_of(task.id, stored)
    name = STATE_SPANS[Status.NEEDS_REVIEW]
    outcome = "approved" if end.event is Event.APPROVE else "rejected"
    attrs: Attributes = {
        **_base(task, claim),
        "kiln.state": str(Status.NEEDS_REVIEW),
        "kiln.outcome": outcome,
    }
    span_id = attempt_span_id(task.id, claim.epoch, name)
    moments = (end.at - (end.dwell_s or 0.0), end.at)
    return [parent.child(name, span_id, attempt_span_id(task.id, claim.epoch), moments, attrs)]


def spans_of(
    task: Task,
    history: Sequence[TaskEvent],
    change: Sequence[TaskEvent],
    stored: TraceContext | None,
    loads: Sequence[Load] = (),
) -> list[SpanPlan]:
    """Every span that ``change`` completes: an attempt's, or a review's."""
    return attempt_spans(task, history, change, stored, loads) + review_spans(
        task, history, change, stored
    )


def webhook_span(
    task_id: str, stored: TraceContext | None, event_id: str, attempt: int
) -> SpanPlan:
    """A webhook delivery attempt's ``CLIENT`` span (its moments are filled when sent)."""
    parent = parent_of(task_id, stored)
    span_id = derived_id(64, "webhook", event_id, attempt)
    attrs: Attributes = {
        "kiln.task_id": task_id,
        "kiln.webhook.event_id": event_id,
        "kiln.webhook.attempt": attempt,
    }
    return parent.child(WEBHOOK_SPAN, span_id, parent.span_id, (0.0, 0.0), attrs, kind="client")


def headers_of(plan: SpanPlan) -> dict[str, str]:
    """The ``traceparent`` (and ``tracestate``) that makes a receiver's spans ``plan``'s."""
    headers = {"traceparent": traceparent(plan.trace_id, plan.span_id, plan.sampled)}
    if plan.tracestate:
        headers["tracestate"] = plan.tracestate
    return headers


# switching on --------------------------------------------------------------------------


def wanted(mode: str, env: Mapping[str, str]) -> bool:
    """Whether tracing is on: ``KILN_TRACING`` (``auto``, ``on``, ``off``) and the
    ``OTEL_*`` variables. ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
    turn it off; under ``auto`` an OTLP endpoint or an exporter named turns it on."""
    if mode == "off" or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    if mode == "on":
        return True
    named = (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_TRACES_EXPORTER",
    )
    return any(env.get(name, "").strip().lower() not in _FALSE for name in named)


def open_tracing(settings: Settings, env: Mapping[str, str] | None = None) -> Tracing | None:
    """This process's :class:`Tracing`, or None when tracing is off (the extra is then
    never imported). ConfigError when ``KILN_TRACING=on`` and the extra is missing, or
    ``OTEL_TRACES_EXPORTER`` names an exporter kiln does not ship."""
    env = otel_env() if env is None else env
    if not wanted(settings.tracing, env):
        return None
    exporter_name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    exporter_name = exporter_name.split(",")[0].strip()
    if exporter_name not in EXPORTERS:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={exporter_name!r}: expected otlp, console or none",
            variable="OTEL_TRACES_EXPORTER",
        )
    try:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        if settings.tracing == "on":
            raise ConfigError(
                "KILN_TRACING='on': the otel extra is not installed (pip install 'kiln[otel]')",
                variable="KILN_TRACING",
            ) from None
        log.warning("tracing_unavailable", extra={"reason": "the otel extra is not installed"})
        return None
    if exporter_name == "console":
        exporter: Any = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                "KILN_TRACING: the OTLP exporter is not installed (pip install 'kiln[otel]')",
                variable="KILN_TRACING",
            ) from None
        exporter = OTLPSpanExporter()
    return Tracing(BatchSpanProcessor(exporter))


# the spans' sink ------------------------------------------------------------------------


class Tracing:
    """One process's spans: the API's request spans and the spans built from the event
    log go to ``processor`` (a batch processor in front of the configured exporter, or
    whatever a test gives), as the SDK's spans of scope ``kiln``."""

    def __init__(self, processor: SpanProcessor, resource: Resource | None = None) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        resource = resource or Resource.create({})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "kiln"}))
        self.resource = resource
        self.processor = processor
        self.provider: TracerProvider = TracerProvider(resource=resource)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(SCOPE)
        self._scope = InstrumentationScope(SCOPE)

    def emit(self, plans: Sequence[SpanPlan]) -> None:
        """Hand finished spans to the processor (unsampled ones are dropped)."""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        kinds = {"internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT}
        for plan in plans:
            if not plan.sampled:
                continue
            state = trace.TraceState.from_header([plan.tracestate]) if plan.tracestate else None
            flags = TraceFlags(TraceFlags.SAMPLED)
            context = SpanContext(plan.trace_id, plan.span_id, False, flags, state)
            parent = None
            if plan.parent_id is not None:
                parent = SpanContext(plan.trace_id, plan.parent_id, False, flags, state)
            status = Status(StatusCode.ERROR, plan.error) if plan.error else Status()
            self.processor.on_end(
                ReadableSpan(
                    plan.name,
                    context,
                    parent,
                    self.resource,
                    dict(plan.attributes),
                    kind=kinds.get(plan.kind, SpanKind.INTERNAL),
                    status=status,
                    start_time=_ns(plan.start),
                    end_time=_ns(max(plan.end, plan.start)),
                    instrumentation_scope=self._scope,
                )
            )

    @contextlib.contextmanager
    def request_span(
        self, method: str, path: str, headers: Mapping[str, str]
    ) -> Iterator[RequestSpan]:
        """The API's span of one request (``SERVER``): a child of the request's
        ``traceparent`` or a new trace, current while the request runs, so a task submitted
        in it keeps its context (:meth:`current`)."""
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier=dict(headers))
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        token = context.attach(trace.set_span_in_context(span))
        answer = RequestSpan(span)
        try:
            yield answer
        finally:
            context.detach(token)
            if answer.route:
                span.update_name(f"{method} {answer.route}")
                span.set_attribute("http.route", answer.route)
            if answer.status is not None:
                span.set_attribute("http.response.status_code", answer.status)
                if answer.status >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
            span.end()

    def current(self) -> TraceContext | None:
        """The trace context of the span current here (the API's request span), or None."""
        from opentelemetry import trace

        found = trace.get_current_span().get_span_context()
        if not found.is_valid:
            return None
        state = found.trace_state.to_header() or None
        return TraceContext(
            traceparent(found.trace_id, found.span_id, found.trace_flags.sampled), state
        )

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def close(self) -> None:
        """Export what is pending and stop the exporter."""
        self.provider.shutdown()


class RequestSpan:
    """What the API layer learns of a request while it runs: its route and status."""

    def __init__(self, span: object) -> None:
        self.span = span
        self.route: str | None = None
        self.status: int | None = None


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)
