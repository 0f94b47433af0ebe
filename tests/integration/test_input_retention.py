"""Retention of everything: uploaded inputs no task refers to, and idempotency keys past
their own TTL, go with the leading supervisor's pass; `kiln reconcile` reports an input
nothing accounts for. On SQLite with a folder, and on PostgreSQL with a bucket."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import kiln
from images import png
from kiln import inputs, transform
from kiln.app import running
from kiln.config import Settings
from kiln.reconcile import Options, reconcile
from kiln.states import Event, Status
from kiln.storage import sha256_hex

from .conftest import AdvancingClock, object_keys, wait_for_status

RETENTION_S = 3600.0
KEYS_S = 600.0


@pytest.fixture(params=["sqlite-local", "postgres-s3"])
async def kept_app(
    request: pytest.FixtureRequest, settings: Settings, clock: AdvancingClock
) -> AsyncIterator[kiln.App]:
    """An App on the fake clock keeping final tasks and unused inputs 1 h (tenant
    ``archive`` forever), idempotency keys 10 min."""
    settings = settings.with_(
        retention_s=RETENTION_S, retention_tenants={"archive": 0.0}, idempotency_ttl_s=KEYS_S
    )
    if request.param == "postgres-s3":
        settings = settings.with_(
            database_url=request.getfixturevalue("postgres_server").new_database(),
            storage_url=request.getfixturevalue("s3_server").url(),
        )
    app = kiln.App(settings=settings, clock=clock)
    transform.register(app)
    async with app:
        yield app


async def _upload(app: kiln.App, data: bytes) -> kiln.models.JSON:
    """What the API does with an uploaded file: pin and store it (then submit, release)."""
    held = await inputs.hold(app.engine.store, app.storage, [(sha256_hex(data), data)])
    await inputs.release(app.engine.store, app.storage, held)
    return inputs.record("image", data, inputs.probe(data, 10_000_000))


async def _transformed(app: kiln.App, item: kiln.models.JSON, tenant: str) -> kiln.Task:
    params = {"op": "thumbnail", "width": 8, "height": 8}
    task = (await app.submit(transform.KIND, params, tenant=tenant, inputs=[item])).task
    async with running(app.worker(concurrency=1).run()):
        return await wait_for_status(app.engine.store, task.id, Status.SUCCESS)


async def test_inputs_no_task_refers_to_go_once_unused_for_the_retention(
    kept_app: kiln.App, clock: AdvancingClock
) -> None:
    app = kept_app
    # Given an input of a task that will be purged, one of a task kept forever, and one
    # uploaded whose task never came (a refused submission)
    used, kept, stray = png(20, 10), png(30, 10), png(40, 10)
    gone_task = await _transformed(app, await _upload(app, used), "default")
    await _transformed(app, await _upload(app, kept), "archive")
    await _upload(app, stray)
    key = {data: inputs.input_key(sha256_hex(data)) for data in (used, kept, stray)}
    supervisor = app.supervisor(owner="sup")
    # When the supervisor sweeps before the retention ran out
    await supervisor.sweep()
    # Then every input is still there
    assert sorted(await object_keys(app.storage, "inputs/")) == sorted(key.values())
    # When the retention has passed (the finished task is purged in the same pass)
    clock.advance(RETENTION_S + 1)
    report = await supervisor.sweep()
    # Then the inputs no task refers to any more are gone, and the kept task's stays
    assert report.purged == 1 and await app.engine.store.get(gone_task.id) is None
    assert await object_keys(app.storage, "inputs/") == [key[kept]]
    # And reconciliation finds nothing left over
    assert (await reconcile(app, Options())).clean


async def test_an_input_uploaded_again_after_its_deletion_is_stored_again(
    kept_app: kiln.App, clock: AdvancingClock
) -> None:
    app = kept_app
    data = png(24, 12)
    await _upload(app, data)
    clock.advance(RETENTION_S + 1)
    await app.supervisor(owner="sup").sweep()
    assert await object_keys(app.storage, "inputs/") == []
    # When the same content is uploaded again and used, the task finds its input
    task = await _transformed(app, await _upload(app, data), "default")
    assert task.status is Status.SUCCESS
    assert await object_keys(app.storage, "inputs/") == [inputs.input_key(sha256_hex(data))]


async def test_idempotency_keys_go_after_their_ttl_while_their_task_stays(
    kept_app: kiln.App, clock: AdvancingClock
) -> None:
    app = kept_app
    params = {"op": "convert", "format": "webp"}
    item = await _upload(app, png(16, 16))
    first = await app.submit(transform.KIND, params, idempotency_key="k-1", inputs=[item])
    supervisor = app.supervisor(owner="sup")
    replay = await app.submit(transform.KIND, params, idempotency_key="k-1", inputs=[item])
    assert replay.replayed and replay.task.id == first.task.id
    # When the key's TTL has passed and the supervisor swept
    clock.advance(KEYS_S + 1)
    assert (await supervisor.sweep()).purged == 0
    # Then the task is still there, but the key makes a new task
    assert await app.engine.store.get(first.task.id) is not None
    await app.apply(first.task, Event.CANCEL)
    again = await app.submit(transform.KIND, params, idempotency_key="k-1", inputs=[item])
    assert again.created and again.task.id != first.task.id


async def test_reconcile_reports_an_input_nothing_accounts_for(kept_app: kiln.App) -> None:
    app = kept_app
    # Given an input object the store does not know (written before inputs were tracked)
    data = png(12, 12)
    await app.storage.put(inputs.input_key(sha256_hex(data)), data)
    # When reconciliation runs, then it reports it, and a repair past the grace deletes it
    report = await reconcile(app, Options())
    assert [o.key for o in report.orphans] == [inputs.input_key(sha256_hex(data))]
    repaired = await reconcile(app, Options(repair=True, grace_s=0.0))
    assert repaired.deleted_count == 1
    assert await object_keys(app.storage, "inputs/") == []
