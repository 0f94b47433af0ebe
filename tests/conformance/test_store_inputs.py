"""What retention may delete: uploaded inputs no task refers to and nobody holds, and
idempotency keys past their own TTL (kiln/store/inputs.py), on every backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kiln.models import JSON, NewTask
from kiln.states import Event
from kiln.store import Store
from kiln.store.inputs import STALE_S

from .backends import Row
from .factories import SettableClock, make_new_task, step_change

Truth = Callable[..., list[Row]]
A, B = "a" * 64, "b" * 64


def with_inputs(*sha256s: str) -> NewTask:
    items: list[JSON] = [
        {"name": f"image{i}", "content_type": "image/png", "size": 3, "sha256": s}
        for i, s in enumerate(sha256s)
    ]
    return replace(make_new_task({"prompt": f"with {len(sha256s)}"}), inputs=items)


async def test_a_new_input_is_pinned_and_must_be_written(store: Store) -> None:
    first = await store.inputs.pin([A])
    again = await store.inputs.pin([A])
    assert first.write == {A} and not first.busy
    assert not again.write and not again.busy  # known and held: its object is there


async def test_an_input_a_task_refers_to_is_never_claimed_for_deletion(
    store: Store, clock: SettableClock
) -> None:
    # Given an input pinned by an upload whose task went in, then unpinned
    await store.inputs.pin([A, B])
    task = (await store.submit(with_inputs(A))).task
    await store.inputs.unpin([A, B])
    clock.advance(100)
    # When retention looks for inputs unused since before now
    deletion = await store.inputs.claim_unused(used_before=clock.now)
    # Then only the input no task refers to is claimed
    assert deletion.sha256s == (B,)
    # And once the task is purged, its input may go too
    await store.apply(step_change(task, Event.CANCEL, fenced=False))
    clock.advance(100)
    assert [t.id for t in await store.purge(finished_before=clock.now)] == [task.id]
    clock.advance(STALE_S + 1)  # the mark on B is abandoned by now, so B comes back too
    assert set((await store.inputs.claim_unused(used_before=clock.now)).sha256s) == {A, B}


async def test_a_pinned_input_is_not_claimed_and_an_unused_recent_one_waits(
    store: Store, clock: SettableClock
) -> None:
    await store.inputs.pin([A])  # an upload holds it
    await store.inputs.pin([B])
    await store.inputs.unpin([B])
    clock.advance(10)
    assert (await store.inputs.claim_unused(used_before=clock.now - 60)).sha256s == ()
    assert (await store.inputs.claim_unused(used_before=clock.now)).sha256s == (B,)


async def test_an_upload_waits_for_a_deletion_under_way_then_writes_again(
    store: Store, clock: SettableClock, truth: Truth
) -> None:
    # Given an unused input marked for deletion
    await store.inputs.pin([A])
    await store.inputs.unpin([A])
    clock.advance(10)
    deletion = await store.inputs.claim_unused(used_before=clock.now)
    assert deletion.sha256s == (A,)
    # When an upload of the same content pins it, it is told to wait, and holds nothing
    busy = await store.inputs.pin([A])
    assert busy.busy == {A} and not busy.write
    # Then once the object is deleted and the input forgotten, the upload writes it anew
    await store.inputs.forget(deletion, [A])
    assert truth("SELECT sha256 FROM inputs") == []
    assert (await store.inputs.pin([A])).write == {A}


async def test_an_abandoned_deletion_is_taken_over_by_an_upload(
    store: Store, clock: SettableClock
) -> None:
    await store.inputs.pin([A])
    await store.inputs.unpin([A])
    clock.advance(10)
    deletion = await store.inputs.claim_unused(used_before=clock.now)
    clock.advance(STALE_S + 1)  # the deleter died
    pins = await store.inputs.pin([A])
    assert pins.write == {A} and not pins.busy
    # And the dead deleter's late "forget" no longer matches: the input stays known
    await store.inputs.forget(deletion, [A])
    assert await store.inputs.known([A, B]) == {A}


async def test_a_refused_uploads_own_inputs_can_be_claimed_at_once(
    store: Store, truth: Truth
) -> None:
    await store.inputs.pin([A, B])
    await store.inputs.unpin([A, B])
    deletion = await store.inputs.claim_unused(used_before=0.0, among=[A])
    assert deletion.sha256s == (A,)
    assert sorted(r[0] for r in truth("SELECT sha256 FROM inputs WHERE deleting_at IS NULL")) == [B]


async def test_idempotency_keys_expire_on_their_own_and_the_key_makes_a_new_task(
    store: Store, clock: SettableClock
) -> None:
    # Given a task made with a key an hour ago, and one made with another key just now
    old = (await store.submit(make_new_task({"n": 1}, idempotency_key="old"))).task
    clock.advance(3600)
    await store.submit(make_new_task({"n": 2}, idempotency_key="new"))
    # When keys older than half an hour expire
    assert await store.keys.expire(created_before=clock.now - 1800) == 1
    # Then the old key no longer answers with its task (the task itself stays)
    again = await store.submit(make_new_task({"n": 1}, idempotency_key="old", dedup=False))
    assert again.created and again.task.id != old.id
    assert await store.get(old.id) is not None
    replay = await store.submit(make_new_task({"n": 2}, idempotency_key="new"))
    assert replay.replayed
