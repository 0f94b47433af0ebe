"""A retry planned on a read from before a cancel was asked is refused (StaleDecision) and
nothing changes; planned again on the row as it is, the attempt ends without one. On
every backend."""

from __future__ import annotations

import pytest

from kiln.errors import StaleDecision
from kiln.states import Event, Status
from kiln.store import Store

from .factories import claim_one, make_new_task, step_change

ERROR = {"code": "upstream_unavailable", "message": "try later", "retryable": True}


async def test_a_retry_planned_before_a_cancel_was_asked_is_refused(store: Store) -> None:
    # Given a running task, read by its worker (or the supervisor) before a cancel is asked
    await store.submit(make_new_task({"prompt": "raced"}))
    read = await claim_one(store)
    await store.request_cancel(read.id)
    before = await store.events(task_id=read.id)
    # When a failure with a retry planned on that read is applied
    stale = step_change(read, Event.FAIL, Event.SCHEDULE_RETRY, fields={"error": ERROR},
                        error=ERROR)  # fmt: skip
    with pytest.raises(StaleDecision):
        await store.apply(stale)
    # Then nothing changed: the same status, epoch and events, the cancel still asked
    now = await store.get(read.id)
    assert now is not None
    assert (now.status, now.epoch, now.cancel_requested) == (read.status, read.epoch, True)
    assert await store.events(task_id=read.id) == before
    # And the failure planned on the row as it is (no retry for a task asked to cancel)
    # applies: the attempt ends FAILED for good
    done, events = await store.apply(
        step_change(now, Event.FAIL, fields={"error": ERROR}, error=ERROR)
    )
    assert done.status is Status.FAILED and [e.event for e in events] == [Event.FAIL]


async def test_a_retry_with_no_cancel_asked_applies(store: Store) -> None:
    await store.submit(make_new_task({"prompt": "plain retry"}))
    read = await claim_one(store)
    change = step_change(read, Event.FAIL, Event.SCHEDULE_RETRY, fields={"error": ERROR},
                         error=ERROR)  # fmt: skip
    done, events = await store.apply(change)
    assert done.status is Status.RETRYING
    assert [e.event for e in events] == [Event.FAIL, Event.SCHEDULE_RETRY]
