"""The autoscaling signals on /metrics and /v1/stats, on SQLite and on PostgreSQL.

Tasks are put in every state the signals tell apart (ready, a retry not yet due, waiting
for a pool, generating, uploading, finished) the way a worker and the engine would, and a
worker registers in the store's registry as another process would; then both answers
must count them exactly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_support import (
    ADMIN_KEY,
    ALICE_KEY,
    ApiUnderTest,
    running_api,
    wait_until,
    with_keys,
)
from test_api_metrics import labelled, scrape

import kiln
from conformance.factories import claim_one, drive, make_new_task, step_change
from kiln import demo
from kiln.autoscaling import desired_workers
from kiln.config import Settings
from kiln.states import Event, Status
from kiln.store import Store, WorkerRecord

KIND = "scale.job"
POOL = "gpu-a"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def scaled_api(
    request: pytest.FixtureRequest, settings: Settings, clock: Any
) -> AsyncIterator[ApiUnderTest]:
    """The API (keys on, no in-process workers) on the fake clock, over either store."""
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_server").new_database()
        settings = settings.with_(database_url=url)
    app = kiln.App(settings=with_keys(settings).with_(pools={POOL: 1}), clock=clock)
    demo.register(app)
    async with app, running_api(app.settings, key=ADMIN_KEY, kiln_app=app) as api:
        yield api


async def _retry_later(store: Store, due_at: float) -> None:
    """A task that failed once and retries at ``due_at``: not waiting yet."""
    task = (await store.submit(make_new_task({"n": "later"}, kind=KIND))).task
    task = await claim_one(store, KIND)
    fields = {"ready_at": due_at, "next_retry_at": due_at}
    await store.apply(step_change(task, Event.FAIL, Event.SCHEDULE_RETRY, fields=fields))


async def _in_the_pool(store: Store, name: str, *, acquired: bool) -> None:
    """A task of KIND that took the pool's one slot (then GENERATING), or waits for it."""
    task = await drive(store, make_new_task({"n": name}, kind=KIND), Status.WAITING_FOR_RESOURCE)
    wait = await store.pools.acquire(task.id, task.epoch, {POOL: 1}, {POOL: 1})
    assert (wait is None) is acquired
    if acquired:
        await store.apply(step_change(task, Event.ACQUIRE))


async def test_signals_count_every_state_and_the_registered_workers(
    scaled_api: ApiUnderTest, clock: Any
) -> None:
    # Given tasks of one kind in every state, submitted 10 s apart
    store = scaled_api.kiln.engine.store
    started = clock.now
    await drive(store, make_new_task({"n": "done"}, kind=KIND), Status.SUCCESS)
    await drive(store, make_new_task({"n": "up"}, kind=KIND), Status.UPLOADING)
    await _in_the_pool(store, "holds", acquired=True)
    clock.advance(10)
    await _in_the_pool(store, "waits", acquired=False)  # ready since started + 10
    await _retry_later(store, due_at=clock.now + 600)
    clock.advance(10)
    await drive(store, make_new_task({"n": "r"}, kind=KIND), Status.RETRYING)  # due now
    await drive(store, make_new_task({"n": "p1"}, kind=KIND), Status.PENDING)
    clock.advance(5)
    # And two live workers (one serves the kind through the pool), one gone
    await store.workers.seen(_worker("a", slots=3, resources={KIND: {POOL: 1}}), ttl_s=60)
    await store.workers.seen(_worker("b", slots=2, kinds=(KIND, "image.generate")), ttl_s=60)
    await store.workers.seen(_worker("gone", slots=8), ttl_s=1)
    clock.advance(2)

    # When the admin reads the stats and Prometheus scrapes
    body = (await scaled_api.client.get("/v1/stats", headers=ADMIN)).json()
    samples = await scrape(scaled_api)

    # Then the kind waits with 3 (2 ready, 1 in the pool's line), runs 2, has 2 workers
    kind = body["autoscaling"]["kinds"][KIND]
    assert kind == {
        "waiting": 3, "ready": 2, "waiting_for_resource": 1, "running": 2,
        "oldest_waiting_age_s": clock.now - (started + 10), "workers": 2, "worker_slots": 5,
    }  # fmt: skip
    # And the registered kind nobody asked for is there at zero, but for its worker
    assert body["autoscaling"]["kinds"]["image.generate"] == {
        "waiting": 0, "ready": 0, "waiting_for_resource": 0, "running": 0,
        "oldest_waiting_age_s": 0.0, "workers": 1, "worker_slots": 2,
    }  # fmt: skip
    # And the pool has one holder, one waiter since started + 10, the slots of worker a
    assert body["autoscaling"]["pools"] == {
        POOL: {"capacity": 1, "waiting": 1, "running": 1,
               "oldest_waiting_age_s": clock.now - (started + 10), "worker_slots": 3},
    }  # fmt: skip
    # And /metrics says the same
    assert labelled(samples, "kiln_queue_waiting", "kind")[(KIND,)] == 3
    assert labelled(samples, "kiln_queue_running", "kind")[(KIND,)] == 2
    age = labelled(samples, "kiln_queue_oldest_waiting_age_seconds", "kind")
    assert age[(KIND,)] == kind["oldest_waiting_age_s"] and age[("image.generate",)] == 0
    slots = labelled(samples, "kiln_worker_slots", "kind")
    assert slots[(KIND,)] == 5 and slots[("image.generate",)] == 2
    assert labelled(samples, "kiln_pool_running", "pool") == {(POOL,): 1}
    assert labelled(samples, "kiln_pool_waiting", "pool") == {(POOL,): 1}
    assert labelled(samples, "kiln_pool_worker_slots", "pool") == {(POOL,): 3}
    pool_age = labelled(samples, "kiln_pool_oldest_waiting_age_seconds", "pool")
    assert pool_age == {(POOL,): clock.now - (started + 10)}
    # And the existing deployment-wide gauge keeps its meaning (ready tasks only)
    assert samples[("kiln_queue_oldest_age_seconds", ())] == clock.now - (started + 20)


