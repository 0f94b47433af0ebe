"""The kept counts of the queue on both stores, and the queue positions made from them
(kiln/store/positions.py): exact anywhere in a line longer than the counts' limits, with
tasks not yet ready and tasks past their deadline among them, under every claim policy;
and counts that commit with the change they count, even when the process writing them is
killed mid-batch."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.models import Task
from kiln.states import Event, Status
from kiln.store import Store
from kiln.store.claims import ClaimPolicy, fair_position
from kiln.store.positions import FIRST_LIMIT

from .backends import Backend, Row
from .factories import KIND, SettableClock, make_new_task, step_change
from .queue_counts import assert_kept_counts_agree

LONG = 600  # a level longer than twice the first count, and than the second


async def submit_all(store: Store, news: Sequence[Any]) -> list[Task]:
    found: list[Task] = []
    for start in range(0, len(news), 100):  # together: one group commit or write batch
        chunk = news[start : start + 100]
        found += [r.task for r in await asyncio.gather(*(store.submit(n) for n in chunk))]
    return found


def claim_order(truth: Callable[..., list[Row]], now: float, aging_s: float | None) -> list[str]:
    """The due queue of KIND as a full sort of the table says it, in claim order."""
    sql = (
        "SELECT id, priority, ready_at FROM tasks WHERE kind = ? AND status IN"
        " ('PENDING', 'RETRYING') AND ready_at <= ? AND deadline_at > ?"
    )
    rows = truth(sql, KIND, now, now)
    if aging_s is None:
        rows.sort(key=lambda r: (-r[1], r[2], r[0]))
    else:
        rows.sort(key=lambda r: (r[2] - r[1] * aging_s, r[0]))
    return [r[0] for r in rows]


async def a_long_line(
    store: Store, clock: SettableClock, truth: Callable[..., list[Row]], backend: Backend
) -> list[Task]:
    """LONG tasks at priority 0 (each 0.01 s after the last), 20 at priority 3 and 20 at
    -2 among them, two tenants; some not ready yet, some past their deadline."""
    news = []
    for i in range(LONG + 40):
        priority = 3 if i % 31 == 0 else -2 if i % 31 == 1 else 0
        tenant = "acme" if i % 3 else "globex"
        news.append(make_new_task({"n": i}, priority=priority, tenant=tenant))
    tasks = []
    for chunk_start in range(0, len(news), 50):
        tasks += await submit_all(store, news[chunk_start : chunk_start + 50])
        clock.advance(0.5)
    now = clock()
    for task in tasks[5::97]:  # not ready for another minute (a delay, a retry's backoff)
        backend.execute(store, "UPDATE tasks SET ready_at = ? WHERE id = ?", [now + 60, task.id])
    for task in tasks[7::89]:  # past the deadline, not swept yet
        backend.execute(store, "UPDATE tasks SET deadline_at = ? WHERE id = ?", [now, task.id])
    assert_kept_counts_agree(backend, store)
    return [t for t in (await store.get_many([t.id for t in tasks])).values()]


def sample(order: list[str]) -> list[str]:
    """Both ends, the middle and a spread of the line."""
    middle = len(order) // 2
    picked = {*order[:3], *order[-3:], *order[middle - 2 : middle + 2], *order[::23]}
    picked |= {order[FIRST_LIMIT - 1], order[FIRST_LIMIT], order[-FIRST_LIMIT - 1]}
    return sorted(picked)


async def test_positions_are_exact_anywhere_in_a_long_line(
    store: Store, clock: SettableClock, truth: Callable[..., list[Row]], backend: Backend
) -> None:
    # Given a line longer than the counts' first limits, with tasks not ready yet and tasks
    # past their deadline in it
    tasks = {t.id: t for t in await a_long_line(store, clock, truth, backend)}
    for aging_s in (None, 0.7):
        policy = None if aging_s is None else ClaimPolicy(aging_s=aging_s)
        order = claim_order(truth, clock(), aging_s)
        assert len(order) > LONG
        # Then each task's position is its place in a full sort of the table
        for task_id in sample(order):
            assert await store.queue_position(tasks[task_id], policy) == order.index(task_id) + 1
        # And the tasks that are not due have none
        due = set(order)
        for task in [t for t in tasks.values() if t.id not in due][:5]:
            assert await store.queue_position(task, policy) is None


async def test_fair_positions_come_from_each_tenants_line(
    store: Store, clock: SettableClock, truth: Callable[..., list[Row]], backend: Backend
) -> None:
    # Given the long line of two tenants
    tasks = await a_long_line(store, clock, truth, backend)
    order = claim_order(truth, clock(), None)
    tenant_of = {t.id: t.tenant for t in tasks}
    fair = ClaimPolicy(fair=True)
    for task_id in sample(order):
        task = next(t for t in tasks if t.id == task_id)
        # Then a task's fair position is its place in its tenant's line, plus up to that
        # many turns of the other tenant's line (as deep as a full sort says it is)
        own_line = [i for i in order if tenant_of[i] == task.tenant]
        other = sum(1 for i in order if tenant_of[i] != task.tenant)
        expected = fair_position(own_line.index(task_id) + 1, [other])
        assert await store.queue_position(task, fair) == expected


async def test_kept_counts_follow_claims_retries_cancels_and_purges(
    store: Store, clock: SettableClock, backend: Backend, engine: Any
) -> None:
    # Given queued tasks of two kinds and priorities
    news = [make_new_task({"n": i}, priority=i % 2, kind=KIND) for i in range(30)]
    news += [make_new_task({"n": i}, kind="other.kind") for i in range(5)]
    tasks = await submit_all(store, news)
    # When some are claimed, some fail into a retry, some are cancelled, some run past
    # their deadline and the supervisor ends them, and the finished ones are purged
    claimed = await store.claim(worker_id="w", kinds=[KIND], limit=10, lease_ttl_s=30)
    due = clock() + 30
    for task in claimed[:4]:
        retry = {"ready_at": due, "next_retry_at": due}
        await store.apply(step_change(task, Event.FAIL, Event.SCHEDULE_RETRY, fields=retry))
    for task in claimed[4:6]:
        await store.apply(step_change(task, Event.RELEASE))
    for task in tasks[20:25]:
        await engine.cancel(task.id)
    assert_kept_counts_agree(backend, store)
    clock.advance(7200)
    await engine.supervisor(owner="sup").sweep()
    assert_kept_counts_agree(backend, store)
    assert (await store.stats(tenant=None, ghost_after_s=0)).counts["PENDING"] == 0
    await store.purge(finished_before=clock() + 1, tenant=None, exclude=(), limit=100)
    # Then the kept counts equal a recount after each
    assert_kept_counts_agree(backend, store)


WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from kiln.store import open_store
    from tests_factories import make_new_task

    async def main() -> None:
        store = open_store(sys.argv[1])
        n = 0
        while True:
            news = [make_new_task({"n": n + i}, priority=i % 3) for i in range(40)]
            await asyncio.gather(*(store.submit(x) for x in news))
            await store.claim(worker_id="w", kinds=["conformance.job"], limit=7,
                              lease_ttl_s=30)
            n += 40
            print(n, flush=True)

    asyncio.run(main())
    """
)


