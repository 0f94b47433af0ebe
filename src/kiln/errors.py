"""The error tree: every error kiln raises on purpose is a :class:`KilnError`.

Each class carries its ``code`` (API.md's where the API answers it). ``kiln.api.errors``
alone maps codes to HTTP statuses and the error envelope; a code it does not list is
answered ``500 internal_error`` without its message.

- ``KilnError`` ``internal_error`` (500): the root; a bare one is a bug.

  - Refused requests (the API answers them with their own code)

    - ``InvalidRequest`` ``invalid_request`` (422): a malformed body or a bad field.
    - ``InvalidCursor`` ``invalid_cursor`` (422): a list cursor no page gave.
    - ``UnknownKind`` ``unknown_kind`` (422): no task kind of that name is registered.
    - ``IdempotencyKeyReused`` ``idempotency_key_reused`` (422): same key, other body.
    - ``Unauthorized`` ``unauthorized`` (401): no valid API key.
    - ``Forbidden`` ``forbidden`` (403): the key may not do this.
    - ``NotFound`` ``not_found`` (404): no such task for this key.
    - ``AlreadyFinal`` ``already_final`` (409): the task ended; it cannot be cancelled.
    - ``NotRetryable`` ``not_retryable`` (409): only FAILED, TIMEOUT or CANCELLED retry.
    - ``NotInReview`` ``not_in_review`` (409): a review decision on a task not in review.
    - ``PayloadTooLarge`` ``payload_too_large`` (413): a body or an upload over a limit.
    - ``UnsupportedMediaType`` ``unsupported_media_type`` (415): not JSON or an image.
    - ``RateLimited`` ``rate_limited`` (429): over the tenant's rate; ``retry_after_s``.

  - Engine outcomes (never a request's fault)

    - ``LeaseLost`` ``lease_lost`` (500): a fenced write matched no row; the worker
      drops the task.
    - ``Conflict`` ``conflict`` (409): an unfenced compare-and-set lost a race.

      - ``StaleDecision`` ``conflict``: the row kept its status and epoch but what the
        change was decided on moved (a retry planned before a cancel was asked, a forced
        cancel after it was taken back); read again and decide.
    - ``NotLeader`` ``not_leader`` (500): another supervisor leads.
    - ``StoreUnavailable`` ``store_unavailable`` (503): the database does not answer.
    - ``StorageError`` ``storage_error`` (503): the object storage does not answer.
    - ``kiln.states.IllegalTransition`` ``illegal_transition`` (500): the state table
      forbids the event from the task's status.

  - ``ConfigError`` ``config_error`` (500; ``kiln`` exits 2): a ``KILN_*`` variable or an
    option has a value kiln cannot use. Raised before anything starts, by
    ``kiln.config``, with the variable's name, its value and what it should be.

  - ``TaskError`` ``task_failed``: what a task handler raises on purpose. Its ``code``
    (given, or the class's) becomes the task's ``error.code``; never an API answer.

    - ``Retryable`` ``task_failed``: another attempt may succeed (``retry_after_s``).
      - ``Yielded`` ``yielded``: the handler gave its slot up at a step boundary because
        ``ctx.should_yield()`` said so (preemption); the worker gives the attempt back to
        the queue uncounted. Raised when it was not asked, it fails the attempt.
    - ``Permanent`` ``permanent_failure``: another attempt would fail too.

- ``kiln.client.ConnectionFailed`` ``connection_failed``: the client could not reach
  the server (raised by the client only).
"""

from __future__ import annotations

from typing import Any


class KilnError(Exception):
    """The root of kiln's errors: a ``code``, a human ``message`` and API ``details``."""

    code = "internal_error"

    def __init__(self, message: str, *, details: list[Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or []


class InvalidRequest(KilnError):
    code = "invalid_request"


class InvalidCursor(InvalidRequest):
    """A list cursor that no page of kiln ever gave (422 ``invalid_cursor``)."""

    code = "invalid_cursor"


class UnknownKind(KilnError):
    code = "unknown_kind"


class IdempotencyKeyReused(KilnError):
    code = "idempotency_key_reused"


class Unauthorized(KilnError):
    code = "unauthorized"


class Forbidden(KilnError):
    code = "forbidden"


class NotFound(KilnError):
    code = "not_found"


class AlreadyFinal(KilnError):
    code = "already_final"


class NotRetryable(KilnError):
    code = "not_retryable"


class NotInReview(KilnError):
    code = "not_in_review"


class PayloadTooLarge(KilnError):
    code = "payload_too_large"


class UnsupportedMediaType(KilnError):
    code = "unsupported_media_type"


class RateLimited(KilnError):
    code = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LeaseLost(KilnError):
    """A fenced write matched no row: the task moved on without this worker.

    The worker that sees it stops working on the task at once and touches nothing more.
    """

    code = "lease_lost"


class Conflict(KilnError):
    """A compare-and-set on an unfenced transition lost a race; re-read and decide again."""

    code = "conflict"


class StaleDecision(Conflict):
    """The row kept its status and epoch but changed what the change was decided on (a
    cancel asked since the read that planned a retry): read it again and decide anew."""


class StoreUnavailable(KilnError):
    code = "store_unavailable"


class StorageError(KilnError):
    code = "storage_error"


class NotLeader(KilnError):
    """A supervisor action was refused because another supervisor holds the leadership."""

    code = "not_leader"


class ConfigError(KilnError):
    """A setting (a ``KILN_*`` variable or a command-line option) has an unusable value.

    ``variable`` names the setting; the message says its value and what it should be.
    """

    code = "config_error"

    def __init__(
        self, message: str, *, details: list[Any] | None = None, variable: str | None = None
    ) -> None:
        super().__init__(message, details=details)
        self.variable = variable


# Errors raised by task handlers --------------------------------------------------------


class TaskError(KilnError):
    """Base of the errors a handler raises on purpose, with a reason code.

    The instance's ``code`` is the one given, else ``task_failed`` when retryable and
    ``permanent_failure`` when not: it becomes the task's ``error.code``.
    """

    code = "task_failed"
    retryable = True

    def __init__(
        self, message: str = "", *, code: str | None = None, details: list[Any] | None = None
    ) -> None:
        super().__init__(message or self.__class__.__name__, details=details)
        self.code = code or ("task_failed" if self.retryable else "permanent_failure")


class Retryable(TaskError):
    """The attempt failed for a reason that may pass: schedule another attempt.

    ``retry_after_s`` (an upstream's Retry-After, say) is the least time to wait before it.
    """

    retryable = True

    def __init__(
        self, message: str = "", *, code: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class Permanent(TaskError):
    """The attempt failed for a reason another attempt would not fix: fail for good."""

    code = "permanent_failure"
    retryable = False


class Yielded(Retryable):
    """Raised by a handler at a step boundary when ``ctx.should_yield()`` is true: the
    leading supervisor asked the attempt to give its pool slot to a task of higher
    priority (KILN_PREEMPT_AFTER_S). The worker gives the attempt back to the queue
    uncounted (``release``), keeping its place ahead of later tasks of its priority.
    Raised when the attempt was not asked, it is an ordinary retryable failure."""

    code = "yielded"

    def __init__(self, message: str = "yielded its slot at a step boundary") -> None:
        super().__init__(message, code="yielded")
