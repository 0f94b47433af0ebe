"""Reconciler: compare storage with the store, report, and repair only when asked.

Two kinds of problem: a SUCCESS task whose output is missing or no longer matches its
recorded size and sha256 (``missing``, ``corrupt``), and an object that nothing accounts
for (``orphan``): under ``tasks/``, one no SUCCESS task refers to (a stale attempt's
upload, a crashed upload, or a task that is gone); under ``inputs/``, an uploaded input
the store does not know and no task refers to (an upload that never became a task, or one
written before inputs were tracked). Objects of tasks still in flight or in review are in
use, never orphans; inputs the store knows are retention's (kiln/retention.py).

A pass streams: it pages through SUCCESS tasks to verify their outputs, then through
the storage listing, looking up the tasks of each page of objects in one query. Memory
follows the page size, not the number of tasks or objects. The report keeps exact
counts and at most ``examples`` items of each list.

Repair deletes orphans older than a grace period and applies the result-lost policy to
each task with a missing or corrupt output: ``fail`` moves it to FAILED ``result_lost``;
``rerun`` does that and schedules a new attempt, due now, in the same transaction
(``max_attempts`` grows by one). Both are fenced: they apply only while the task is still
SUCCESS at the epoch the pass read, and bump the epoch. What is left of the lost result
(its other outputs, its manifest) is then deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from kiln import inputs
from kiln.contributions import Counts, Retry, failure
from kiln.engine import Engine, SupportsEngine, engine_of, rerun_fields
from kiln.errors import Conflict, LeaseLost, NotFound
from kiln.models import JSON, StoredOutput, Task
from kiln.states import FINAL, Event, Status
from kiln.storage import MANIFEST, ObjectInfo, Storage, sha256_hex
from kiln.store import LeaderToken
from kiln.store.records import Fence

log = logging.getLogger("kiln.reconcile")

TASKS_PREFIX = "tasks/"
INPUTS_PREFIX = inputs.INPUTS_PREFIX
DEFAULT_GRACE_S = 3600.0
#: Items of each list a report keeps; its counts stay exact.
DEFAULT_EXAMPLES = 1000
#: Tasks per store page, and objects whose tasks are looked up in one query.
PAGE = 500
#: Outputs verified at once (each read whole to hash it).
VERIFY_CONCURRENCY = 8
RESULT_LOST = "result_lost"


class ResultLostPolicy(StrEnum):
    RERUN = "rerun"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Missing:
    """A SUCCESS task's output that is not in storage as recorded."""

    task_id: str
    key: str
    problem: str  # "missing" or "corrupt"


@dataclass(frozen=True, slots=True)
class Orphan:
    """An object no SUCCESS task refers to."""

    key: str
    size: int
    task_id: str | None
    task_status: str | None
    age_s: float | None


@dataclass(frozen=True, slots=True)
class Repaired:
    """What a repair did to a task whose result was lost."""

    task_id: str
    action: str  # "rerun" or "failed"


@dataclass(slots=True)
class Report:
    """One pass: exact counts, and at most ``examples`` items of each list."""

    repair: bool = False
    grace_s: float = DEFAULT_GRACE_S
    result_lost_policy: str = ResultLostPolicy.FAIL.value
    examples: int = DEFAULT_EXAMPLES
    tasks_checked: int = 0
    outputs_checked: int = 0
    objects_checked: int = 0
    missing_count: int = 0
    corrupt_count: int = 0
    #: SUCCESS tasks with at least one missing or corrupt output.
    lost_tasks: int = 0
    orphan_count: int = 0
    orphan_bytes: int = 0
    deleted_count: int = 0
    kept_count: int = 0
    rerun_count: int = 0
    failed_count: int = 0
    #: Lost tasks that moved on (or were purged) before their repair: left as they are.
    conflicts: int = 0
    missing: list[Missing] = field(default_factory=list)
    orphans: list[Orphan] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    repaired: list[Repaired] = field(default_factory=list)
    started_at: float = 0.0
    duration_s: float = 0.0

    @property
    def clean(self) -> bool:
        """Nothing wrong was found."""
        return self.lost_tasks == 0 and self.orphan_count == 0

    @property
    def resolved(self) -> bool:
        """Nothing wrong is left: clean, or every problem found was repaired."""
        repaired = self.rerun_count + self.failed_count
        return repaired == self.lost_tasks and self.deleted_count == self.orphan_count

    @property
    def truncated(self) -> bool:
        """Some list holds fewer items than its count."""
        return (
            len(self.missing) < self.missing_count + self.corrupt_count
            or len(self.orphans) < self.orphan_count
            or len(self.deleted) < self.deleted_count
            or len(self.kept) < self.kept_count
            or len(self.repaired) < self.rerun_count + self.failed_count
        )

    def note(self, items: list[Any], item: Any) -> None:
        if len(items) < self.examples:
            items.append(item)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body.update(clean=self.clean, resolved=self.resolved, truncated=self.truncated)
        return body