async def test_a_writer_killed_mid_batch_leaves_the_counts_right(
    store: Store, backend: Backend, tmp_path: Path
) -> None:
    # Given a process submitting and claiming in batches on the same database
    url = backend.url(tmp_path / "store")
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    (tmp_path / "tests_factories.py").write_text(
        (Path(__file__).parent / "factories.py").read_text()
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    writer = subprocess.Popen(
        [sys.executable, str(script), url], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        # When it is killed with SIGKILL in the middle of its work
        assert writer.stdout is not None
        deadline = time.monotonic() + 60
        done = 0
        while done < 400 and time.monotonic() < deadline:
            line = writer.stdout.readline()
            assert line, "the writer exited"
            done = int(line)
        assert done >= 400, "the writer made too little progress in a minute"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    # Then the counts it committed equal a recount, whatever batch it was in
    assert_kept_counts_agree(backend, store)
    assert backend.rows(store, "SELECT count(*) FROM tasks")[0][0] >= 400
    # And every task it committed has its one submit event (SQLite writes a group of
    # submissions' rows and events in one INSERT each: both or neither)
    unlogged = (
        "SELECT count(*) FROM tasks WHERE (SELECT count(*) FROM events"
        " WHERE events.task_id = tasks.id AND events.event = 'submit') <> 1"
    )
    assert backend.rows(store, unlogged)[0][0] == 0
    statuses = {r[0] for r in backend.rows(store, "SELECT DISTINCT status FROM tasks")}
    assert {str(Status.PENDING), str(Status.WAITING_FOR_RESOURCE)} <= statuses


async def test_a_position_is_read_from_the_kept_counts_not_counted_over_the_line(
    store: Store, clock: SettableClock, backend: Backend
) -> None:
    # Given a line of 40 tasks above a new task's priority and 10 at it
    await submit_all(store, [make_new_task({"n": i}, priority=1) for i in range(40)])
    await submit_all(store, [make_new_task({"n": 100 + i}) for i in range(10)])
    clock.advance(1)
    (new,) = await submit_all(store, [make_new_task({"n": "new"})])
    assert await store.queue_position(new) == 51
    # When the kept count of the level above says 5 more (a count, not a task)
    backend.execute(store, "UPDATE queue_counts SET n = n + 5 WHERE priority = 1")
    # Then the new task's position moves by 5: it came from the count, no task was counted
    assert await store.queue_position(new) == 56
    backend.execute(store, "UPDATE queue_counts SET n = n - 5 WHERE priority = 1")
    assert await store.queue_position(new) == 51


async def test_a_task_and_its_position_are_read_together(
    store: Store, clock: SettableClock
) -> None:
    # Given queued tasks of two priorities, and one claimed
    tasks = await submit_all(store, [make_new_task({"n": i}, priority=i % 2) for i in range(6)])
    (claimed,) = await store.claim(worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=30)
    # Then each read gives the task as it is now and the position queue_position gives
    for task in tasks:
        found, position = await store.read_standing(task.id)
        assert found is not None and found.status == (await store.get(task.id)).status
        assert position == await store.queue_position(found)
        assert (position is None) == (task.id == claimed.id)
    assert await store.read_standing("tsk_none") == (None, None)


async def test_the_task_holding_a_content_is_read_with_its_position(
    store: Store, engine: Any
) -> None:
    # Given two queued tasks, the second holding some content
    await submit_all(store, [make_new_task({"n": "before"})])
    (held,) = await submit_all(store, [make_new_task({"n": "held"})])
    assert held.dedup_key is not None
    # Then a read of that content finds the task and its position
    found, position = await store.read_dedup(held.tenant, held.dedup_key)
    assert found is not None and found.id == held.id and position == 2
    assert await store.read_dedup("another-tenant", held.dedup_key) == (None, None)
    # And once the task is cancelled, nothing holds the content any more
    await engine.cancel(held.id)
    assert await store.read_dedup(held.tenant, held.dedup_key) == (None, None)
