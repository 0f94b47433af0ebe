"""The store under test, parametrised by backend (see backends.py)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kiln
from kiln.config import Settings
from kiln.store import Clock, Store

from .backends import BACKENDS, Backend, PostgresDatabases, Row
from .factories import KIND
from .queue_counts import assert_kept_counts_agree


@pytest.fixture(params=BACKENDS, ids=[b.name for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> Backend:
    found: Backend = request.param
    if found.name == "postgres":
        PostgresDatabases.server = request.getfixturevalue("postgres_server")
    return found


@pytest.fixture
async def store(backend: Backend, tmp_path: Path, clock: Clock) -> AsyncIterator[Store]:
    """A fresh store on the fake clock (``clock.advance(s)`` moves its time)."""
    opened = backend.open(tmp_path / "store", clock)
    # First use on the test's own loop: a PostgreSQL pool belongs to the loop that opened
    # it, and must not be opened by a thread's short-lived loop in a race test.
    await opened.last_seq()
    submitter = getattr(opened, "submitter", None)
    if submitter is not None:  # every plain submission of the test goes to it
        assert await submitter.wait_ready(), "the submit process did not start"
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture
def truth(backend: Backend, store: Store) -> Callable[..., list[Row]]:
    """Ground truth read straight from the database: ``truth(sql, *args)``."""

    def rows(sql: str, *args: Any) -> list[Row]:
        return backend.rows(store, sql, args)

    return rows


async def _handler(ctx: Any, params: Any) -> None:
    return None


@pytest.fixture
def engine(store: Store, settings: Settings) -> kiln.App:
    """The engine's policy on the store under test (the store fixture closes it)."""
    app = kiln.App(store=store, settings=settings, rng=random.Random(7))
    app.task(KIND)(_handler)
    return app


@pytest.fixture
def queue_counts_checked(backend: Backend, store: Store) -> Iterator[None]:
    """After the test, the kept counts of the queue equal a recount of the tasks (a module
    asks for it with ``pytestmark = pytest.mark.usefixtures("queue_counts_checked")``)."""
    yield
    assert_kept_counts_agree(backend, store)
