"""Fixtures of the API tests: the API over a fresh SQLite file, with or without keys."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from api_support import ALICE_KEY, ApiUnderTest, running_api, with_keys

from kiln.config import Settings


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API with no keys configured (one tenant, `default`) and no workers."""
    async with running_api(settings) as under_test:
        yield under_test


@pytest.fixture
async def keyed_api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API with keys for tenants alice and bob plus an admin key; calls as alice."""
    async with running_api(with_keys(settings), key=ALICE_KEY) as under_test:
        yield under_test


@pytest.fixture
async def working_api(settings: Settings) -> AsyncIterator[ApiUnderTest]:
    """The API with keys and one in-process worker; calls as alice."""
    async with running_api(with_keys(settings), key=ALICE_KEY, workers=1) as under_test:
        yield under_test
