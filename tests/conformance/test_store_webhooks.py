"""The webhook outbox on every backend: events become one delivery each, the cursor only
moves forward, a task's deliveries go out in seq order, and a purge takes them along."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import psycopg
import pytest

from kiln.models import JSON, NewTask, Task, TaskEvent
from kiln.states import Status
from kiln.store import Store
from kiln.store.outbox import DELIVERED, FAILED, PENDING, WebhookAttempt, WebhookDelivery
from kiln.store.postgres import PostgresStore
from kiln.webhooks import wants
from services.postgres import PostgresServer

from .backends import Row
from .factories import KIND, SettableClock, drive, make_new_task

Truth = Callable[..., list[Row]]
HOOK: JSON = {"url": "https://hooks.example.com/kiln", "events": ["final"]}


def hooked(prompt: str, webhook: JSON | None = HOOK, kind: str = KIND) -> NewTask:
    return dataclasses.replace(make_new_task({"prompt": prompt}, kind=kind), webhook=webhook)


def delivery(event: TaskEvent, task: Task, now: float) -> WebhookDelivery:
    assert task.webhook is not None
    return WebhookDelivery(
        event_id=event.id,
        seq=event.seq,
        task_id=task.id,
        tenant=task.tenant,
        event=str(event.event),
        url=task.webhook["url"],
        payload=f'{{"seq":{event.seq}}}',
        next_attempt_at=now,
        created_at=now,
        updated_at=now,
    )


async def fill_outbox(store: Store, now: float) -> int:
    """What the dispatcher does: scan the log after the cursor, queue what is wanted."""
    added = 0
    while True:
        scan = await store.outbox.scan(limit=100)
        if scan.last <= scan.cursor:
            return added
        wanted = [delivery(e, t, now) for e, t in scan.events if wants(t.webhook, e)]
        added += await store.outbox.enqueue(wanted, cursor=scan.last)


async def test_a_task_keeps_its_webhook(store: Store) -> None:
    # Given a task submitted with a webhook, one with a webhook and a key, and one without
    with_hook = (await store.submit(hooked("a"))).task
    keyed_new = dataclasses.replace(hooked("c"), idempotency_key="k1")
    keyed = (await store.submit(keyed_new)).task
    without = (await store.submit(hooked("b", webhook=None))).task
    # Then each reads back as it was submitted
    assert with_hook.webhook == keyed.webhook == HOOK
    assert (await store.get(with_hook.id)).webhook == HOOK  # type: ignore[union-attr]
    assert (await store.get(keyed.id)).webhook == HOOK  # type: ignore[union-attr]
    assert (await store.get(without.id)).webhook is None  # type: ignore[union-attr]


async def test_wanted_events_become_one_delivery_each_and_the_cursor_moves_past_them(
    store: Store, clock: SettableClock, truth: Truth
) -> None:
    # Given a task with a webhook for final events, one for every event, and one without
    final_only = await drive(store, hooked("a"), Status.SUCCESS)
    every = await drive(
        store, hooked("b", {"url": "http://h.test/", "events": ["*"]}), Status.CANCELLED
    )
    await drive(store, hooked("c", webhook=None), Status.SUCCESS)
    # When the outbox is filled from the log
    added = await fill_outbox(store, clock())
    # Then the final event of the first task and every event of the second are queued
    rows = await store.outbox.deliveries()
    every_events = await store.events(task_id=every.id)
    assert {(d.task_id, d.event) for d in rows} == {(final_only.id, "uploaded")} | {
        (every.id, str(e.event)) for e in every_events
    }
    assert added == len(rows) == 1 + len(every_events)
    assert all(d.status == PENDING and d.attempts == 0 for d in rows)
    assert [d.seq for d in rows] == sorted(d.seq for d in rows)
    # And the cursor stands at the end of the log, so a new scan finds nothing
    scan = await store.outbox.scan(limit=100)
    assert scan.cursor == await store.last_seq() and scan.read == 0
    assert truth("SELECT seq FROM webhook_cursor") == [(scan.cursor,)]


async def test_queueing_the_same_events_again_adds_nothing_and_never_moves_the_cursor_back(
    store: Store, clock: SettableClock
) -> None:
    # Given a dispatcher that scanned and queued, and one that read the same scan before
    # it was killed (or a second leader for a moment)
    await drive(store, hooked("a"), Status.SUCCESS)
    scan = await store.outbox.scan(limit=100)
    wanted = [delivery(e, t, clock()) for e, t in scan.events if wants(t.webhook, e)]
    assert len(wanted) == 1
    assert await store.outbox.enqueue(wanted, cursor=scan.last) == 1
    later = await drive(store, hooked("b"), Status.SUCCESS)
    assert await fill_outbox(store, clock()) == 1
    # When the stale scan is queued again
    again = await store.outbox.enqueue(wanted, cursor=scan.last)
    # Then nothing is added twice and the cursor stays past the later task's events
    assert again == 0
    assert len(await store.outbox.deliveries()) == 2
    assert (await store.outbox.scan(limit=100)).cursor == (await store.events(task_id=later.id))[
        -1
    ].seq


async def test_a_tasks_deliveries_are_due_one_at_a_time_in_seq_order(
    store: Store, clock: SettableClock
) -> None:
    # Given a task with two queued deliveries and another task with one
    first = await drive(
        store, hooked("a", {"url": "http://h.test/", "events": ["*"]}, kind="other"), Status.PENDING
    )
    await drive(store, hooked("b"), Status.SUCCESS)
    await fill_outbox(store, clock())
    rows = await store.outbox.deliveries()
    mine = [d for d in rows if d.task_id == first.id]
    other = [d for d in rows if d.task_id != first.id]
    assert len(mine) == 1 and len(other) == 1
    claimed = (await store.claim(worker_id="w", kinds=[first.kind], limit=1, lease_ttl_s=30))[0]
    assert claimed.id == first.id
    await fill_outbox(store, clock())
    mine = await store.outbox.deliveries(task_id=first.id)
    assert [d.event for d in mine] == ["submit", "claim"]
    # When the due deliveries are read
    due = await store.outbox.due(limit=10)
    # Then only the first of each task is due
    assert {d.event_id for d in due} == {mine[0].event_id, other[0].event_id}
    # When the first one fails and waits for a retry
    await store.outbox.record(
        WebhookAttempt(
            mine[0].event_id, PENDING, "retrying", next_attempt_at=clock() + 60, error="500"
        )
    )
    # Then the task's next one still waits behind it
    assert {d.event_id for d in await store.outbox.due(limit=10)} == {other[0].event_id}
    # When its retry time comes and it is delivered
    clock.advance(61)
    assert [d.event_id for d in await store.outbox.due(limit=10) if d.task_id == first.id] == [
        mine[0].event_id
    ]
    await store.outbox.record(
        WebhookAttempt(mine[0].event_id, DELIVERED, "delivered", response_status=200)
    )
    # Then the next one of that task is due
    due_now = [d for d in await store.outbox.due(limit=10) if d.task_id == first.id]
    assert [d.event_id for d in due_now] == [mine[1].event_id]


async def test_recording_counts_each_outcome_and_leaves_a_settled_delivery_alone(
    store: Store, clock: SettableClock
) -> None:
    # Given a queued delivery
    await drive(store, hooked("a"), Status.SUCCESS)
    await fill_outbox(store, clock())
    [queued] = await store.outbox.deliveries()
    assert await store.outbox.pending() == 1
    # When one attempt fails, the next is delivered, and a late answer says failed
    await store.outbox.record(
        WebhookAttempt(
            queued.event_id, PENDING, "retrying", next_attempt_at=clock() + 5, error="timeout"
        )
    )
    await store.outbox.record(
        WebhookAttempt(queued.event_id, DELIVERED, "delivered", response_status=204)
    )
    await store.outbox.record(WebhookAttempt(queued.event_id, FAILED, "failed", error="late"))
    # Then the delivery stays delivered after two attempts, and nothing is pending
    [row] = await store.outbox.deliveries()
    assert (row.status, row.attempts, row.response_status) == (DELIVERED, 2, 204)
    assert row.last_error is None
    assert await store.outbox.pending() == 0
    assert await store.outbox.due(limit=10) == []
    # And every outcome was counted
    counters = await store.counters()
    assert [
        counters.get(("webhook_deliveries", o), 0) for o in ("retrying", "delivered", "failed")
    ] == [1, 1, 1]


async def test_a_settled_delivery_can_be_put_back_in_line_for_its_own_task_only(
    store: Store, clock: SettableClock
) -> None:
    # Given a delivery that failed for good after two attempts, and another task
    task = await drive(store, hooked("a"), Status.SUCCESS)
    other = await drive(store, hooked("b"), Status.SUCCESS)
    await fill_outbox(store, clock())
    [failed] = await store.outbox.deliveries(task_id=task.id)
    await store.outbox.record(
        WebhookAttempt(failed.event_id, PENDING, "retrying", next_attempt_at=clock() + 5)
    )
    await store.outbox.record(
        WebhookAttempt(failed.event_id, FAILED, "failed", error="410", response_status=410)
    )
    await store.outbox.record(
        WebhookAttempt(
            (await store.outbox.deliveries(task_id=other.id))[0].event_id, DELIVERED,
            "delivered", response_status=200,
        )
    )  # fmt: skip
    assert await store.outbox.due(limit=10) == []
    # When it is asked for under another task's id
    assert await store.outbox.redeliver(failed.event_id, task_id=other.id) is None
    # Then nothing changed
    assert await store.outbox.due(limit=10) == []
    # When it is asked for under its own task, later
    clock.advance(30)
    again = await store.outbox.redeliver(failed.event_id, task_id=task.id)
    # Then it is pending and due now, its attempts and last answer kept, the same event
    assert again is not None
    assert (again.event_id, again.status, again.attempts) == (failed.event_id, PENDING, 2)
    assert (again.response_status, again.last_error) == (410, "410")
    assert again.next_attempt_at == again.updated_at == clock()
    assert again.payload == failed.payload
    assert [d.event_id for d in await store.outbox.due(limit=10)] == [failed.event_id]
    assert await store.outbox.redeliver("tsk_none:1", task_id=task.id) is None


async def test_a_purge_takes_a_tasks_deliveries_along(
    store: Store, clock: SettableClock, truth: Truth
) -> None:
    # Given an old finished task with a delivery, and a recent one with another
    old = await drive(store, hooked("a"), Status.SUCCESS)
    clock.advance(100)
    recent = await drive(store, hooked("b"), Status.FAILED)
    await fill_outbox(store, clock())
    assert {d.task_id for d in await store.outbox.deliveries()} == {old.id, recent.id}
    # When retention purges what finished more than 50 s ago
    assert [t.id for t in await store.purge(finished_before=clock() - 50)] == [old.id]
    # Then the old task's deliveries went with it
    assert truth("SELECT task_id FROM webhook_deliveries") == [(recent.id,)]


async def test_a_delivery_of_a_task_purged_since_its_event_was_read_is_not_queued(
    store: Store, clock: SettableClock
) -> None:
    # Given a scan that read a task's final event, then a purge of that task
    done = await drive(store, hooked("a"), Status.SUCCESS)
    scan = await store.outbox.scan(limit=100)
    wanted = [delivery(e, t, clock()) for e, t in scan.events if wants(t.webhook, e)]
    clock.advance(10)
    assert [t.id for t in await store.purge(finished_before=clock())] == [done.id]
    # When the scan is queued
    added = await store.outbox.enqueue(wanted, cursor=scan.last)
    # Then nothing is queued for the task that is gone, and the cursor moved on
    assert added == 0 and await store.outbox.deliveries() == []
    assert (await store.outbox.scan(limit=100)).cursor == scan.last


@pytest.mark.postgres
async def test_on_postgres_the_cursor_never_passes_an_event_still_in_flight(
    postgres_server: PostgresServer,
) -> None:
    # Given a task's first event, a transaction holding the next seq open, and a later
    # task whose event committed before it
    store = await PostgresStore.open(postgres_server.new_database(), clock=time.time)
    every: JSON = {"url": "http://h.test/", "events": ["*"]}
    try:
        first = (await store.submit(hooked("a", every))).task
        with psycopg.connect(store.url, autocommit=True) as conn:
            conn.execute("BEGIN")
            conn.execute("UPDATE tasks SET updated_at = updated_at WHERE id = %s", (first.id,))
            conn.execute(
                "INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
                " attempt, epoch, error, at, dwell_s) VALUES (%s, %s, 'acme', 'claim',"
                " 'PENDING', 'WAITING_FOR_RESOURCE', false, 1, 1, NULL, 0, NULL)",
                (f"{first.id}:held", first.id),
            )
            later = (await store.submit(hooked("b", every))).task
            # When the outbox is filled while that transaction is open
            await fill_outbox(store, time.time())
            # Then only what comes before the gap is queued
            assert [d.task_id for d in await store.outbox.deliveries()] == [first.id]
            # When the transaction commits and the outbox is filled again
            conn.execute("COMMIT")
        await fill_outbox(store, time.time())
        # Then the held event and the later one are queued too, in seq order, once each
        rows = await store.outbox.deliveries()
        assert [(d.task_id, d.event) for d in rows] == [
            (first.id, "submit"),
            (first.id, "claim"),
            (later.id, "submit"),
        ]
    finally:
        await store.close()


async def test_while_no_task_has_a_webhook_a_scan_passes_the_log_unread_where_it_may(
    store: Store, clock: SettableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given tasks without a webhook, and every read of the log's events counted
    for prompt in ("a", "b", "c"):
        await drive(store, hooked(prompt, webhook=None), Status.SUCCESS)
    reads: list[int] = []
    log_after = store._log_after

    async def counted(after: int, limit: int, gaps: dict[int, int]) -> list[TaskEvent]:
        events = await log_after(after, limit, gaps)
        reads.append(len(events))
        return events

    monkeypatch.setattr(store, "_log_after", counted)
    # When the outbox is filled
    assert await fill_outbox(store, clock()) == 0
    # Then its cursor stands at the log's end; where events commit in seq order
    # (SQLite), with no event read (PostgreSQL reads past its gaps, as always)
    assert (sum(reads) == 0) is store.commits_in_seq_order
    assert (await store.outbox.scan(limit=100)).cursor == await store.last_seq()
    # And once a task has a webhook, its events are read and queued as before
    hooked_task = await drive(store, hooked("d"), Status.SUCCESS)
    assert await fill_outbox(store, clock()) == 1
    assert sum(reads) > 0
    assert [d.task_id for d in await store.outbox.deliveries()] == [hooked_task.id]


async def test_on_postgres_no_hooked_task_yet_never_passes_one_still_in_flight(
    postgres_server: PostgresServer,
) -> None:
    # Given no task with a webhook committed, and a transaction holding one (a task with a
    # webhook and its submit event) open while a later task without one commits
    store = await PostgresStore.open(postgres_server.new_database(), clock=time.time)
    try:
        plain = (await store.submit(hooked("a", webhook=None))).task
        with psycopg.connect(store.url, autocommit=True) as conn:
            conn.execute("BEGIN")
            conn.execute(
                "CREATE TEMP TABLE held ON COMMIT DROP AS SELECT * FROM tasks WHERE id = %s",
                (plain.id,),
            )
            conn.execute(
                "UPDATE held SET id = %s, dedup_key = NULL, webhook = %s",
                ("tsk_held", '{"url": "http://h.test/", "events": ["*"]}'),
            )
            columns = ", ".join(
                row[0]
                for row in conn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name ="
                    " 'tasks' AND is_generated = 'NEVER' ORDER BY ordinal_position"
                )
            )
            conn.execute(f"INSERT INTO tasks ({columns}) SELECT {columns} FROM held")
            conn.execute(
                "INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final,"
                " attempt, epoch, error, at, dwell_s) VALUES ('tsk_held:1', 'tsk_held', 'acme',"
                " 'submit', NULL, 'PENDING', false, 0, 0, NULL, 0, NULL)"
            )
            await store.submit(hooked("b", webhook=None))
            # When the outbox is filled while that transaction is open
            await fill_outbox(store, time.time())
            # Then its cursor stands before the held event
            (held_seq,) = conn.execute("SELECT seq FROM events WHERE id = 'tsk_held:1'").fetchone()
            assert (await store.outbox.scan(limit=100)).cursor < held_seq
            conn.execute("COMMIT")
        # And once it commits, its event is queued
        await fill_outbox(store, time.time())
        assert [(d.task_id, d.event) for d in await store.outbox.deliveries()] == [
            ("tsk_held", "submit")
        ]
    finally:
        await store.close()
