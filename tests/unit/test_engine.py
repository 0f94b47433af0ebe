"""The Engine below the App: the processes run on it, and the policy the faces ask for
(rate limits, the ghost rule, counted refusals) lives in it."""

from __future__ import annotations

import pytest

import kiln
from kiln.counters import DEDUP_HITS, ILLEGAL_TRANSITIONS, RATE_LIMITED
from kiln.engine import Engine, ghost_after_s
from kiln.errors import InvalidRequest, RateLimited
from kiln.limits import Rate
from kiln.states import Event, IllegalTransition
from kiln.supervisor import Supervisor
from kiln.webhooks import Dispatcher
from kiln.worker import Worker


async def test_the_apps_processes_run_on_its_engine(app: kiln.App) -> None:
    # Given an App
    # When it builds two workers and a supervisor
    first, second = app.worker(concurrency=1), app.worker(concurrency=2)
    supervisor = app.supervisor(interval_s=0.5)

    # Then they share its engine, and the workers share its circuit breakers
    assert isinstance(first, Worker) and isinstance(supervisor, Supervisor)
    assert first.engine is second.engine is supervisor.engine is app.engine
    assert first.breakers is second.breakers is app.breakers
    assert (first.concurrency, second.concurrency, supervisor.interval_s) == (1, 2, 0.5)


async def test_a_process_built_from_the_app_takes_its_engine(app: kiln.App) -> None:
    # Given an App, When a worker and a dispatcher are built from it rather than its engine
    worker = Worker(app, concurrency=1)
    dispatcher = Dispatcher(app, owner="d")

    # Then they run on the App's engine
    assert worker.engine is app.engine and dispatcher.engine is app.engine


async def test_the_app_delegates_its_parts_to_the_engine(app: kiln.App) -> None:
    # Given an App, Then its parts are its engine's
    engine = app.engine
    assert isinstance(engine, Engine)
    assert (app.engine.store, app.storage, app.hub, app.kinds) == (
        engine.store, engine.storage, engine.hub, engine.kinds,
    )  # fmt: skip
    # And settings set on the App reach the engine
    app.settings = app.settings.with_(lease_ttl_s=7.0)
    assert engine.settings.lease_ttl_s == 7.0
    assert engine.ghost_after_s == ghost_after_s(7.0, app.settings.supervisor_interval_s)


async def test_an_illegal_transition_is_counted_by_the_engine(app: kiln.App) -> None:
    # Given a PENDING task
    task = (await app.submit("image.generate", {"prompt": "a fox"})).task

    # When an event the table forbids is applied to it
    with pytest.raises(IllegalTransition):
        await app.engine.apply(task, Event.GENERATED)

    # Then it is refused and counted, here and in the store
    assert app.engine.illegal_transitions == 1
    counters = await app.engine.counters()
    assert counters[(ILLEGAL_TRANSITIONS, "PENDING>UPLOADING")] == 1


async def test_the_rate_limit_refuses_and_counts_after_the_burst(app: kiln.App) -> None:
    # Given a tenant allowed one submission a second, bursts of one
    app.settings = app.settings.with_(tenant_rate=Rate(per_s=1.0, burst=1.0))

    # When it asks twice at once
    await app.check_rate("alice")
    with pytest.raises(RateLimited) as refused:
        await app.check_rate("alice")

    # Then the second is refused with a wait, and counted
    assert refused.value.retry_after_s > 0
    assert (await app.engine.counters())[(RATE_LIMITED, "")] == 1


async def test_a_bad_request_under_a_rate_limit_is_refused_as_bad(app: kiln.App) -> None:
    # Given a rate limit with no tokens left
    app.settings = app.settings.with_(tenant_rate=Rate(per_s=1.0, burst=1.0))
    await app.check_rate("alice")

    # When a request with bad params comes, Then it is refused for its params first
    with pytest.raises(InvalidRequest):
        await app.check_rate("alice", "image.generate", {"prompt": ""})


async def test_a_coalesced_submission_is_counted_as_the_store_would(app: kiln.App) -> None:
    # Given a submission answered by the store
    result = await app.submit("image.generate", {"prompt": "a fox"})

    # When copies of it were answered by single-flight, one keyed and one not
    keyed = await app.coalesced(result, replayed=True)
    content = await app.coalesced(result, replayed=False)

    # Then each reads as the store's answer would, and each is a dedup hit
    assert (keyed.created, keyed.replayed, keyed.deduplicated) == (False, True, False)
    assert (content.created, content.replayed, content.deduplicated) == (False, False, True)
    counters = await app.engine.counters()
    assert counters[(DEDUP_HITS, "idempotency")] == counters[(DEDUP_HITS, "content")] == 1
