"""The worker registry on every backend: a worker's row, fresh while it beats, gone after."""

from __future__ import annotations

from collections.abc import Callable

from kiln.models import iso
from kiln.store import Store, WorkerRecord
from kiln.store.workers import FORGET_AFTER_S

from .backends import Row
from .factories import SettableClock

Truth = Callable[..., list[Row]]


def record(worker_id: str = "host-a:101:w1", **changes: object) -> WorkerRecord:
    fields: dict[str, object] = {
        "id": worker_id, "host": worker_id.split(":")[0], "pid": 101, "version": "1.2.3",
        "kinds": ("image.generate", "image.transform"), "slots": 4,
        "resources": {"image.generate": {"gpu": 1}}, "models": ("sdxl",),
    }  # fmt: skip
    fields.update(changes)
    return WorkerRecord(**fields)  # type: ignore[arg-type]


async def test_a_worker_is_listed_with_what_it_said_while_its_beat_holds(
    store: Store, clock: SettableClock
) -> None:
    # Given a worker that registered, then beat again with two attempts and a new model
    first = await store.workers.seen(record(), ttl_s=30)
    started = clock()
    clock.advance(10)
    await store.workers.seen(record(running=2, models=("sdxl", "flux")), ttl_s=30)
    # Then it is listed with what it said last, and when it started
    (listed,) = await store.workers.live()
    assert listed.id == "host-a:101:w1" and (listed.host, listed.pid) == ("host-a", 101)
    assert listed.kinds == ("image.generate", "image.transform") and listed.slots == 4
    assert (listed.running, listed.models) == (2, ("sdxl", "flux"))
    assert listed.resources == {"image.generate": {"gpu": 1}}
    assert (listed.started_at, listed.seen_at, listed.expires_at) == (
        first.started_at, started + 10, started + 40,
    )  # fmt: skip
    assert listed.to_json()["last_seen_at"] == iso(started + 10)


async def test_a_worker_whose_beat_lapsed_disappears_and_its_row_goes_later(
    store: Store, clock: SettableClock, truth: Truth
) -> None:
    # Given two workers, one of which stops beating
    await store.workers.seen(record("host-a:1:w"), ttl_s=30)
    await store.workers.seen(record("host-b:2:w"), ttl_s=30)
    clock.advance(20)
    await store.workers.seen(record("host-b:2:w"), ttl_s=30)
    # When its beat has lapsed
    clock.advance(15)
    # Then only the other is listed, though its row is still there
    assert [w.id for w in await store.workers.live()] == ["host-b:2:w"]
    assert len(truth("SELECT id FROM workers")) == 2
    # And once it has been gone for a while, the next beat of anyone deletes its row
    clock.advance(FORGET_AFTER_S)
    await store.workers.seen(record("host-b:2:w"), ttl_s=30)
    assert [r[0] for r in truth("SELECT id FROM workers")] == ["host-b:2:w"]


async def test_a_worker_that_stops_cleanly_is_gone_at_once(store: Store) -> None:
    await store.workers.seen(record("host-a:1:w"), ttl_s=30)
    await store.workers.seen(record("host-a:2:w"), ttl_s=30)
    await store.workers.gone("host-a:1:w")
    assert [w.id for w in await store.workers.live()] == ["host-a:2:w"]
    await store.workers.gone("host-a:1:w")  # twice is harmless
