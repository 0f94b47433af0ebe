"""Retries: error classification, bounded attempts (I7), deadlines, and manual retry."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.errors import NotRetryable
from kiln.models import Output, Task
from kiln.retry import classify
from kiln.states import Event, Status

from .conftest import (
    AdvancingClock,
    assert_one_final_state,
    claim_generating,
    demo_params,
    wait_for_status,
)

FINAL_STATUSES = (Status.SUCCESS, Status.FAILED, Status.TIMEOUT, Status.CANCELLED)


class CeilingRandom(random.Random):
    """Backoff jitter that always picks the longest delay the policy allows."""

    def uniform(self, a: float, b: float) -> float:
        return b


def _validation_error() -> pydantic.ValidationError:
    try:
        pydantic.TypeAdapter(int).validate_python("not a number")
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("validation passed")


@pytest.mark.parametrize(
    ("exc", "code", "retryable"),
    [
        (kiln.Retryable("upstream 503"), "task_failed", True),
        (kiln.Retryable("rate limited", code="upstream_rate_limited"), "upstream_rate_limited",
         True),
        (kiln.Permanent("prompt refused"), "permanent_failure", False),
        (kiln.Permanent("nsfw", code="policy_violation"), "policy_violation", False),
        (OSError("disk gone"), "internal_error", True),
        (TimeoutError(), "internal_error", True),
        (RuntimeError("CUDA out of memory"), "internal_error", True),
        (ValueError("bad pixel"), "internal_error", True),
        (MemoryError(), "internal_error", True),
        (TypeError("missing argument"), "internal_error", False),
        (AttributeError("no attribute"), "internal_error", False),
        (NameError("undefined"), "internal_error", False),
        (NotImplementedError(), "internal_error", False),
        (_validation_error(), "internal_error", False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)  # fmt: skip
def test_classify_says_which_errors_retry(exc: BaseException, code: str, retryable: bool) -> None:
    # Given an exception a handler raised / When it is classified
    error = classify(exc)

    # Then the code and retryable flag follow kiln.Retryable, kiln.Permanent or the default
    assert error["code"] == code
    assert error["retryable"] is retryable
    assert isinstance(error["message"], str) and error["message"]


def test_classify_names_the_exception_type_in_internal_errors() -> None:
    error = classify(KeyError("width"))
    assert error["message"].startswith("KeyError")


# Through the engine ------------------------------------------------------------------------


@pytest.fixture
def quick_settings(settings: Settings) -> Settings:
    return settings.with_(retry_base_s=0.01, retry_max_s=0.02)


@pytest.fixture
async def raising_app(quick_settings: Settings) -> AsyncIterator[kiln.App]:
    """An app with a kind that raises the exception its params name, then succeeds."""
    app = kiln.App(settings=quick_settings)
    demo.register(app)
    errors: dict[str, BaseException] = {
        "retryable": kiln.Retryable("try again"),
        "permanent": kiln.Permanent("never", code="bad_input"),
        "oserror": OSError("connection reset"),
        "typeerror": TypeError("handler bug"),
    }

    async def handler(ctx: Any, params: dict[str, Any]) -> Output:
        if ctx.attempt <= params["failing_attempts"]:
            raise errors[params["raise"]]
        return Output("out.txt", f"done on attempt {ctx.attempt}".encode())

    app.task("raising")(handler)
    async with app:
        yield app


async def run_until_final(app: kiln.App, task_id: str, *, timeout_s: float = 15) -> Task:
    worker = app.worker(concurrency=2, resources={"gpu": 2}, idle_poll_s=(0.01, 0.05))
    async with running(worker.run()):
        return await wait_for_status(
            app.engine.store, task_id, *FINAL_STATUSES, timeout_s=timeout_s
        )


@pytest.mark.parametrize(
    ("raised", "attempts", "status", "code"),
    [
        ("retryable", 3, Status.FAILED, "task_failed"),
        ("oserror", 3, Status.FAILED, "internal_error"),
        ("permanent", 1, Status.FAILED, "bad_input"),
        ("typeerror", 1, Status.FAILED, "internal_error"),
    ],
)
async def test_always_failing_handler_stops_at_the_classified_attempt(
    raising_app: kiln.App, raised: str, attempts: int, status: Status, code: str
) -> None:
    # Given a handler that always raises, and max_attempts 3
    submitted = await raising_app.submit(
        "raising", {"raise": raised, "failing_attempts": 99}, max_attempts=3
    )

    # When a worker runs it
    done = await run_until_final(raising_app, submitted.task.id)

    # Then retryable errors use every attempt, permanent ones only the first
    assert done.status is status
    assert done.attempt == attempts
    assert done.error is not None and done.error["code"] == code
    events = await assert_one_final_state(raising_app.engine.store, done.id)
    assert [e.attempt for e in events if e.event is Event.FAIL] == list(range(1, attempts + 1))
    assert len([e for e in events if e.event is Event.SCHEDULE_RETRY]) == attempts - 1
    assert max(e.attempt for e in events) <= done.max_attempts


@pytest.mark.parametrize("raised", ["retryable", "oserror"])
async def test_retryable_failures_then_success(raising_app: kiln.App, raised: str) -> None:
    # Given a handler that fails twice with a retryable error, then works
    submitted = await raising_app.submit(
        "raising", {"raise": raised, "failing_attempts": 2}, max_attempts=3
    )

    # When a worker runs it
    done = await run_until_final(raising_app, submitted.task.id)

    # Then the third attempt succeeds and the failures are in the log
    assert done.status is Status.SUCCESS
    assert done.attempt == 3
    assert done.error is None
    events = await assert_one_final_state(raising_app.engine.store, done.id)
    assert [e.event for e in events].count(Event.FAIL) == 2


async def test_attempt_never_exceeds_max_attempts(quick_settings: Settings) -> None:
    # Given demo tasks that fail on many attempts, with various max_attempts
    app = kiln.App(settings=quick_settings)
    demo.register(app)
    async with app:
        ids = {
            n: (await app.submit("image.generate", demo_params(f"a storm {n}", fail_attempts=10),
                                 max_attempts=n)).task.id
            for n in (1, 2, 4)
        }  # fmt: skip

        # When workers run them to the end
        worker = app.worker(concurrency=3, resources={"gpu": 3}, idle_poll_s=(0.01, 0.05))
        async with running(worker.run()):
            done = {
                n: await wait_for_status(app.engine.store, i, *FINAL_STATUSES)
                for n, i in ids.items()
            }

        # Then each stopped after exactly max_attempts attempts (I7)
        for n, task in done.items():
            assert task.status is Status.FAILED
            assert task.attempt == n == task.max_attempts
            assert task.error is not None and task.error["code"] == "simulated_failure"
            events = await assert_one_final_state(app.engine.store, task.id)
            assert max(e.attempt for e in events) == n


async def test_retry_that_would_land_past_the_deadline_is_not_scheduled(
    settings: Settings, clock: AdvancingClock
) -> None:
    # Given a policy whose next delay (10 s) ends after the task's deadline (5 s)
    app = kiln.App(settings=settings.with_(retry_base_s=10.0, retry_max_s=10.0), clock=clock,
                   rng=CeilingRandom())  # fmt: skip
    demo.register(app)
    async with app:
        task = (await app.submit("image.generate", demo_params("late"), max_attempts=3,
                                 deadline_s=5.0)).task  # fmt: skip
        held = await claim_generating(app)

        # When its attempt fails with a retryable error
        error = {"code": "upstream_timeout", "message": "slow", "retryable": True}
        after = await app.apply(held, Event.FAIL, fenced=True, retry_error=error)

        # Then it stays FAILED, final, though attempts are left
        assert after.status is Status.FAILED
        assert after.attempt == 1 < after.max_attempts
        assert after.next_retry_at is None
        await assert_one_final_state(app.engine.store, task.id)


async def test_retry_within_the_deadline_is_scheduled(
    settings: Settings, clock: AdvancingClock
) -> None:
    # Given the same policy and a deadline far enough away
    app = kiln.App(settings=settings.with_(retry_base_s=10.0, retry_max_s=10.0), clock=clock,
                   rng=CeilingRandom())  # fmt: skip
    demo.register(app)
    async with app:
        task = (await app.submit("image.generate", demo_params("early"), max_attempts=3,
                                 deadline_s=60.0)).task  # fmt: skip
        held = await claim_generating(app)

        # When its attempt fails with a retryable error
        error = {"code": "upstream_timeout", "message": "slow", "retryable": True}
        after = await app.apply(held, Event.FAIL, fenced=True, retry_error=error)

        # Then the next attempt is due after the full backoff
        assert after.status is Status.RETRYING
        assert after.next_retry_at == clock.now + 10.0
        assert task.deadline_at > after.next_retry_at


async def test_deadline_passing_while_retrying_ends_the_task(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a task waiting out its backoff in RETRYING
    task = (await fake_app.submit("image.generate", demo_params("a fog"), max_attempts=3,
                                  deadline_s=30.0)).task  # fmt: skip
    held = await claim_generating(fake_app)
    error = {"code": "upstream_timeout", "message": "slow", "retryable": True}
    retrying = await fake_app.apply(held, Event.FAIL, fenced=True, retry_error=error)
    assert retrying.status is Status.RETRYING

    # When its deadline passes before anyone claims it
    clock.advance(31.0)
    await fake_app.supervisor().sweep()

    # Then it is TIMEOUT deadline_exceeded, final, and no attempt is started
    after = await fake_app.get(task.id)
    assert after.status is Status.TIMEOUT and after.final
    assert after.attempt == 1
    assert after.error is not None and after.error["code"] == "deadline_exceeded"
    events = await assert_one_final_state(fake_app.engine.store, task.id)
    assert events[-1].event is Event.DEADLINE


# Manual retry ------------------------------------------------------------------------------


async def _failed(app: kiln.App, clock: AdvancingClock) -> Task:
    task = (await app.submit("image.generate", demo_params("once"), max_attempts=1)).task
    held = await claim_generating(app)
    error = {"code": "simulated_failure", "message": "no", "retryable": True}
    await app.apply(held, Event.FAIL, fenced=True, retry_error=error)
    return task


async def _timed_out(app: kiln.App, clock: AdvancingClock) -> Task:
    task = (await app.submit("image.generate", demo_params("twice"), max_attempts=1)).task
    await claim_generating(app, lease_ttl_s=1.0)
    clock.advance(2.0)
    await app.supervisor().sweep()
    return task


async def _cancelled(app: kiln.App, clock: AdvancingClock) -> Task:
    task = (await app.submit("image.generate", demo_params("thrice"))).task
    await app.cancel(task.id)
    return task


@pytest.mark.parametrize(
    ("make", "status"),
    [(_failed, Status.FAILED), (_timed_out, Status.TIMEOUT), (_cancelled, Status.CANCELLED)],
    ids=["failed", "timeout", "cancelled"],
)
async def test_manual_retry_revives_a_final_task_and_it_runs_again(
    fake_app: kiln.App, clock: AdvancingClock, make: Any, status: Status
) -> None:
    # Given a final FAILED, TIMEOUT or CANCELLED task
    task = await make(fake_app, clock)
    final = await fake_app.get(task.id)
    assert final.status is status and final.finished_at is not None
    clock.advance(5.0)

    # When it is retried by hand
    revived = await fake_app.retry(task.id)

    # Then it is RETRYING, due now, with one more attempt allowed and no finish time
    assert revived.status is Status.RETRYING
    assert revived.next_retry_at == revived.ready_at == clock.now
    assert revived.max_attempts == max(final.max_attempts, final.attempt) + 1
    assert revived.finished_at is None
    events = await fake_app.engine.store.events(task_id=task.id)
    assert (events[-1].event, events[-1].from_status) == (Event.RETRY, status)

    # And a worker runs it to SUCCESS on its next attempt
    worker = fake_app.worker(concurrency=1, resources={"gpu": 1}, idle_poll_s=(0.01, 0.05))
    async with running(worker.run()):
        done = await wait_for_status(fake_app.engine.store, task.id, Status.SUCCESS)
    assert done.attempt == final.attempt + 1 <= done.max_attempts
    assert done.finished_at is not None


async def test_retry_of_a_successful_task_is_refused(app: kiln.App) -> None:
    # Given a task that succeeded
    task = (await app.submit("image.generate", demo_params("done"))).task
    worker = app.worker(concurrency=1, resources={"gpu": 1}, idle_poll_s=(0.01, 0.05))
    async with running(worker.run()):
        done = await wait_for_status(app.engine.store, task.id, Status.SUCCESS)

    # When it is retried / Then the retry is refused and the task is untouched
    with pytest.raises(NotRetryable):
        await app.retry(task.id)
    after = await app.get(task.id)
    assert (after.status, after.version, after.attempt) == (done.status, done.version,
                                                            done.attempt)  # fmt: skip


async def test_retry_of_an_active_task_is_refused(fake_app: kiln.App) -> None:
    # Given a GENERATING task and a PENDING one
    generating = (await fake_app.submit("image.generate", demo_params("busy"))).task
    held = await claim_generating(fake_app)
    assert held.id == generating.id
    pending = (await fake_app.submit("image.generate", demo_params("queued"))).task

    # When either is retried / Then the retry is refused and neither changes
    for task in (held, pending):
        with pytest.raises(NotRetryable):
            await fake_app.retry(task.id)
        after = await fake_app.get(task.id)
        assert (after.status, after.version) == (task.status, task.version)
