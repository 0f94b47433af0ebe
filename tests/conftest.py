"""Shared fixtures: every test gets a fresh SQLite file and results folder under tmp_path."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import kiln
from kiln import demo
from kiln.config import Settings
from services.postgres import postgres_server  # noqa: F401
from services.seaweed import s3_server  # noqa: F401


@pytest.fixture(autouse=True)
def _clean_kiln_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests pass settings explicitly: no KILN_* variable leaks in from the shell."""
    for name in list(os.environ):
        if name.startswith("KILN_"):
            monkeypatch.delenv(name, raising=False)
    yield


class FakeClock:
    """An injectable clock: supervisor and retry tests move time instead of sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'kiln.db'}",
        storage_url=(tmp_path / "results").as_uri(),
        lease_ttl_s=5.0,
        supervisor_interval_s=0.1,
        retry_base_s=0.01,
        retry_max_s=0.05,
        cancel_grace_s=1.0,
    )


@pytest.fixture
async def app(settings: Settings) -> AsyncIterator[kiln.App]:
    """An App on a fresh SQLite file with the demo kind registered (real clock)."""
    instance = kiln.App(settings=settings)
    demo.register(instance)
    async with instance:
        yield instance


def _for_its_store(item: pytest.Item) -> bool:
    """Whether a conformance case runs on its store (``postgres_only``, ``sqlite_only``)."""
    ids = getattr(getattr(item, "callspec", None), "id", "").split("-")
    if "sqliteprocess" in ids:  # SQLite again, with a submit process: the marked cases
        return (
            item.get_closest_marker("submit_process") is not None
            and item.get_closest_marker("postgres_only") is None
        )
    for marker, store in (("postgres_only", "postgres"), ("sqlite_only", "sqlite")):
        if item.get_closest_marker(marker) is not None and store not in ids:
            return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the browser tests last: Playwright's sync API keeps an event loop set on the
    main thread for the rest of the session, which async tests after it would trip on.
    A ``postgres_only`` conformance test is deselected for the other stores, a
    ``sqlite_only`` one for PostgreSQL (not skipped: nothing is missing)."""
    other = [item for item in items if not _for_its_store(item)]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if _for_its_store(item)]
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)