@dataclass(frozen=True, slots=True)
class Options:
    repair: bool = False
    grace_s: float = DEFAULT_GRACE_S
    result_lost: ResultLostPolicy = ResultLostPolicy.FAIL
    examples: int = DEFAULT_EXAMPLES
    page_size: int = PAGE


async def reconcile(
    owner: Engine | SupportsEngine,
    options: Options | None = None,
    *,
    leader: LeaderToken | None = None,
    clock: Callable[[], float] = time.time,
) -> Report:
    """One pass over every SUCCESS task's outputs and every object under ``tasks/``, on
    ``owner``'s engine (an Engine, or an App).

    ``leader``: the supervisor's token, so a repair of a lost result is refused once
    another supervisor leads (NotLeader ends the pass).
    """
    engine = engine_of(owner)
    options = options or Options()
    report = Report(
        repair=options.repair,
        grace_s=options.grace_s,
        result_lost_policy=options.result_lost.value,
        examples=options.examples,
        started_at=clock(),
    )
    started = time.perf_counter()
    await _check_successes(engine, report, options, leader)
    await _check_objects(engine, report, options, clock)
    report.duration_s = time.perf_counter() - started
    log.info(
        "reconciled",
        extra={
            "objects": report.objects_checked,
            "tasks": report.tasks_checked,
            "lost_tasks": report.lost_tasks,
            "orphans": report.orphan_count,
            "deleted": report.deleted_count,
            "rerun": report.rerun_count,
            "failed": report.failed_count,
            "duration_s": report.duration_s,
        },
    )
    return report


# SUCCESS tasks: is every output there as recorded?


async def _check_successes(
    engine: Engine, report: Report, options: Options, leader: LeaderToken | None
) -> None:
    slots = asyncio.Semaphore(VERIFY_CONCURRENCY)
    cursor: str | None = None
    while True:
        page, cursor = await engine.store.list_tasks(
            tenant=None, status=Status.SUCCESS, limit=options.page_size, cursor=cursor
        )
        found = await asyncio.gather(*(_check_task(engine.storage, task, slots) for task in page))
        for task, problems in zip(page, found, strict=True):
            report.tasks_checked += 1
            report.outputs_checked += len(_outputs(task))
            if problems:
                await _result_lost(engine, task, problems, report, options, leader)
        if cursor is None:
            return


async def _check_task(storage: Storage, task: Task, slots: asyncio.Semaphore) -> list[Missing]:
    problems = []
    for output in _outputs(task):
        async with slots:
            problem = await _check_output(storage, output)
        if problem is not None:
            problems.append(Missing(task.id, output.key, problem))
    return problems


async def _check_output(storage: Storage, output: StoredOutput) -> str | None:
    """None when the object is there with its recorded size and sha256."""
    info = await storage.stat(output.key)
    if info is None:
        return "missing"
    if info.size != output.size:
        return "corrupt"
    try:
        data = await storage.get(output.key)
    except FileNotFoundError:
        return "missing"
    return None if sha256_hex(data) == output.sha256 else "corrupt"


async def _result_lost(
    engine: Engine,
    task: Task,
    problems: list[Missing],
    report: Report,
    options: Options,
    leader: LeaderToken | None,
) -> None:
    report.lost_tasks += 1
    for problem in problems:
        if problem.problem == "missing":
            report.missing_count += 1
        else:
            report.corrupt_count += 1
        report.note(report.missing, problem)
    log.warning(
        "result_lost",
        extra={"task_id": task.id, "keys": [p.key for p in problems], "repair": options.repair},
    )
    if not options.repair:
        return
    try:
        await lose_result(engine, task, problems, options.result_lost, leader=leader)
    except (Conflict, LeaseLost, NotFound):
        report.conflicts += 1  # it moved on (or was purged) since it was read
        return
    rerun = options.result_lost is ResultLostPolicy.RERUN
    if rerun:
        report.rerun_count += 1
    else:
        report.failed_count += 1
    report.note(report.repaired, Repaired(task.id, "rerun" if rerun else "failed"))
    # What is left of the lost result is no one's any more (a rerun writes a new attempt's
    # location): delete it now, as a rejected review does, rather than leave orphans.
    for key in sorted(_referenced([task])):
        await engine.storage.delete(key)


