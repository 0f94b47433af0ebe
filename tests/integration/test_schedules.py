"""Delayed tasks and recurring schedules on each store: the leader's sweep fires every due
tick once, honours the overlap and missed-tick policies and pauses; a delayed task is not
claimed by a real worker before its moment, and is after.

The schedule tests run on the fake clock and call ``sweep()``; the worker test runs on
the real clock."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import kiln
from kiln import canonical, demo
from kiln.app import running
from kiln.config import Settings
from kiln.counters import SCHEDULE_FIRES
from kiln.errors import RateLimited
from kiln.limits import Rate
from kiln.models import Task
from kiln.process_metrics import supervisor_readings
from kiln.scheduler import tick_key
from kiln.states import Event, Status
from kiln.store import ScheduleRecord
from kiln.supervisor import Supervisor
from kiln.timing import Cron

from .conftest import AdvancingClock, demo_params, wait_for_status


async def add_schedule(
    app: kiln.App,
    cron: str,
    *,
    timezone: str = "UTC",
    overlap: str = "queue",
    missed: str = "fire_once",
    prompt: str = "a lighthouse",
) -> ScheduleRecord:
    """A schedule as ``POST /v1/schedules`` makes it: params checked, defaults filled."""
    checked = Cron.parse(cron, timezone, now=app.now())
    params = app.kind("image.generate").validate(demo_params(prompt))
    submission = {
        "kind": "image.generate", "params": params,
        "priority": 0, "max_attempts": 3, "deadline_s": 3600.0,
        "timeouts": {"waiting_s": 600.0, "generating_s": 600.0, "uploading_s": 120.0},
        "metadata": {}, "webhook": None,
    }  # fmt: skip
    record = ScheduleRecord(
        id=canonical.new_id("sch_"), tenant="default", cron=checked.expression,
        timezone=timezone, submission=submission, overlap=overlap, missed=missed, paused=False,
        next_at=checked.next_after(app.now()),
    )  # fmt: skip
    return await app.engine.store.schedules.create(record)


async def fired_keys(app: kiln.App) -> list[str]:
    tasks, _ = await app.engine.store.list_tasks(tenant="default", limit=200)
    return sorted(t.idempotency_key or "" for t in tasks)


async def sweep_every_second(sup: Supervisor, clock: AdvancingClock, seconds: int) -> None:
    for _ in range(seconds):
        clock.advance(1)
        await sup.sweep()


async def test_a_schedule_every_second_fires_each_tick_once(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a schedule with a seconds field, and the tick times it should fire
    start = clock.now
    schedule = await add_schedule(fake_app, "* * * * * *")
    sup = fake_app.supervisor()

    # When the leader sweeps once a second for ten seconds, plus two sweeps in between
    await sweep_every_second(sup, clock, 10)
    await sup.sweep()
    await sup.sweep()

    # Then ticks start+1 .. start+10 each made exactly one task
    assert await fired_keys(fake_app) == sorted(
        tick_key(schedule.id, start + n) for n in range(1, 11)
    )
    after = await fake_app.engine.store.schedules.get(schedule.id)
    assert after is not None and after.fired == 10 and after.next_at == start + 11
    assert (await fake_app.engine.store.counters())[(SCHEDULE_FIRES, "fired")] == 10
    counters, _ = supervisor_readings(sup)
    assert counters['kiln_supervisor_schedule_ticks{outcome="fired"}']() == 10


async def test_a_second_supervisor_fires_nothing_while_the_first_leads(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    schedule = await add_schedule(fake_app, "* * * * * *")
    leader, other = fake_app.supervisor(owner="a"), fake_app.supervisor(owner="b")
    assert (await leader.sweep()).leading
    for _ in range(5):
        clock.advance(1)
        assert not (await other.sweep()).leading
        assert (await leader.sweep()).leading
    keys = await fired_keys(fake_app)
    assert len(keys) == len(set(keys)) == 5
    assert all(k.startswith(f"schedule:{schedule.id}:") for k in keys)


@pytest.mark.parametrize(("missed", "fired"), [("fire_once", 2), ("skip", 1)])
async def test_missed_ticks_fire_once_or_are_skipped(
    fake_app: kiln.App, clock: AdvancingClock, missed: str, fired: int
) -> None:
    # Given a schedule every minute, and no supervisor for ten and a half minutes
    start = clock.now  # a whole minute
    schedule = await add_schedule(fake_app, "* * * * *", missed=missed)
    clock.advance(630)

    # When the leader sweeps: ticks +60 .. +540 are older than the grace (60 s), +600 is not
    await fake_app.supervisor().sweep()

    # Then fire_once made one task for the latest missed tick and one for the on-time
    # tick; skip made only the on-time one; the rest are counted skipped_missed
    keys = await fired_keys(fake_app)
    expected = [tick_key(schedule.id, start + 600)]
    if missed == "fire_once":
        expected.append(tick_key(schedule.id, start + 540))
    assert keys == sorted(expected) and len(keys) == fired
    counts = await fake_app.engine.store.counters()
    assert counts[(SCHEDULE_FIRES, "skipped_missed")] == 10 - fired
    after = await fake_app.engine.store.schedules.get(schedule.id)
    assert after is not None and after.next_at == start + 660
    assert after.fired == fired and after.skipped == 10 - fired


async def test_overlap_skip_waits_for_the_last_task_and_queue_does_not(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given two schedules every second, one skipping overlaps, and no worker
    skipping = await add_schedule(fake_app, "* * * * * *", overlap="skip", prompt="one")
    queuing = await add_schedule(fake_app, "* * * * * *", overlap="queue", prompt="two")
    sup = fake_app.supervisor()

    # When three ticks come while the tasks stay PENDING
    await sweep_every_second(sup, clock, 3)

    # Then the skipping schedule fired once, the queuing one three times
    keys = await fired_keys(fake_app)
    assert sum(k.startswith(f"schedule:{skipping.id}:") for k in keys) == 1
    assert sum(k.startswith(f"schedule:{queuing.id}:") for k in keys) == 3
    after = await fake_app.engine.store.schedules.get(skipping.id)
    assert after is not None and after.skipped == 2 and after.last_task_id is not None

    # And once its task is final, the next tick fires again
    await fake_app.cancel(after.last_task_id)
    await sweep_every_second(sup, clock, 1)
    keys = await fired_keys(fake_app)
    assert sum(k.startswith(f"schedule:{skipping.id}:") for k in keys) == 2


async def test_a_paused_schedule_fires_nothing_and_resumes_from_now(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    schedule = await add_schedule(fake_app, "* * * * * *")
    sup = fake_app.supervisor()
    await sweep_every_second(sup, clock, 2)
    await fake_app.engine.store.schedules.set_paused(
        schedule.id, paused=True, next_at=schedule.next_at
    )
    await sweep_every_second(sup, clock, 5)
    assert len(await fired_keys(fake_app)) == 2

    # Resumed: the ticks of the pause are not fired, the next ones are
    resumed_at = clock.now
    cron = Cron(schedule.cron, schedule.timezone)
    await fake_app.engine.store.schedules.set_paused(
        schedule.id, paused=False, next_at=cron.next_after(resumed_at)
    )
    await sweep_every_second(sup, clock, 2)
    keys = await fired_keys(fake_app)
    assert len(keys) == 4
    assert tick_key(schedule.id, resumed_at + 1) in keys


async def test_a_daily_schedule_in_berlin_fires_at_three_on_the_spring_forward_night(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given 02:30 Europe/Berlin every day, created on 2026-03-28 at noon UTC
    clock.now = dt.datetime(2026, 3, 28, 12, tzinfo=dt.UTC).timestamp()
    schedule = await add_schedule(fake_app, "30 2 * * *", timezone="Europe/Berlin")
    sup = fake_app.supervisor()

    # When 01:00 UTC comes (02:00 local jumps to 03:00), then 01:30 UTC the next night
    clock.now = dt.datetime(2026, 3, 29, 1, 0, 0, tzinfo=dt.UTC).timestamp()
    await sup.sweep()
    clock.now = dt.datetime(2026, 3, 30, 0, 30, 0, tzinfo=dt.UTC).timestamp()
    await sup.sweep()

    # Then the first tick fired at 03:00 local (01:00 UTC), the next at 02:30 CEST
    first = dt.datetime(2026, 3, 29, 1, 0, tzinfo=dt.UTC).timestamp()
    second = dt.datetime(2026, 3, 30, 0, 30, tzinfo=dt.UTC).timestamp()
    assert await fired_keys(fake_app) == sorted(
        [tick_key(schedule.id, first), tick_key(schedule.id, second)]
    )


# Delayed tasks, with a real worker on the real clock --------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
async def real_app(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[kiln.App]:
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        settings = settings.with_(database_url=server.new_database())
    instance = kiln.App(settings=settings)
    demo.register(instance)
    async with instance:
        yield instance


async def claim_time(app: kiln.App, task: Task) -> float:
    events = await app.engine.store.events(task_id=task.id)
    return next(e.at for e in events if e.event is Event.CLAIM)


async def test_a_delayed_task_is_not_claimed_before_its_moment_and_is_after(
    real_app: kiln.App,
) -> None:
    # Given a worker polling fast, a delayed task and one to run now
    delay_s = 1.5
    submitted_at = time.time()
    later = (await real_app.submit("image.generate", demo_params("later"), delay_s=delay_s)).task
    now = (await real_app.submit("image.generate", demo_params("now"))).task
    assert later.status is Status.PENDING and await real_app.queue_position(later) is None

    async with running(real_app.worker(concurrency=2, idle_poll_s=(0.02, 0.05)).run()):
        # When the worker has run the other task
        await wait_for_status(real_app.engine.store, now.id, Status.SUCCESS, timeout_s=20)
        # Then the delayed one is still PENDING, unclaimed, while its moment is ahead
        if time.time() < submitted_at + delay_s - 0.2:
            held = await real_app.get(later.id)
            assert held.status is Status.PENDING and held.attempt == 0

        # And after its moment, it runs
        done = await wait_for_status(real_app.engine.store, later.id, Status.SUCCESS, timeout_s=20)
    assert await claim_time(real_app, done) >= later.ready_at >= submitted_at + delay_s - 0.01


async def test_a_delayed_task_can_be_cancelled_before_it_runs(real_app: kiln.App) -> None:
    moment = time.time() + 3600
    task = (await real_app.submit("image.generate", demo_params("x"), run_at=moment)).task
    assert task.ready_at == pytest.approx(moment)
    assert task.deadline_at == pytest.approx(moment + task.deadline_s)
    cancelled = await real_app.cancel(task.id)
    assert cancelled.status is Status.CANCELLED


async def test_a_delayed_task_shares_content_only_with_the_same_moment(real_app: kiln.App) -> None:
    params: dict[str, Any] = demo_params("same")
    moment = time.time() + 600
    at_once = await real_app.submit("image.generate", params)
    later = await real_app.submit("image.generate", params, run_at=moment)
    again = await real_app.submit("image.generate", params, run_at=moment)
    assert later.created and later.task.id != at_once.task.id
    assert again.deduplicated and again.task.id == later.task.id


async def test_a_retried_delay_with_its_idempotency_key_is_a_replay(real_app: kiln.App) -> None:
    first = await real_app.submit(
        "image.generate", demo_params("k"), delay_s=60, idempotency_key="k-1"
    )
    await asyncio.sleep(0.05)
    again = await real_app.submit(
        "image.generate", demo_params("k"), delay_s=60, idempotency_key="k-1"
    )
    assert again.replayed and again.task.id == first.task.id


async def test_ticks_count_against_the_tenant_rate_and_every_schedule_gets_its_turn(
    fake_app: kiln.App, clock: AdvancingClock
) -> None:
    # Given a tenant that may create one task a second, and five every-second schedules
    fake_app.settings = fake_app.settings.with_(tenant_rate=Rate(per_s=1, burst=1))
    schedules = [await add_schedule(fake_app, "* * * * * *", prompt=f"s{n}") for n in range(5)]
    sup = fake_app.supervisor()

    # When the leader sweeps once a second for ten seconds
    await sweep_every_second(sup, clock, 10)

    # Then ten tasks were made, not fifty: one a second, the ticks over the rate put off
    # (the oldest due tick goes first, so every schedule fired)
    assert len(await fired_keys(fake_app)) == 10
    fired = [await fake_app.engine.store.schedules.get(s.id) for s in schedules]
    assert all(s is not None and s.fired >= 1 for s in fired)
    counters = await fake_app.engine.store.counters()
    assert counters[(SCHEDULE_FIRES, "rate_limited")] > 0
    assert counters[(SCHEDULE_FIRES, "fired")] == 10
    # And a request of the tenant finds the bucket the ticks emptied
    with pytest.raises(RateLimited):
        await fake_app.check_rate("default")


@pytest.mark.parametrize(("missed", "second_tick"), [("fire_once", 50), ("skip", 60)])
async def test_a_tick_put_off_past_the_grace_follows_the_missed_policy(
    fake_app: kiln.App, clock: AdvancingClock, missed: str, second_tick: int
) -> None:
    # Given a tenant that may create one task every 100 s, and a schedule every 10 s
    fake_app.settings = fake_app.settings.with_(tenant_rate=Rate(per_s=0.01, burst=1))
    start = clock.now  # a whole minute
    schedule = await add_schedule(fake_app, "*/10 * * * * *", missed=missed)
    sup = fake_app.supervisor()

    # When the leader sweeps every 10 s for 150 s
    for _ in range(15):
        clock.advance(10)
        await sup.sweep()

    # Then tick +10 fired with the first token, and the next token (at +110) went to:
    # fire_once: the latest tick missed by then (+50), the ones before it skipped;
    # skip: the first tick still on time (+60), the missed ones skipped
    assert await fired_keys(fake_app) == sorted(
        [tick_key(schedule.id, start + 10), tick_key(schedule.id, start + second_tick)]
    )
    after = await fake_app.engine.store.schedules.get(schedule.id)
    assert after is not None and after.fired == 2 and after.skipped > 0
