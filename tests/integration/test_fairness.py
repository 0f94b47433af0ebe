"""Fairness with a real worker: one tenant's flood does not stall another tenant, and a
tenant's running cap holds while its work runs."""

from __future__ import annotations

import kiln
from kiln import demo
from kiln.app import running
from kiln.config import Settings
from kiln.limits import TenantLimit
from kiln.states import Event, Status

from .conftest import demo_params, most_at_once, wait_for_status

STEPS = {"steps": 4, "step_ms": 30}


async def flood_then_one(app: kiln.App) -> tuple[list[str], str]:
    flood = []
    for i in range(30):
        params = demo_params(f"flood {i}", **STEPS)
        flood.append((await app.submit("image.generate", params, tenant="flood")).task.id)
    params = demo_params("quiet", **STEPS)
    quiet = (await app.submit("image.generate", params, tenant="quiet")).task.id
    return flood, quiet


async def test_a_flood_does_not_stall_another_tenant_with_fair_claims(settings: Settings) -> None:
    # Given a flood of 30 tasks from one tenant, then one task from another
    fair = settings.with_(claim_order="fair")
    async with kiln.App(settings=fair) as app:
        demo.register(app)
        flood, quiet = await flood_then_one(app)
        # When one worker with two slots runs
        async with running(app.worker(concurrency=2, resources={"gpu": 2}).run()):
            await wait_for_status(app.engine.store, quiet, Status.SUCCESS, timeout_s=30)
            # Then the quiet tenant's task finished while most of the flood still waits
            left = [(await app.get(t)).status for t in flood]
        assert left.count(Status.SUCCESS) <= 4, left


async def test_a_running_cap_holds_while_the_other_tenant_is_served(settings: Settings) -> None:
    capped = settings.with_(tenant_limits={"flood": TenantLimit(running=1)})
    async with kiln.App(settings=capped) as app:
        demo.register(app)
        flood, quiet = await flood_then_one(app)
        async with running(app.worker(concurrency=3, resources={"gpu": 3}).run()):
            await wait_for_status(app.engine.store, quiet, Status.SUCCESS, timeout_s=30)
            for task_id in flood[:6]:
                await wait_for_status(app.engine.store, task_id, Status.SUCCESS, timeout_s=30)
        # Then the capped tenant's attempts never overlapped: claimed to uploaded, one at
        # a time, though the worker had three slots
        spans = []
        for task_id in flood:
            events = {e.event: e.at for e in await app.engine.store.events(task_id=task_id)}
            if Event.UPLOADED in events:
                spans.append((events[Event.CLAIM], events[Event.UPLOADED]))
        assert len(spans) >= 6
        assert most_at_once(spans) == 1
