"""The error tree. Each error the API can answer carries its API.md ``code``.

``kiln.api.errors`` alone maps these to HTTP statuses and the error envelope.
"""

from __future__ import annotations

from typing import Any


class KilnError(Exception):
    code = "internal_error"

    def __init__(self, message: str, *, details: list[Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or []


class InvalidRequest(KilnError):
    code = "invalid_request"


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


class StoreUnavailable(KilnError):
    code = "store_unavailable"


class StorageError(KilnError):
    code = "storage_error"


class NotLeader(KilnError):
    """A supervisor action was refused because another supervisor holds the leadership."""

    code = "not_leader"


# Errors raised by task handlers --------------------------------------------------------


class TaskError(Exception):
    """Base of the errors a handler raises on purpose, with a reason code."""

    retryable = True

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message or self.__class__.__name__)
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

    retryable = False
