"""Warm-model routing on every backend: a claim prefers the tasks whose model its worker
holds, leaves to an idle peer the tasks of the models it holds for at most the affinity
wait, and lets no task starve behind a flood of another model's work (store/claims.py)."""

from __future__ import annotations

from dataclasses import replace

from kiln.models import Task
from kiln.store import Store
from kiln.store.claims import ClaimPolicy, Route

from .factories import KIND, SettableClock, make_new_task

WAIT_S = 5.0


async def submit(store: Store, model: str | None, tag: str, *, priority: int = 0) -> Task:
    new = replace(make_new_task({"n": tag}, priority=priority), model=model)
    return (await store.submit(new)).task


async def claim(
    store: Store, limit: int, route: Route | None, policy: ClaimPolicy | None = None
) -> list[str]:
    tasks = await store.claim(
        worker_id="w-1", kinds=[KIND], limit=limit, lease_ttl_s=30, route=route, policy=policy
    )
    return [t.id for t in tasks]


def holding(*models: str, reserved: tuple[str, ...] = ()) -> Route:
    return Route(frozenset(models), frozenset(reserved), WAIT_S)


async def test_a_claim_takes_the_models_it_holds_first_within_the_affinity_wait(
    store: Store, clock: SettableClock
) -> None:
    # Given a cold task, then a warm one (of the model the worker holds) 3 s later, then
    # another warm one 9 s after the cold one
    cold = await submit(store, "b", "cold")
    clock.advance(3)
    warm = await submit(store, "a", "warm")
    clock.advance(6)
    late = await submit(store, "a", "late")
    # When a worker holding model a claims one at a time, even long after
    clock.advance(60)
    order = [*await claim(store, 1, holding("a")), *await claim(store, 1, holding("a"))]
    order += await claim(store, 1, holding("a"))
    # Then the warm task went ahead of the cold one (3 s < the 5 s wait); the late one,
    # ready 9 s after it, did not: the order does not move with time
    assert order == [warm.id, cold.id, late.id]
    # And the task carries its model
    assert (await store.get(warm.id)).model == "a"  # type: ignore[union-attr]


async def test_a_warm_task_deep_in_the_queue_is_found(store: Store, clock: SettableClock) -> None:
    # Given 30 tasks of model b, then one of model a a second later
    for i in range(30):
        await submit(store, "b", f"b{i}")
    clock.advance(1)
    warm = await submit(store, "a", "warm")
    # When a worker holding a claims 2: the warm one first, then the queue's head
    found = await claim(store, 2, holding("a"))
    assert found[0] == warm.id and len(found) == 2


async def test_tasks_an_idle_peer_holds_the_model_of_wait_for_it_at_most_the_wait(
    store: Store, clock: SettableClock
) -> None:
    # Given a task of model a, which an idle peer holds, and one needing no model
    peers = await submit(store, "a", "peers")
    free = await submit(store, None, "free")
    # When a worker holding nothing claims: the peer's task is left to it
    route = holding(reserved=("a",))
    assert await claim(store, 5, route) == [free.id]
    assert await claim(store, 5, route) == []
    # After the affinity wait any worker takes it
    clock.advance(WAIT_S + 0.1)
    assert await claim(store, 5, route) == [peers.id]


async def test_a_model_nobody_holds_is_taken_at_once(store: Store, clock: SettableClock) -> None:
    task = await submit(store, "c", "c")
    assert await claim(store, 1, holding("a", reserved=("b",))) == [task.id]


async def test_no_task_starves_behind_a_flood_of_the_model_a_worker_holds(
    store: Store, clock: SettableClock
) -> None:
    # Given a task of model b, then a flood of model a, five tasks a second: more than
    # the worker holding a takes (two a claim, one claim a second)
    lone = await submit(store, "b", "lone")
    flood: dict[str, float] = {}
    taken: list[str] = []
    for second in range(40):
        clock.advance(1)
        for i in range(5):
            flood[(await submit(store, "a", f"a{second}.{i}")).id] = second + 1.0
        taken += await claim(store, 2, holding("a", reserved=("b",)))
        if lone.id in taken:
            break
    # Then the lone task was taken, passed only by warm tasks that came within the
    # affinity wait after it, never by a later one
    assert lone.id in taken
    before = taken[: taken.index(lone.id)]
    assert before and all(flood[t] < WAIT_S for t in before)
    assert len(before) == sum(1 for t, at in flood.items() if at < WAIT_S)


async def test_routing_keeps_priority_first(store: Store, clock: SettableClock) -> None:
    urgent = await submit(store, "b", "urgent", priority=5)
    clock.advance(1)
    warm = await submit(store, "a", "warm")
    assert await claim(store, 2, holding("a")) == [urgent.id, warm.id]


async def test_routing_under_a_claim_policy(store: Store, clock: SettableClock) -> None:
    # Under fair turns, a claim still prefers warm tasks among the lines' heads and
    # leaves a peer's model to the peer within the wait
    cold = await submit(store, "b", "cold")
    clock.advance(1)
    warm = await submit(store, "a", "warm")
    fair = ClaimPolicy(fair=True)
    assert await claim(store, 1, holding("a", reserved=("b",)), fair) == [warm.id]
    assert await claim(store, 1, holding("a", reserved=("b",)), fair) == []
    clock.advance(WAIT_S)
    assert await claim(store, 1, holding("a", reserved=("b",)), fair) == [cold.id]


async def test_without_routing_the_order_is_unchanged(store: Store, clock: SettableClock) -> None:
    first = await submit(store, "b", "first")
    clock.advance(1)
    second = await submit(store, "a", "second")
    off = Route(frozenset({"a"}), frozenset(), 0.0)
    assert await claim(store, 2, off) == [first.id, second.id]
