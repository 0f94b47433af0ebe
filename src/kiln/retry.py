"""Retry policy: which errors retry, and when the next attempt is due."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pydantic

from kiln.errors import StorageError, StoreUnavailable, TaskError
from kiln.models import JSON, Task
from kiln.store import Store

#: Exceptions that mean the handler itself is wrong: another attempt would fail the same way.
PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    TypeError,
    AttributeError,
    NameError,
    NotImplementedError,
    pydantic.ValidationError,
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter: uniform(0, min(max_s, base_s * 2**(attempt-1)))."""

    base_s: float = 1.0
    max_s: float = 60.0

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        ceiling = min(self.max_s, self.base_s * 2 ** max(attempt - 1, 0))
        return rng.uniform(0, ceiling)

    def next_retry_at(
        self, task: Task, now: float, rng: random.Random, min_delay_s: float = 0.0
    ) -> float | None:
        """When the next attempt is due, or None when the task must stay failed.

        ``min_delay_s`` (an upstream's Retry-After) is the least wait, whatever the backoff.
        """
        if task.attempt >= task.max_attempts:
            return None
        due = now + max(self.delay_s(task.attempt, rng), min_delay_s)
        if due >= task.deadline_at:
            return None
        return due


async def retry_slot(store: Store, task: Task, due: float, rate_per_s: float) -> float | None:
    """KILN_RETRY_RATE: when the retry due at ``due`` may go, at most ``rate_per_s`` retries
    a second across every process on ``store``, or None when that is past the task's
    deadline (the task stays failed).

    The store's retry clock hands out slots ``1 / rate_per_s`` apart, so the retries of an
    outage that ends are spread out instead of arriving at once. Only scheduling a retry
    takes a slot (one small write); nothing else touches the clock.
    """
    slot = await store.limits.reserve_retry(due, 1.0 / rate_per_s)
    return slot if slot < task.deadline_at else None


def classify(exc: BaseException) -> JSON:
    """The task error record for an exception a handler raised.

    ``kiln.Retryable`` and ``kiln.Permanent`` say it themselves. Programming errors
    (TypeError, AttributeError, NameError, NotImplementedError, pydantic's
    ValidationError) are permanent: retrying cannot fix code. Everything else (I/O,
    timeouts, out-of-memory, upstream errors) is retryable, code ``internal_error``; a
    storage or store outage is retryable with its own code (``storage_error``).
    """
    message = str(exc) or type(exc).__name__
    if isinstance(exc, TaskError):
        found: JSON = {"code": exc.code, "message": message, "retryable": exc.retryable}
        if exc.details:  # what the handler said of the failure (a ComfyUI node's, ...)
            found["details"] = exc.details
        return found
    if isinstance(exc, StorageError | StoreUnavailable):  # an outage, not the task's fault
        return {"code": exc.code, "message": message, "retryable": True}
    retryable = not isinstance(exc, PROGRAMMING_ERRORS)
    return {
        "code": "internal_error",
        "message": f"{type(exc).__name__}: {message}",
        "retryable": retryable,
    }
