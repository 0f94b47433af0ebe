"""The one mapping from kiln's errors to HTTP statuses and the error envelope."""

from __future__ import annotations

import json

import pytest

from kiln import errors
from kiln.api.errors import kiln_error_response

API_TABLE = [
    (errors.InvalidRequest, 422),
    (errors.UnknownKind, 422),
    (errors.IdempotencyKeyReused, 422),
    (errors.Unauthorized, 401),
    (errors.Forbidden, 403),
    (errors.NotFound, 404),
    (errors.AlreadyFinal, 409),
    (errors.NotRetryable, 409),
    (errors.NotInReview, 409),
    (errors.PayloadTooLarge, 413),
    (errors.UnsupportedMediaType, 415),
]


@pytest.mark.parametrize(("error", "status"), API_TABLE, ids=[e.code for e, _ in API_TABLE])
def test_each_api_code_gets_its_status_and_the_envelope(
    error: type[errors.KilnError], status: int
) -> None:
    response = kiln_error_response(error("what went wrong", details=[{"loc": ["x"]}]))

    assert response.status_code == status
    assert json.loads(bytes(response.body)) == {
        "error": {"code": error.code, "message": "what went wrong", "details": [{"loc": ["x"]}]}
    }


def test_rate_limited_is_429_with_retry_after() -> None:
    response = kiln_error_response(errors.RateLimited("slow down", retry_after_s=2.4))

    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert json.loads(bytes(response.body))["error"]["code"] == "rate_limited"


@pytest.mark.parametrize("error", [errors.LeaseLost, errors.NotLeader, errors.KilnError])
def test_engine_internal_errors_are_500_without_their_message(
    error: type[errors.KilnError], caplog: pytest.LogCaptureFixture
) -> None:
    response = kiln_error_response(error("epoch 7 of tsk_x lost"))

    assert response.status_code == 500
    body = json.loads(bytes(response.body))
    assert body == {
        "error": {
            "code": "internal_error",
            "message": "the server failed to answer this request",
            "details": [],
        }
    }
    assert any(r.message == "request_failed" for r in caplog.records)
