"""Inputs by reference against retention: a referenced input is pinned from the moment it
is found until its task is in, so the supervisor's pass cannot delete it in between; and a
reference whose content retention took between the lookup and the pin is refused, leaving
nothing behind. On SQLite with a folder, and on PostgreSQL with a bucket."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import kiln
from images import png
from kiln import inputs, transform
from kiln.app import running
from kiln.config import Settings
from kiln.errors import InvalidRequest
from kiln.states import Status
from kiln.storage import sha256_hex
from kiln.store.inputs import KnownObject

from .conftest import AdvancingClock, object_keys, wait_for_status

#: Shorter than a pin lasts (STALE_S): a pinned input is held, not abandoned.
RETENTION_S = 600.0
PIXELS = 10_000_000


@pytest.fixture(params=["sqlite-local", "postgres-s3"])
async def kept_app(
    request: pytest.FixtureRequest, settings: Settings, clock: AdvancingClock
) -> AsyncIterator[kiln.App]:
    """An App on the fake clock keeping final tasks and unused inputs 10 min."""
    settings = settings.with_(retention_s=RETENTION_S)
    if request.param == "postgres-s3":
        settings = settings.with_(
            database_url=request.getfixturevalue("postgres_server").new_database(),
            storage_url=request.getfixturevalue("s3_server").url("refs"),
        )
    app = kiln.App(settings=settings, clock=clock)
    transform.register(app)
    async with app:
        yield app


async def _transformed(app: kiln.App, data: bytes, op: str = "convert") -> kiln.Task:
    """An upload (pinned, stored, released as the API does) run by a worker to SUCCESS."""
    held = await inputs.hold(app.engine.store, app.storage, [(sha256_hex(data), data)])
    item = inputs.record("image", data, inputs.probe(data, PIXELS))
    task = (await app.submit(transform.KIND, {"op": op}, inputs=[item])).task
    await inputs.release(app.engine.store, app.storage, held)
    async with running(app.worker(concurrency=1).run()):
        return await wait_for_status(app.engine.store, task.id, Status.SUCCESS)


async def _pins(app: kiln.App) -> list[tuple[str, int]]:
    store = app.engine.store
    return sorted(await store._rows(store.q.sql("SELECT sha256, pins FROM inputs"), (), tuple))


async def test_retention_cannot_delete_a_referenced_input_before_its_task_is_in(
    kept_app: kiln.App, clock: AdvancingClock
) -> None:
    app = kept_app
    data = png(30, 20)
    first = await _transformed(app, data)
    supervisor = app.supervisor(owner="sup")
    # Given a reference found and pinned (what the API does before it submits)
    found, held = await inputs.refer(
        app.engine.store, app.storage, "default", {"image": sha256_hex(data)}, max_pixels=PIXELS
    )
    # When the only task that used the input is purged, past the retention, meanwhile
    clock.advance(RETENTION_S + 1)
    report = await supervisor.sweep()
    assert report.purged == 1 and await app.engine.store.get(first.id) is None
    # Then the input is still there; the task goes in, and a worker reads the input
    assert await object_keys(app.storage, "inputs/") == [inputs.input_key(sha256_hex(data))]
    task = (await app.submit(transform.KIND, {"op": "convert", "format": "webp"},
                             inputs=found)).task  # fmt: skip
    await inputs.release(app.engine.store, app.storage, held)
    async with running(app.worker(concurrency=1).run()):
        done = await wait_for_status(app.engine.store, task.id, Status.SUCCESS)
    assert done.inputs == first.inputs
    # And retention keeps it while that task exists
    await supervisor.sweep()
    assert await object_keys(app.storage, "inputs/") == [inputs.input_key(sha256_hex(data))]


@pytest.mark.parametrize("what", ["upload", "output"])
async def test_content_retention_took_after_the_lookup_is_refused_and_leaves_nothing(
    kept_app: kiln.App, clock: AdvancingClock, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    app = kept_app
    data = png(26, 14)
    first = await _transformed(app, data)
    assert first.result is not None
    sha256 = sha256_hex(data) if what == "upload" else first.result["outputs"][0]["sha256"]
    supervisor = app.supervisor(owner="sup")
    lookup = app.engine.store.inputs.find_object

    async def then_retention(tenant: str, wanted: str) -> KnownObject | None:
        # The lookup finds the content; then, before the pin, retention purges the task
        # (and its output) and deletes the input no task refers to any more.
        found = await lookup(tenant, wanted)
        clock.advance(RETENTION_S + 1)
        assert (await supervisor.sweep()).purged == 1
        return found

    monkeypatch.setattr(app.engine.store.inputs, "find_object", then_retention)

    with pytest.raises(InvalidRequest) as refused:
        await inputs.refer(
            app.engine.store, app.storage, "default", {"image": sha256}, max_pixels=PIXELS
        )

    assert refused.value.details[0]["loc"] == ["inputs", "image"]
    assert await object_keys(app.storage, "") == []
    assert await _pins(app) == []
