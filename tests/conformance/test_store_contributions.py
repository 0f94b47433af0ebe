"""A feature hooks every status change by registering a contribution, on every backend:
its effect runs in the change's transaction (and commits or rolls back with it), its
``committed`` runs after the commit, and ``Engine.apply`` takes nothing new for it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest

import kiln
from kiln.contributions import Contribution, Draft, Host
from kiln.engine import Engine
from kiln.errors import LeaseLost
from kiln.models import Task, TaskEvent
from kiln.states import Event, Status
from kiln.store import Store
from kiln.store.records import WORKER, Applied, Effect
from kiln.store.tx import Ops, Tx

from .factories import KIND, make_new_task

MARKS = "test_marks"


@dataclass(frozen=True, slots=True)
class Mark:
    """The fact a caller passes: the label to count the change under."""

    label: str


@dataclass(frozen=True, slots=True)
class Marked(Effect):
    """Counts the change, in its transaction, under its label and the status it ends in."""

    label: str

    async def after(self, ops: Ops, tx: Tx, applied: Applied) -> None:
        tx.bump(MARKS, f"{self.label}:{applied.change.target}:{applied.task.epoch}")


class Marking(Contribution):
    """Adds :class:`Marked` to the changes whose caller passed a :class:`Mark`, and keeps
    what it saw committed."""

    acts_after = True

    def __init__(self) -> None:
        self.committed_events: list[tuple[str, list[str]]] = []

    def effects(self, draft: Draft) -> Iterable[Effect]:
        mark = draft.fact(Mark)
        return () if mark is None else (Marked(mark.label),)

    async def committed(
        self, host: Host, draft: Draft, task: Task, events: list[TaskEvent]
    ) -> None:
        if draft.fact(Mark) is not None:
            self.committed_events.append((task.id, [str(e.event) for e in events]))


@pytest.fixture
def marking(engine: kiln.App) -> Marking:
    added = Marking()
    engine.engine.contributions = (*engine.engine.contributions, added)
    return added


async def marks(store: Store) -> dict[str, int]:
    return {labels: n for (name, labels), n in (await store.counters()).items() if name == MARKS}


async def test_a_registered_contribution_adds_its_effect_to_the_changes_transaction(
    store: Store, engine: kiln.App, marking: Marking
) -> None:
    # Given a claimed task and a feature registered as a contribution
    core: Engine = engine.engine
    await store.submit(make_new_task())
    (task,) = await core.claim(worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=30)
    # When a worker's plain step (PostgreSQL's one-statement kind) carries the feature's fact
    moved = await core.apply(task, Event.ACQUIRE, fence=WORKER, facts=[Mark("seen")])
    # Then its effect ran in the change's transaction, and its after-commit hook ran once
    assert moved.status is Status.GENERATING
    assert await marks(store) == {f"seen:GENERATING:{task.epoch}": 1}
    assert marking.committed_events == [(task.id, ["acquire"])]
    # And a change without the fact is left alone by it
    await core.apply(moved, Event.GENERATED, fence=WORKER)
    assert await marks(store) == {f"seen:GENERATING:{task.epoch}": 1}


async def test_a_refused_change_writes_none_of_its_effects(
    store: Store, engine: kiln.App, marking: Marking
) -> None:
    # Given a task another write has moved on
    core: Engine = engine.engine
    await store.submit(make_new_task())
    (task,) = await core.claim(worker_id="w", kinds=[KIND], limit=1, lease_ttl_s=30)
    await core.apply(task, Event.ACQUIRE, fence=WORKER)
    # When a stale worker write carries the fact
    with pytest.raises(LeaseLost):
        await core.apply(task, Event.ACQUIRE, fence=WORKER, facts=[Mark("stale")])
    # Then neither its effect nor its after-commit hook ran
    assert await marks(store) == {}
    assert marking.committed_events == []
