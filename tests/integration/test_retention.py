"""Retention run by the leading supervisor: old final tasks leave the store and storage."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.states import Status

from .conftest import AdvancingClock, demo_params, object_keys, wait_for_status


@pytest.fixture(params=["sqlite", "postgres"])
async def kept_app(
    request: pytest.FixtureRequest, settings: Settings, clock: AdvancingClock
) -> AsyncIterator[kiln.App]:
    """An App on the fake clock keeping final tasks 1 h, tenant ``archive`` forever."""
    settings = settings.with_(retention_s=3600.0, retention_tenants={"archive": 0.0})
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        settings = settings.with_(database_url=server.new_database())
    app = kiln.App(settings=settings, clock=clock)
    demo.register(app)
    async with app:
        yield app


async def _done(app: kiln.App, prompt: str, tenant: str = "default") -> kiln.Task:
    task = (await app.submit("image.generate", demo_params(prompt), tenant=tenant)).task
    async with running(app.worker(concurrency=1).run()):
        return await wait_for_status(app.engine.store, task.id, Status.SUCCESS)


async def test_the_supervisor_purges_tasks_past_retention_with_their_outputs(
    kept_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given two finished tasks with outputs, one of a tenant kept forever
    gone = await _done(kept_app, "a dune")
    kept = await _done(kept_app, "a glacier", tenant="archive")
    assert await object_keys(kept_app.storage, f"tasks/{gone.id}/")
    supervisor = kept_app.supervisor(owner="sup")
    # When the supervisor sweeps before and after the retention time
    assert (await supervisor.sweep()).purged == 0
    clock.advance(3601.0)
    report = await supervisor.sweep()
    # Then the task past retention is gone from the store and the storage, events included
    assert report.purged == 1
    assert await kept_app.engine.store.get(gone.id) is None
    assert await kept_app.engine.store.events(task_id=gone.id) == []
    assert await object_keys(kept_app.storage, f"tasks/{gone.id}/") == []
    # And the kept tenant's task and objects stay
    assert (await kept_app.engine.store.get(kept.id)) is not None
    assert await object_keys(kept_app.storage, f"tasks/{kept.id}/")
    # And a pass runs at most once a minute
    assert (await supervisor.sweep()).purged == 0


def test_retention_settings_come_from_the_environment() -> None:
    settings = Settings.from_env(
        {"KILN_RETENTION_S": "86400", "KILN_RETENTION_TENANTS": "acme:3600, archive:0"}
    )
    assert settings.retention_s == 86400.0
    assert settings.retention_tenants == {"acme": 3600.0, "archive": 0.0}
    assert Settings.from_env({}).retention_s is None
    with pytest.raises(kiln.KilnError, match="tenant:seconds"):
        Settings.from_env({"KILN_RETENTION_TENANTS": "acme"})
