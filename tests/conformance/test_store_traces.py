"""The trace context a task was submitted in (``task_traces``, kiln/tracing.py), on every
backend: written in the submit transaction only when there is one, read back, shared by
no other submission path, deleted with the task by retention."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import kiln
from kiln.models import TraceContext
from kiln.states import Status
from kiln.store import Store
from kiln.tracing import Tracing, parse_traceparent

from .backends import Row
from .factories import KIND, SettableClock, drive, make_new_task

Truth = Callable[..., list[Row]]


def context(n: int, state: str | None = None) -> TraceContext:
    return TraceContext(f"00-{n + 1:032x}-{n + 1:016x}-01", state)


def stored_rows(truth: Truth) -> dict[str, tuple[str, str | None]]:
    return {row[0]: (row[1], row[2]) for row in truth("SELECT * FROM task_traces")}


async def test_a_submission_keeps_its_trace_context_and_one_without_writes_no_row(
    store: Store, truth: Truth
) -> None:
    # Given one submission with a context (and a tracestate), one without
    traced = await store.submit(replace(make_new_task({"prompt": "a"}),
                                        trace=context(1, "vendor=1")))  # fmt: skip
    plain = await store.submit(make_new_task({"prompt": "b"}))
    # Then the first reads back as given, the second has no row at all
    assert await store.trace(traced.task.id) == context(1, "vendor=1")
    assert await store.trace(plain.task.id) is None
    assert stored_rows(truth) == {traced.task.id: (context(1).traceparent, "vendor=1")}


async def test_a_replayed_key_or_a_dedup_hit_keeps_the_first_submission_s_context(
    store: Store, truth: Truth
) -> None:
    # Given a keyed submission with a context
    first = await store.submit(replace(make_new_task(idempotency_key="k1"), trace=context(1)))
    # When the same key comes again, and the same content without a key, other contexts
    replayed = await store.submit(replace(make_new_task(idempotency_key="k1"), trace=context(2)))
    deduplicated = await store.submit(replace(make_new_task(), trace=context(3)))
    # Then both answer with the first task, whose context is its own; nothing else is kept
    assert replayed.replayed and deduplicated.deduplicated
    assert replayed.task.id == deduplicated.task.id == first.task.id
    assert await store.trace(first.task.id) == context(1)
    assert list(stored_rows(truth)) == [first.task.id]


async def test_many_submissions_at_once_keep_each_its_own_context(
    store: Store, truth: Truth
) -> None:
    # Given 40 submissions at once (PostgreSQL batches those without a key or a context),
    # every other one with a context, some keyed
    news = [make_new_task({"prompt": f"p{n}"}, idempotency_key=f"k{n}" if n % 3 == 0 else None)
            for n in range(40)]  # fmt: skip
    news = [replace(new, trace=context(n)) if n % 2 == 0 else new for n, new in enumerate(news)]
    results = await asyncio.gather(*(store.submit(new) for new in news))
    # Then every task was made, and exactly the traced ones have their own context
    assert all(result.created for result in results)
    expected = {r.task.id: context(n) for n, r in enumerate(results) if n % 2 == 0}
    assert {tid: await store.trace(tid) for tid in expected} == expected
    assert set(stored_rows(truth)) == set(expected)
    for n, result in enumerate(results):
        if n % 2:
            assert await store.trace(result.task.id) is None


async def test_retention_deletes_a_task_s_context_with_the_task(
    store: Store, clock: SettableClock, truth: Truth
) -> None:
    # Given two traced tasks: one old and final, one still pending
    done = await drive(store, replace(make_new_task({"prompt": "a"}), trace=context(1)),
                       Status.SUCCESS)  # fmt: skip
    live = await store.submit(replace(make_new_task({"prompt": "b"}, kind="other"),
                                      trace=context(2)))  # fmt: skip
    clock.advance(100)
    # When retention purges what finished before now
    assert [t.id for t in await store.purge(finished_before=clock())] == [done.id]
    # Then the purged task's context went with it; the live one's stays
    assert await store.trace(done.id) is None
    assert stored_rows(truth) == {live.task.id: (context(2).traceparent, None)}


@pytest.fixture
def traced(engine: kiln.App) -> Iterator[tuple[kiln.App, InMemorySpanExporter]]:
    """The engine fixture's App with tracing on, its spans in memory."""
    memory = InMemorySpanExporter()
    tracing = Tracing(SimpleSpanProcessor(memory))
    engine.engine.tracing = tracing
    yield engine, memory
    engine.engine.tracing = None
    tracing.close()


async def test_the_app_keeps_the_current_span_s_context_for_a_submission_and_a_rerun(
    traced: tuple[kiln.App, InMemorySpanExporter],
) -> None:
    app, _ = traced
    tracing = app.engine.tracing
    assert tracing is not None
    # Given a span current (as the API's request span is while a request runs)
    with tracing.tracer.start_as_current_span("request") as span:
        made = await app.submit(KIND, {"prompt": "x"})
        rerun = await app.rerun(made.task.id, dedup=False)
        current = span.get_span_context()
    outside = await app.submit(KIND, {"prompt": "y"}, idempotency_key=f"k{random.random()}")
    # Then the submission and the rerun keep that span's context; outside a span, none
    for task_id in (made.task.id, rerun.task.id):
        stored = await app.engine.store.trace(task_id)
        assert stored is not None
        assert parse_traceparent(stored.traceparent) == (current.trace_id, current.span_id, 1)
    assert await app.engine.store.trace(outside.task.id) is None
