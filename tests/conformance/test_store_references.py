"""Content a tenant has, by sha256 (``Store.find_object``): an upload of one of its tasks
(``task_inputs``), or an output of one of its SUCCESS tasks (``task_outputs``, written by
the database when the task becomes SUCCESS, on every path, and deleted with the task); on
every backend."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from kiln.models import JSON, NewTask, Task
from kiln.states import Event, Status
from kiln.store import Store

from .factories import SettableClock, claim_one, make_new_task, step_change

A, B, C = "a" * 64, "b" * 64, "c" * 64


def with_input(sha256: str, tenant: str, prompt: str = "with input") -> NewTask:
    item: JSON = {"name": "image", "content_type": "image/png", "size": 3, "sha256": sha256,
                  "width": 2, "height": 1}  # fmt: skip
    return replace(make_new_task({"prompt": prompt}, tenant=tenant), inputs=[item])


def outputs_of(task_id: str, *sha256s: str) -> JSON:
    return {
        "outputs": [
            {"name": f"out{i}.png", "key": f"tasks/{task_id}/out{i}.png",
             "content_type": "image/png", "size": 10 + i, "sha256": s}
            for i, s in enumerate(sha256s)
        ]
    }  # fmt: skip


async def uploading(store: Store, prompt: str, tenant: str = "acme") -> Task:
    new = make_new_task({"prompt": prompt}, tenant=tenant)
    await store.submit(new)
    task = await claim_one(store)
    assert task.id == new.id
    for event in (Event.ACQUIRE, Event.GENERATED):
        task = (await store.apply(step_change(task, event)))[0]
    return task


async def succeed(store: Store, task: Task, *sha256s: str, to: Status = Status.SUCCESS) -> Task:
    change = step_change(
        task, (Event.UPLOADED, to), fields={"result": outputs_of(task.id, *sha256s)}
    )
    return (await store.apply(change))[0]


async def test_an_upload_is_found_for_its_tenant_only(store: Store) -> None:
    task = (await store.submit(with_input(A, "acme"))).task

    found = await store.inputs.find_object("acme", A)

    assert found is not None and found.output is None
    assert found.record == task.inputs[0]
    assert await store.inputs.find_object("globex", A) is None
    assert await store.inputs.find_object("acme", B) is None


async def test_an_input_kept_elsewhere_by_key_is_not_an_upload(store: Store) -> None:
    keyed = {"name": "image", "content_type": "image/png", "size": 3, "sha256": A,
             "key": "tasks/tsk_other/image.png"}  # fmt: skip
    await store.submit(replace(make_new_task({"prompt": "keyed"}), inputs=[keyed]))

    assert await store.inputs.find_object("acme", A) is None


async def test_the_outputs_of_a_success_are_found_for_its_tenant_only(store: Store) -> None:
    task = await succeed(store, await uploading(store, "made"), A, B)

    found = await store.inputs.find_object("acme", B)

    assert found is not None and found.record is None
    assert found.output == {"task_id": task.id, "name": "out1.png",
                            "key": f"tasks/{task.id}/out1.png", "content_type": "image/png",
                            "size": 11}  # fmt: skip
    assert await store.inputs.find_object("globex", B) is None
    assert await store.inputs.find_object("acme", C) is None


async def test_an_output_in_review_is_found_once_approved(store: Store) -> None:
    task = await succeed(store, await uploading(store, "flagged"), A, to=Status.NEEDS_REVIEW)
    assert await store.inputs.find_object("acme", A) is None
    await store.apply(step_change(task, Event.APPROVE, fenced=False))

    found = await store.inputs.find_object("acme", A)

    assert found is not None and found.output is not None
    assert found.output["task_id"] == task.id


async def test_outputs_of_steps_committed_together_are_all_found(store: Store) -> None:
    # Workers' upload steps arriving together (PostgreSQL writes them as one statement)
    tasks = [await uploading(store, f"together {i}") for i in range(3)]

    await asyncio.gather(*(succeed(store, t, s) for t, s in zip(tasks, (A, B, C), strict=True)))

    for task, sha256 in zip(tasks, (A, B, C), strict=True):
        found = await store.inputs.find_object("acme", sha256)
        assert found is not None and found.output is not None
        assert found.output["task_id"] == task.id


async def test_a_purged_task_takes_its_outputs_and_uploads_with_it(
    store: Store, clock: SettableClock
) -> None:
    task = await succeed(store, await uploading(store, "purged"), A)
    await store.submit(with_input(B, "acme"))
    cancelled = (await store.submit(with_input(C, "acme", "cancelled"))).task
    await store.apply(step_change(cancelled, Event.CANCEL, fenced=False))
    clock.advance(100)

    purged = await store.purge(finished_before=clock.now)

    assert {t.id for t in purged} == {task.id, cancelled.id}
    assert await store.inputs.find_object("acme", A) is None
    assert await store.inputs.find_object("acme", C) is None
    assert await store.inputs.find_object("acme", B) is not None
