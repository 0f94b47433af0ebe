"""Schemathesis against the served /openapi.json: no 5xx, and every error in the envelope."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from api_support import ADMIN_KEY, ALICE_KEY, bearer, make_kiln, threaded_server
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from kiln.api import create_app
from kiln.config import Settings

STREAMS = r"^/v1/(tasks/\{task_id\}/)?events$|^/metrics$"


@pytest.fixture(scope="module")
def served_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root: Path = tmp_path_factory.mktemp("fuzz")
    config = Settings(
        data_dir=root,
        database_url=f"sqlite:///{root / 'kiln.db'}",
        storage_url=(root / "results").as_uri(),
        api_keys={ALICE_KEY: "alice"},
        admin_key=ADMIN_KEY,
    )
    with threaded_server(create_app(make_kiln(config))) as url:
        yield url


def error_envelope(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every answer of 400 or more is ``{"error": {"code", "message", "details"}}``."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    assert isinstance(body["error"]["code"], str) and body["error"]["code"], body
    assert isinstance(body["error"]["details"], list), body
    return True


#: The fields the document leaves to the server's own judgment (docs: docs/schedules.md,
#: docs/webhooks.md): a cron expression is read by the scheduler's parser (one that never
#: fires is refused), a time zone must be in the server's tz database, a moment must be
#: within a year and not before 1970, a webhook's
#: address must pass the private-address policy; a bulk filter's times must leave some task
#: out (relative to the request's moment); a pipeline's steps are checked by their kinds and
#: the graph's rules (docs/pipelines.md). The schema takes their every form.
SERVER_JUDGED = {"cron", "timezone", "run_at", "webhook_url", "filter"}


def _judged_by_the_server(detail: dict[str, Any]) -> bool:
    loc = detail.get("loc") or [None]
    return loc[-1] in SERVER_JUDGED or loc[:2] == ["params", "steps"]


def accepted_unless_judged_by_the_server(ctx: Any, response: Any, case: Any) -> bool | None:
    """A schema-valid request is accepted (positive_data_acceptance), but for a 422 whose
    every detail names a field the server judges (SERVER_JUDGED)."""
    if response.status_code != 422:
        return positive_data_acceptance(ctx, response, case)
    details = json.loads(response.content)["error"]["details"]
    if details and all(_judged_by_the_server(d) for d in details):
        return True
    return positive_data_acceptance(ctx, response, case)


def _operations(url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json").exclude(path_regex=STREAMS)
    return [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]


def _unique_idempotency_key(case: Any) -> None:
    """A valid key reused with another body is rightly refused (422): keep keys unique."""
    if case.headers and "Idempotency-Key" in case.headers:
        case.headers["Idempotency-Key"] = uuid.uuid4().hex


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_answers_fuzzed_requests_in_its_contract(served_url: str, mode: Any) -> None:
    operations = _operations(served_url)
    assert len(operations) >= 9
    # Unknown query parameters are ignored (as most APIs do), so a negative case that only
    # adds one is rightly accepted: negative runs check everything but that rejection.
    positive = mode is GenerationMode.POSITIVE
    excluded = [positive_data_acceptance] if positive else [negative_data_rejection]
    checks = (
        [error_envelope, accepted_unless_judged_by_the_server] if positive else [error_envelope]
    )
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)  # fmt: skip
        def conforms(case: Any) -> None:
            if mode is GenerationMode.POSITIVE:
                _unique_idempotency_key(case)
            case.call_and_validate(
                headers=bearer(ADMIN_KEY),
                additional_checks=checks,
                excluded_checks=excluded,
                timeout=30,
            )

        try:
            conforms()
        except Unsatisfiable:
            # An operation without inputs (GET /healthz) has no invalid request to make.
            assert mode is GenerationMode.NEGATIVE, operation.label
