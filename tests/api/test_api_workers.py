"""GET /v1/workers and the worker metrics: the live worker processes, for the admin."""

from __future__ import annotations

import os
import socket
from datetime import datetime, timedelta

from api_support import ADMIN_KEY, BOB_KEY, ApiUnderTest, wait_until
from test_api_metrics import labelled, scrape

from kiln.store import WorkerRecord


def rfc3339(value: object) -> datetime:
    """An API time: RFC 3339 text in UTC (``...Z``), nothing else."""
    assert isinstance(value, str) and value.endswith("Z"), value
    moment = datetime.fromisoformat(value)
    assert moment.utcoffset() == timedelta(0)
    return moment


async def test_the_admin_lists_the_live_workers_and_metrics_count_them(
    working_api: ApiUnderTest,
) -> None:
    # Given the API's in-process worker, and another process's worker that holds a model
    store = working_api.kiln.engine.store
    other = WorkerRecord(id="gpu-box:77:w", host="gpu-box", pid=77, version="9.9.9",
                         kinds=("image.generate",), slots=2, running=1,
                         resources={"image.generate": {"gpu": 1}}, models=("sdxl",))  # fmt: skip
    await store.workers.seen(other, ttl_s=60)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    found: list[dict[str, object]] = []

    async def both() -> bool:
        found[:] = (await working_api.client.get("/v1/workers", headers=admin)).json()["workers"]
        return len(found) == 2

    # When the admin asks (the in-process worker registers as it starts)
    await wait_until(both, timeout_s=10)
    workers: list[dict[str, object]] = found
    # Then both are there, each as it said, this process's with its own host and pid
    mine = next(w for w in workers if w["id"] != other.id)
    theirs = next(w for w in workers if w["id"] == other.id)
    assert (mine["host"], mine["pid"]) == (socket.gethostname(), os.getpid())
    assert "image.generate" in mine["kinds"] and mine["slots"] >= 1
    # And its times are RFC 3339 UTC, as every time in the API
    times = [rfc3339(mine[name]) for name in ("started_at", "last_seen_at", "expires_at")]
    assert times[1] >= times[0] and times[2] > times[1]
    assert theirs["models"] == ["sdxl"] and theirs["running"] == 1 and theirs["slots"] == 2
    assert theirs["resources"] == {"image.generate": {"gpu": 1}}
    # And /metrics counts the workers per kind and, for the admin, per model
    samples = await scrape(working_api, ADMIN_KEY)
    assert labelled(samples, "kiln_workers", "kind")[("image.generate",)] == 2
    assert labelled(samples, "kiln_worker_models_loaded", "model") == {("sdxl",): 1}
    # And the admin's stats carry the same list, for the dashboard
    stats = (await working_api.client.get("/v1/stats", headers=admin)).json()
    assert {w["id"] for w in stats["workers"]} == {w["id"] for w in workers}
    assert all(rfc3339(w["expires_at"]) > rfc3339(w["started_at"]) for w in stats["workers"])
    # And a tenant's key may not list them, and its stats carry no list
    assert "workers" not in (await working_api.client.get("/v1/stats")).json()
    refused = await working_api.client.get(
        "/v1/workers", headers={"Authorization": f"Bearer {BOB_KEY}"}
    )
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "forbidden"