async def test_a_running_worker_process_offers_its_slots(working_api: ApiUnderTest) -> None:
    # Given the API's in-process worker, registered as it started
    async def registered() -> bool:
        answer = await working_api.client.get("/v1/workers", headers=ADMIN)
        return len(answer.json()["workers"]) == 1

    await wait_until(registered, timeout_s=10)
    [worker] = (await working_api.client.get("/v1/workers", headers=ADMIN)).json()["workers"]
    # When Prometheus scrapes and the admin reads the stats
    samples = await scrape(working_api)
    body = (await working_api.client.get("/v1/stats", headers=ADMIN)).json()
    # Then its slots are offered to each kind it serves, and nothing waits or runs
    slots = labelled(samples, "kiln_worker_slots", "kind")
    for kind in worker["kinds"]:
        assert slots[(kind,)] == worker["slots"]
        found = body["autoscaling"]["kinds"][kind]
        assert (found["workers"], found["worker_slots"]) == (1, worker["slots"])
        assert (found["waiting"], found["running"]) == (0, 0)


async def test_a_tenant_sees_no_autoscaling_signals(settings: Settings) -> None:
    # Given an API with keys, When a tenant reads its stats
    async with running_api(with_keys(settings), key=ALICE_KEY) as api:
        body = (await api.client.get("/v1/stats")).json()
    # Then they carry no deployment-wide signals
    assert "autoscaling" not in body and "workers" not in body


def test_desired_workers_counts_running_work_and_is_clamped() -> None:
    # A busy deployment with no backlog keeps its workers (KEDA issue 7459)
    assert desired_workers(0, 8, 2, maximum=10) == 4
    assert desired_workers(5, 8, 4, maximum=10) == 4
    assert desired_workers(0, 0, 4, minimum=1, maximum=10) == 1
    assert desired_workers(100, 0, 1, maximum=10) == 10
    with pytest.raises(ValueError):
        desired_workers(1, 1, 0, maximum=10)


def _worker(
    name: str,
    *,
    slots: int,
    kinds: tuple[str, ...] = (KIND,),
    resources: dict[str, dict[str, int]] | None = None,
) -> WorkerRecord:
    return WorkerRecord(id=f"host-{name}:1:w", host=f"host-{name}", pid=1, version="9.9.9",
                        kinds=kinds, slots=slots, resources=resources or {})  # fmt: skip
