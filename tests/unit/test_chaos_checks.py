"""The chaos run's invariant checker catches what it claims to: each check passes on a
healthy store and fails on a store or snapshot doctored to break its invariant."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kiln
from kiln import inputs, transform
from kiln.app import running
from kiln.states import Event, Status

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the chaos modules import each other
    return importlib.import_module("chaos_checks")


def params(prompt: str, **simulate: Any) -> dict[str, Any]:
    return {"prompt": prompt, "width": 64, "height": 64, "steps": 3,
            "simulate": {"step_ms": 1, **simulate}}  # fmt: skip


async def run_to_final(app: kiln.App, task_ids: list[str], timeout_s: float = 20.0) -> None:
    """Run a worker until every task is final (polled, with a deadline)."""
    worker = app.worker(concurrency=2, resources={"gpu": 2}, idle_poll_s=(0.01, 0.05))
    deadline = time.monotonic() + timeout_s
    async with running(worker.run()):
        while not all([(await app.get(task_id)).final for task_id in task_ids]):
            assert time.monotonic() < deadline, "the tasks did not finish"
            await asyncio.sleep(0.02)


@pytest.fixture
async def finished(app: kiln.App, checks: ModuleType) -> tuple[kiln.App, Any]:
    """Three tasks run to their end: two SUCCESS (one after a retry), one FAILED for good."""
    made = [
        (await app.submit("image.generate", params("a fox"))).task.id,
        (await app.submit("image.generate", params("a heron", fail_attempts=1))).task.id,
        (await app.submit("image.generate", params("an owl", permanent=True))).task.id,
    ]
    await run_to_final(app, made)
    expected = checks.Expected(created=set(made), permanent={made[2]})
    return app, expected


def failed(found: list[Any]) -> set[str]:
    return {check.key for check in found if not check.ok}


def success_of(snap: Any) -> kiln.Task:
    return next(t for t in snap.tasks.values() if t.status is Status.SUCCESS)


async def test_a_healthy_store_passes_every_check(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    app, expected = finished
    found = await checks.check_all(app, expected, integrity="ok")
    assert failed(found) == set()
    assert {c.key for c in found} == {
        "I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "EO", "RC", "IT", "PL1", "PL2", "PL3",
        "RF",
    }  # fmt: skip
    assert all(c.checked > 0 for c in found if c.key not in ("I8", "PL1", "PL2", "PL3", "RF"))


async def test_an_output_deleted_behind_the_store_fails_i4_and_reconciliation(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    # Given a SUCCESS task whose output object is gone from storage
    app, expected = finished
    task = success_of(await checks.load(app.engine.store))
    await app.storage.delete(task.result["outputs"][0]["key"])

    # When every check runs, Then I4 and the reconciliation report it
    found = await checks.check_all(app, expected)
    assert failed(found) == {"I4", "RC"}


async def test_a_log_missing_an_event_does_not_replay(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    # Given a snapshot whose SUCCESS task lost its `generated` event
    app, _ = finished
    snap = await checks.load(app.engine.store)
    task = success_of(snap)
    snap.events[task.id] = [e for e in snap.events[task.id] if e.event is not Event.GENERATED]

    # Then I6 fails on it
    assert not checks.check_log_replays(snap).ok
    assert checks.check_bounded_attempts(snap).ok


async def test_a_worker_write_from_an_older_epoch_breaks_fencing(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    # Given a log where the `uploaded` write carries the epoch before its claim's
    app, _ = finished
    snap = await checks.load(app.engine.store)
    assert checks.check_fencing(snap).ok
    task = success_of(snap)
    snap.events[task.id] = [
        dataclasses.replace(e, epoch=e.epoch - 1) if e.event is Event.UPLOADED else e
        for e in snap.events[task.id]
    ]

    # Then I3 fails
    assert not checks.check_fencing(snap).ok


async def test_a_second_success_event_is_a_duplicate_success(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    app, expected = finished
    snap = await checks.load(app.engine.store)
    task = success_of(snap)
    last = snap.events[task.id][-1]
    snap.events[task.id].append(dataclasses.replace(last, seq=last.seq + 10_000, id="x"))

    assert not checks.check_exactly_once(snap, expected).ok
    assert not checks.check_one_final_state(snap, expected).ok


async def test_a_task_left_running_or_missing_fails_i1_and_i2(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    app, expected = finished
    snap = await checks.load(app.engine.store)
    task = success_of(snap)
    snap.tasks[task.id] = dataclasses.replace(
        task, status=Status.GENERATING, lease_owner="w", lease_expires_at=1.0
    )
    assert not checks.check_one_final_state(snap, expected).ok
    assert not checks.check_no_ghost(snap).ok

    # And a task the run created that the store no longer has fails I1
    snap = await checks.load(app.engine.store)
    expected.created.add("tsk_gone")
    assert not checks.check_one_final_state(snap, expected).ok


async def test_attempts_uniqueness_and_counters_are_checked(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    app, expected = finished
    snap = await checks.load(app.engine.store)
    first, second = [t for t in snap.tasks.values() if t.status is Status.SUCCESS]

    # An attempt past max_attempts fails I7
    snap.tasks[first.id] = dataclasses.replace(first, max_attempts=first.attempt - 1)
    assert not checks.check_bounded_attempts(snap).ok

    # Two successful tasks of one tenant on one dedup key fail I5, as does a bad answer
    snap.tasks[second.id] = dataclasses.replace(second, dedup_key=first.dedup_key)
    assert not checks.check_uniqueness(snap, expected).ok
    snap = await checks.load(app.engine.store)
    assert checks.check_uniqueness(snap, expected).ok
    expected.submit_problems.append("a replay answered another task")
    assert not checks.check_uniqueness(snap, expected).ok

    # A counted illegal transition fails IT; a permanent task that succeeded fails EO
    snap.counters[("illegal_transitions", "PENDING>SUCCESS")] = 1
    assert not checks.check_illegal_transitions(snap).ok
    expected.permanent.add(first.id)
    assert not checks.check_exactly_once(snap, expected).ok


async def test_a_lost_task_left_active_or_a_damaged_database_fails_i8(
    finished: tuple[kiln.App, Any], checks: ModuleType
) -> None:
    app, _ = finished
    snap = await checks.load(app.engine.store)
    assert checks.check_crash_recovery(snap, "ok").ok
    assert not checks.check_crash_recovery(snap, "row 3 missing from index").ok
    task = success_of(snap)
    expiry = dataclasses.replace(
        snap.events[task.id][-1], event=Event.EXPIRE, error={"code": "lease_expired"}
    )
    snap.events[task.id].append(expiry)
    snap.tasks[task.id] = dataclasses.replace(task, status=Status.RETRYING)
    assert not checks.check_crash_recovery(snap, "ok").ok


def test_a_run_that_injected_nothing_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    chaos = importlib.import_module("chaos")
    figures: dict[str, Any] = {
        "worker_kills": 3, "storage_faults": 9, "cancelled_pending": 2, "cancelled_running": 1,
        "tasks_retried": 5, "permanent": 2, "supervisor_restarts": 1, "finished_in_time": True,
        "exited_by_themselves": [], "batched_calls": 4, "sqlite": True,
        "submit_process_kills": 2,
    }  # fmt: skip
    assert chaos.chaos_happened(figures).ok
    for quiet in ("worker_kills", "storage_faults", "tasks_retried", "batched_calls",
                  "submit_process_kills"):  # fmt: skip
        assert not chaos.chaos_happened({**figures, quiet: 0}).ok
    # PostgreSQL has no submit process to kill.
    assert chaos.chaos_happened({**figures, "sqlite": False, "submit_process_kills": 0}).ok
    assert not chaos.chaos_happened({**figures, "cancelled_pending": 0, "cancelled_running": 0}).ok
    assert not chaos.chaos_happened({**figures, "supervisor_restarts": 0}).ok


def chain(prompt: str) -> dict[str, Any]:
    return {"steps": [
        {"name": "generate", "kind": "image.generate", "params": {**params(prompt), "seed": 1}},
        {"name": "resize", "kind": "image.transform", "params": {"op": "resize", "width": 32,
         "height": 32}, "inputs": {"image": "step:generate/image.png"}},
    ]}  # fmt: skip


def fan_out(prompt: str) -> dict[str, Any]:
    return {"steps": [
        {"name": "generate", "kind": "image.generate", "repeat": 3,
         "params": {**params(prompt), "seed": 1}},
        {"name": "sheet", "kind": "image.contact_sheet", "params": {"tile": 16},
         "inputs": {"images": "step:generate/*"}},
    ]}  # fmt: skip


@pytest.fixture
async def pipelined(app: kiln.App, checks: ModuleType) -> tuple[kiln.App, Any, dict[str, str]]:
    """A chain and a fan-out run to SUCCESS, a third pipeline cancelled while PENDING then
    retried to SUCCESS, a fourth cancelled for good; then the chain's last output
    transformed by reference."""
    transform.register(app)
    made = {name: (await app.submit("pipeline", shape)).task.id for name, shape in (
        ("chain", chain("a kite")), ("fan", fan_out("a boat")),
        ("retried", chain("a bell")), ("cancelled", chain("a drum")),
    )}  # fmt: skip
    await app.cancel(made["retried"])
    await app.retry(made["retried"])
    await app.cancel(made["cancelled"])
    await run_to_final(app, list(made.values()))
    resized = (await app.pipeline_steps(await app.get(made["chain"])))["resize/0"]
    output = resized.result["outputs"][0] if resized.result else {}
    records, held = await inputs.refer(app.engine.store, app.storage, "default",
                                       {"image": output["sha256"]}, max_pixels=10**7)  # fmt: skip
    made["by_reference"] = (
        await app.submit("image.transform", {"op": "convert", "format": "webp"}, inputs=records)
    ).task.id
    await inputs.release(app.engine.store, app.storage, held)
    await run_to_final(app, [made["by_reference"]])
    expected = checks.Expected(
        created=set(made.values()), cancelled_pipelines={made["cancelled"]},
        by_reference={made["by_reference"]: output},
    )  # fmt: skip
    return app, expected, made


async def test_pipelines_that_kept_their_invariants_pass_every_check(
    pipelined: tuple[kiln.App, Any, dict[str, str]], checks: ModuleType
) -> None:
    app, expected, made = pipelined
    found = {c.key: c for c in await checks.check_all(app, expected, integrity="ok")}
    assert failed(found.values()) == set()
    # 4 pipelines; 2 + 4 + 2 + 1 step copies made; the steps' inputs: 1 + 3 + 1
    assert (found["PL1"].checked, found["PL2"].checked, found["PL3"].checked) == (4, 9, 5)
    assert found["RF"].checked == 1
    assert (await app.get(made["retried"])).status is Status.SUCCESS


async def test_a_pipeline_status_its_steps_disagree_with_fails_pl1(
    pipelined: tuple[kiln.App, Any, dict[str, str]], checks: ModuleType
) -> None:
    app, expected, made = pipelined
    snap = await checks.load(app.engine.store)
    assert checks.check_pipelines_final(snap, expected).ok
    # A SUCCESS pipeline with a step that failed
    step_id = checks.step_map(snap.tasks[made["chain"]])["resize/0"]
    snap.tasks[step_id] = dataclasses.replace(snap.tasks[step_id], status=Status.FAILED)
    assert not checks.check_pipelines_final(snap, expected).ok
    # A CANCELLED pipeline the run never cancelled
    snap = await checks.load(app.engine.store)
    expected.cancelled_pipelines.clear()
    assert not checks.check_pipelines_final(snap, expected).ok
    # A step that moved on after its pipeline's SUCCESS
    snap = await checks.load(app.engine.store)
    expected.cancelled_pipelines.add(made["cancelled"])
    step_id = checks.step_map(snap.tasks[made["fan"]])["sheet/0"]
    late = max(e.seq for log in snap.events.values() for e in log) + 1
    claim = dataclasses.replace(snap.events[step_id][1], seq=late, event=Event.CLAIM)
    snap.events[step_id].append(claim)
    found = checks.check_pipelines_final(snap, expected)
    assert [v for v in found.violations if "sheet/0" in v]


async def test_a_step_done_twice_or_a_success_not_by_its_steps_fails_pl2_and_eo(
    pipelined: tuple[kiln.App, Any, dict[str, str]], checks: ModuleType
) -> None:
    app, expected, made = pipelined
    snap = await checks.load(app.engine.store)
    step_id = checks.step_map(snap.tasks[made["chain"]])["generate/0"]
    # A second task for one step copy: PL2, and I1 (no pipeline's map names it)
    snap.tasks["tsk_twin"] = dataclasses.replace(snap.tasks[step_id], id="tsk_twin")
    assert not checks.check_one_task_per_step(snap).ok
    assert not checks.check_one_final_state(snap, expected).ok
    # A second upload of one step
    snap = await checks.load(app.engine.store)
    upload = next(e for e in snap.events[step_id] if e.event is Event.UPLOADED)
    snap.events[step_id].append(dataclasses.replace(upload, seq=upload.seq + 10_000, id="y"))
    assert not checks.check_one_task_per_step(snap).ok
    # A pipeline reaching SUCCESS by another event than steps_done
    snap = await checks.load(app.engine.store)
    pipeline_log = snap.events[made["chain"]]
    pipeline_log[-1] = dataclasses.replace(pipeline_log[-1], event=Event.UPLOADED)
    assert not checks.check_exactly_once(snap, expected).ok


async def test_a_step_reading_another_object_fails_pl3(
    pipelined: tuple[kiln.App, Any, dict[str, str]], checks: ModuleType
) -> None:
    app, _, made = pipelined
    snap = await checks.load(app.engine.store)
    step_id = checks.step_map(snap.tasks[made["fan"]])["sheet/0"]
    sheet = snap.tasks[step_id]
    # Its inputs in another order than its sources'
    swapped = [sheet.inputs[1], sheet.inputs[0], *sheet.inputs[2:]]
    snap.tasks[step_id] = dataclasses.replace(sheet, inputs=swapped)
    assert not (await checks.check_step_inputs(snap, app.storage)).ok
    # The object it reads gone from storage
    snap = await checks.load(app.engine.store)
    assert (await checks.check_step_inputs(snap, app.storage)).ok
    await app.storage.delete(sheet.inputs[0]["key"])
    assert not (await checks.check_step_inputs(snap, app.storage)).ok


async def test_an_input_by_reference_not_the_outputs_content_fails_rf(
    pipelined: tuple[kiln.App, Any, dict[str, str]], checks: ModuleType
) -> None:
    app, expected, made = pipelined
    snap = await checks.load(app.engine.store)
    task = snap.tasks[made["by_reference"]]
    # Its input record another size than the output it named
    snap.tasks[task.id] = dataclasses.replace(task, inputs=[{**task.inputs[0], "size": 1}])
    assert not (await checks.check_by_reference(snap, app.storage, expected)).ok
    # Its object under inputs/ gone
    snap = await checks.load(app.engine.store)
    assert (await checks.check_by_reference(snap, app.storage, expected)).ok
    await app.storage.delete(inputs.input_key(task.inputs[0]["sha256"]))
    assert not (await checks.check_by_reference(snap, app.storage, expected)).ok
