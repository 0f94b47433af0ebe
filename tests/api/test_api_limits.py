"""Tenant limits at the API: submission rate limits (429 with Retry-After, nothing stored,
shared through the store by every API node) and a waiting task's place in a pool's line."""

from __future__ import annotations

import math

from api_support import (
    ALICE_KEY,
    BOB_KEY,
    assert_error,
    bearer,
    image_body,
    make_kiln,
    running_api,
    with_keys,
)

from kiln.config import Settings
from kiln.limits import Rate, TenantLimit
from kiln.states import Status


async def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_nothing_is_stored(
    settings: Settings,
) -> None:
    limited = with_keys(settings).with_(
        tenant_limits={"alice": TenantLimit(rate=Rate(per_s=0.01, burst=3))}
    )
    async with running_api(limited, key=ALICE_KEY) as api:
        accepted = [await api.submit(image_body(f"fox {i}")) for i in range(3)]
        assert [r.status_code for r in accepted] == [201, 201, 201]
        refused = await api.submit(image_body("one too many"))
        error = assert_error(refused, 429, "rate_limited")
        assert "alice" in error["message"]
        assert "KILN_TENANT_LIMITS" in error["message"]
        retry_after = int(refused.headers["Retry-After"])
        # One token comes back every 100 s; most of that is left
        assert 1 <= retry_after <= math.ceil(1 / 0.01)
        assert retry_after > 50
        assert await api.task_count() == 3
        # Another tenant is not limited by alice's flood
        other = await api.submit(image_body("bob's fox"), key=BOB_KEY)
        assert other.status_code == 201
        # A bad request is still a 422 (checked before any token is taken)
        bad = await api.submit({"kind": "image.generate", "params": {}})
        assert_error(bad, 422, "invalid_request")
        # The server keeps serving, and the refusals are counted
        assert (await api.client.get("/healthz")).status_code == 200
        metrics = (await api.client.get("/metrics")).text
        assert "kiln_rate_limited_total 1.0" in metrics


async def test_the_rate_limit_holds_across_api_nodes(settings: Settings) -> None:
    # Given two API nodes on one database, each with its own process state
    limited = with_keys(settings).with_(tenant_rate=Rate(per_s=0.01, burst=2))
    async with (
        running_api(limited, key=ALICE_KEY) as node_1,
        running_api(limited, key=ALICE_KEY, kiln_app=make_kiln(limited)) as node_2,
    ):
        answers = [
            await node_1.submit(image_body("fox 1")),
            await node_2.submit(image_body("fox 2")),
            await node_1.submit(image_body("fox 3")),
            await node_2.submit(image_body("fox 4")),
        ]
        assert [r.status_code for r in answers] == [201, 201, 429, 429]
        assert await node_1.task_count() == 2


async def test_a_waiting_task_shows_its_place_in_the_pool_line(settings: Settings) -> None:
    pooled = settings.with_(pools={"gpu-a100": 1})
    async with running_api(pooled) as api:
        ids = [(await api.submit(image_body(f"fox {i}"))).json()["id"] for i in range(3)]
        store = api.kiln.engine.store
        claimed = await store.claim(
            worker_id="w-1", kinds=["image.generate"], limit=3, lease_ttl_s=60
        )
        by_id = {t.id: t for t in claimed}
        for task_id in ids:  # in submission order: the first takes the slot
            task = by_id[task_id]
            await store.pools.acquire(task.id, task.epoch, {"gpu-a100": 1}, {"gpu-a100": 1})
        holder, first, second = [(await api.client.get(f"/v1/tasks/{i}")).json() for i in ids]
        assert holder["status"] == Status.WAITING_FOR_RESOURCE and holder["resource_wait"] is None
        assert first["resource_wait"] == {
            "pool": "gpu-a100", "position": 1, "capacity": 1, "held": 1, "waiting": 2,
        }  # fmt: skip
        assert second["resource_wait"]["position"] == 2
        listed = (await api.client.get("/v1/tasks")).json()["items"]
        assert sorted(t["resource_wait"]["position"] for t in listed if t["resource_wait"]) == [
            1,
            2,
        ]
        stats = (await api.client.get("/v1/stats")).json()
        assert stats["pools"] == {"gpu-a100": {"capacity": 1, "held": 1, "waiting": 2}}
        metrics = (await api.client.get("/metrics")).text
        assert 'kiln_pool_held{pool="gpu-a100"} 1.0' in metrics
        assert 'kiln_pool_waiting{pool="gpu-a100"} 2.0' in metrics


async def test_without_pools_tasks_show_no_resource_wait(settings: Settings) -> None:
    async with running_api(with_keys(settings), key=ALICE_KEY) as api:
        created = (await api.submit(image_body("fox"), headers=bearer(ALICE_KEY))).json()
        assert created["resource_wait"] is None
        assert (await api.client.get("/v1/stats")).json()["pools"] == {}