async def lose_result(
    owner: Engine | SupportsEngine,
    task: Task,
    problems: list[Missing],
    policy: ResultLostPolicy,
    *,
    leader: LeaderToken | None = None,
) -> Task:
    """``lose`` a SUCCESS task's result at the epoch read: FAILED ``result_lost``, and
    under ``rerun`` straight on to RETRYING, due now, with one more attempt allowed."""
    engine = engine_of(owner)
    rerun = policy is ResultLostPolicy.RERUN
    what = ", ".join(f"{p.key} is {p.problem}" for p in problems[:3])
    error: JSON = {
        "code": RESULT_LOST,
        "message": f"the result was lost: {what}",
        "retryable": rerun,
    }
    fields: dict[str, Any] = {"result": None, "error": error}
    if rerun:
        fields.update(rerun_fields(task, engine.now()))
    return await engine.apply(
        task,
        Event.LOSE,
        retry=Retry(then=Event.SCHEDULE_RETRY) if rerun else None,
        fields=fields,
        error=error,
        fence=Fence(bump=True, leader=leader),
        facts=[Counts((failure(task, RESULT_LOST),))],
    )


def _outputs(task: Task) -> list[StoredOutput]:
    return [StoredOutput.from_json(raw) for raw in (task.result or {}).get("outputs", [])]


# Objects: does a SUCCESS task (or a task in flight) account for each one?


async def _check_objects(
    engine: Engine, report: Report, options: Options, clock: Callable[[], float]
) -> None:
    for prefix, check in ((TASKS_PREFIX, _check_batch), (INPUTS_PREFIX, _check_inputs)):
        batch: list[ObjectInfo] = []
        async for info in engine.storage.list(prefix):
            report.objects_checked += 1
            batch.append(info)
            if len(batch) >= options.page_size:
                await check(engine, batch, report, options, clock)
                batch.clear()
        if batch:
            await check(engine, batch, report, options, clock)


async def _check_inputs(
    engine: Engine,
    batch: list[ObjectInfo],
    report: Report,
    options: Options,
    clock: Callable[[], float],
) -> None:
    """Inputs the store does not know and no task refers to are orphans."""
    names = {info.key: info.key.rsplit("/", 1)[-1] for info in batch}
    known = await engine.store.inputs.known(sorted(set(names.values())))
    for info in batch:
        if names[info.key] not in known:
            await _found_orphan(
                engine,
                Orphan(info.key, info.size, None, None, _age_s(info, None, clock)),
                report,
                options,
            )


async def _check_batch(
    engine: Engine,
    batch: list[ObjectInfo],
    report: Report,
    options: Options,
    clock: Callable[[], float],
) -> None:
    ids = {task_id for info in batch if (task_id := _task_id(info.key)) is not None}
    tasks = await engine.store.get_many(sorted(ids))
    referenced = _referenced(tasks.values())
    for info in batch:
        task_id = _task_id(info.key)
        task = tasks.get(task_id) if task_id is not None else None
        if info.key in referenced or (task is not None and task.status not in FINAL):
            continue  # a SUCCESS task's output, or in use by a task in flight or in review
        status = None if task is None else str(task.status)
        orphan = Orphan(info.key, info.size, task_id, status, _age_s(info, task, clock))
        await _found_orphan(engine, orphan, report, options)


async def _found_orphan(engine: Engine, orphan: Orphan, report: Report, options: Options) -> None:
    report.orphan_count += 1
    report.orphan_bytes += orphan.size
    report.note(report.orphans, orphan)
    if options.repair:
        await _repair(engine.storage, orphan, report)


def _referenced(tasks: Iterable[Task]) -> set[str]:
    """The keys SUCCESS tasks refer to: their outputs and their attempt's manifest."""
    keys: set[str] = set()
    for task in tasks:
        if task.status is not Status.SUCCESS:
            continue
        for output in _outputs(task):
            keys.add(output.key)
            keys.add(f"{output.key.rsplit('/', 1)[0]}/{MANIFEST}")
    return keys


def _task_id(key: str) -> str | None:
    parts = key.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == TASKS_PREFIX.rstrip("/") else None


def _age_s(info: ObjectInfo, task: Task | None, clock: Callable[[], float]) -> float | None:
    if info.modified_at is not None:
        return max(clock() - info.modified_at, 0.0)
    if task is not None:
        return max(clock() - task.updated_at, 0.0)
    return None


async def _repair(storage: Storage, orphan: Orphan, report: Report) -> None:
    if orphan.age_s is None or orphan.age_s < report.grace_s:  # unknown age: brand new
        report.kept_count += 1
        report.note(report.kept, orphan.key)
        return
    await storage.delete(orphan.key)
    report.deleted_count += 1
    report.note(report.deleted, orphan.key)
    log.info("orphan_deleted", extra={"key": orphan.key, "task_id": orphan.task_id})
