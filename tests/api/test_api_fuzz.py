"""Schemathesis against the served /openapi.json: no 5xx, and every error in the envelope."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from api_support import ADMIN_KEY, ALICE_KEY, bearer, make_kiln, threaded_server
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

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


def _operations(url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json").exclude(path_regex=STREAMS)
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_answers_fuzzed_requests_in_its_contract(served_url: str, mode: Any) -> None:
    operations = _operations(served_url)
    assert len(operations) >= 9
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)  # fmt: skip
        def conforms(case: Any) -> None:
            case.call_and_validate(headers=bearer(ADMIN_KEY))

        conforms()
