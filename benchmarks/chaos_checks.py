"""The invariants of DESIGN.md, checked on a store and a storage once every task is final.

``load`` reads every task and every event once into a :class:`Snapshot`; each ``check_*``
function reads the snapshot (and the storage where it must) and returns a :class:`Check`
that lists what it looked at and every violation it found. ``check_all`` runs them in
order; the reconciliation check comes last because it deletes orphan objects.

Pipelines (docs/pipelines.md) are tasks too, and every check above holds for them and for
their steps; where a pipeline's own task differs from a task a worker runs (no claim, no
lease, no outputs of its own, SUCCESS by ``steps_done``), the check says so where it
treats it apart. PL1-PL3 check what only pipelines have: their status against their
steps, one task per step, and outputs passed by reference.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import kiln
from kiln import pipelines as graph
from kiln.inputs import input_key
from kiln.models import JSON, StoredOutput, Task, TaskEvent
from kiln.reconcile import Options, reconcile
from kiln.states import ACTIVE, FINAL, RULES, RUNNING, Event, IllegalTransition, Status, replay
from kiln.storage import Storage, verify
from kiln.store import Store

PAGE = 500
#: Events a worker writes under its lease: each must carry the epoch of its own claim.
FENCED = frozenset(event for event, rule in RULES.items() if rule.fenced)
#: Events that move the lease epoch on (a claim, or the supervisor taking the task back).
EPOCH_BUMPS = frozenset(
    e for e in Event if e.value in ("claim", "expire", "recover", "force_cancel", "lose")
)
SHOWN_VIOLATIONS = 5
#: The error code of an expiry whose worker stopped renewing its lease.
LOST = "lease_expired"


@dataclass
class Check:
    """One invariant: how many things were checked, and what broke it."""

    key: str
    name: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations

    def fail(self, message: str) -> None:
        self.violations.append(message)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "violations": len(self.violations),
            "examples": self.violations[:SHOWN_VIOLATIONS],
        }


@dataclass
class Snapshot:
    """Every task and its event log (seq order), the store's counters and status counts."""

    tasks: dict[str, Task]
    events: dict[str, list[TaskEvent]]
    counters: dict[tuple[str, str], int]
    counts: dict[str, int]
    ghosts: int

    def counter(self, name: str) -> int:
        return sum(n for (counter, _), n in self.counters.items() if counter == name)

    def of_event(self, event: Event) -> int:
        return sum(1 for log in self.events.values() for e in log if e.event is event)

    def pipelines(self) -> list[Task]:
        return [task for task in self.tasks.values() if task.kind == graph.KIND]


def step_map(pipeline: Task) -> dict[str, str]:
    """A pipeline's map of steps: ``name/copy`` to the task id that is that copy (its own
    step, or the task that already had its content: content dedup)."""
    return dict((pipeline.result or {}).get("steps", {}))


def plan_of(pipeline: Task) -> tuple[dict[str, JSON], list[str], dict[str, int]]:
    """Its planned steps by name, every ``name/copy`` of its plan, and each step's repeat."""
    steps = {str(step["name"]): step for step in pipeline.params["steps"]}
    copies = [graph.key(c) for step in steps.values() for c in graph.copies(step)]
    repeats = {name: int(step.get("repeat", 1)) for name, step in steps.items()}
    return steps, copies, repeats


@dataclass
class Expected:
    """What the run knows independently of the store."""

    #: Every task id a submission answered with as newly created.
    created: set[str]
    #: Tasks whose handler fails permanently: they can never be SUCCESS.
    permanent: set[str] = field(default_factory=set)
    #: Submission answers that broke I5 as they came back (a replay with another id...).
    submit_problems: list[str] = field(default_factory=list)
    #: (pipeline id, step name) of steps whose handler always fails.
    permanent_steps: set[tuple[str, str]] = field(default_factory=set)
    #: Pipelines the run cancelled (and did not retry since).
    cancelled_pipelines: set[str] = field(default_factory=set)
    #: Tasks submitted with an input by reference: task id -> the output record it names.
    by_reference: dict[str, JSON] = field(default_factory=dict)


async def load(store: Store) -> Snapshot:
    tasks: dict[str, Task] = {}
    cursor: str | None = None
    while True:
        page, cursor = await store.list_tasks(tenant=None, limit=PAGE, cursor=cursor)
        tasks.update((task.id, task) for task in page)
        if cursor is None:
            break
    events: dict[str, list[TaskEvent]] = defaultdict(list)
    after = 0
    while page_events := await store.events(after=after, limit=PAGE):
        for event in page_events:
            events[event.task_id].append(event)
        after = page_events[-1].seq
    stats = await store.stats(tenant=None, ghost_after_s=0.0)
    return Snapshot(tasks, dict(events), await store.counters(), dict(stats.counts), stats.ghosts)


def check_one_final_state(snap: Snapshot, expected: Expected) -> Check:
    """I1: every accepted task is there, in exactly one final state, once in its log."""
    check = Check("I1", "each task in exactly one final state", len(expected.created))
    for task_id in sorted(expected.created - snap.tasks.keys()):
        check.fail(f"{task_id}: accepted, but gone from the store")
    # A pipeline's steps are made by the store, not by a submission: each must be named
    # by the map of a pipeline a submission created (PL2 checks the map further).
    stepped = {
        task_id
        for pipeline in snap.pipelines()
        if pipeline.id in expected.created
        for task_id in step_map(pipeline).values()
    }
    check.checked += len(stepped - expected.created)
    for task_id in sorted(snap.tasks.keys() - expected.created - stepped):
        check.fail(f"{task_id}: in the store, but no submission or pipeline created it")
    for task in snap.tasks.values():
        log = snap.events.get(task.id, [])
        finals = [n for n, e in enumerate(log) if e.final]
        # A task retried by hand once it ended (the run retries some ended pipelines, and
        # so their steps that did not succeed) has one final event per run: each but the
        # last is followed at once by its retry.
        retried = all(n + 1 < len(log) and log[n + 1].event is Event.RETRY for n in finals[:-1])
        if task.status not in FINAL:
            check.fail(f"{task.id}: still {task.status}")
        elif not finals or finals[-1] != len(log) - 1 or not retried:
            check.fail(f"{task.id}: {len(finals)} final events, not each but the last "
                       "followed by a retry, or the last event is not final")  # fmt: skip
        elif log[-1].status != task.status:
            check.fail(f"{task.id}: is {task.status}, its final event says {log[-1].status}")
    actual = Counter(str(task.status) for task in snap.tasks.values())
    for status in Status:
        if snap.counts.get(str(status), 0) != actual.get(str(status), 0):
            check.fail(f"the store counts {snap.counts.get(str(status), 0)} {status}, "
                       f"the tasks say {actual.get(str(status), 0)}")  # fmt: skip
    return check


def check_no_ghost(snap: Snapshot) -> Check:
    """I2: nothing is left active, nothing holds a lease, the store counts no ghost."""
    check = Check("I2", "no ghost, no active task left", len(snap.tasks))
    # Pipelines need no exception here: a running one is GENERATING without a lease (no
    # worker runs it) and never counted a ghost, but once every task is final none runs,
    # and a final pipeline, like any final task, must hold no lease.
    for task in snap.tasks.values():
        if task.status in ACTIVE:
            running = "running" if task.status in RUNNING else "active"
            check.fail(f"{task.id}: {running} in {task.status} (lease {task.lease_owner})")
        elif task.lease_owner is not None or task.lease_expires_at is not None:
            check.fail(f"{task.id}: {task.status} but still leased to {task.lease_owner}")
    if snap.ghosts:
        check.fail(f"the store counts {snap.ghosts} ghost tasks")
    return check


def check_fencing(snap: Snapshot) -> Check:
    """I3: epochs only grow; each worker event carries its own claim's attempt and epoch,
    with no epoch bump in between: a write from an older epoch never landed after a newer
    one. The stale writes the store refused are counted in the note."""
    check = Check("I3", "fencing: no write from a stale epoch landed")
    for task_id, log in snap.events.items():
        epoch, attempt, claim_epoch = 0, 0, None
        for event in log:
            check.checked += 1
            where = f"{task_id} seq {event.seq} {event.event}"
            if event.epoch < epoch:
                check.fail(f"{where}: epoch {event.epoch} after epoch {epoch}")
            if event.event in EPOCH_BUMPS:
                if event.epoch != epoch + 1:
                    check.fail(f"{where}: epoch {epoch} -> {event.epoch}, not +1")
                claim_epoch = event.epoch if event.event is Event.CLAIM else None
                if event.event is Event.CLAIM and event.attempt != attempt + 1:
                    check.fail(f"{where}: attempt {attempt} -> {event.attempt}, not +1")
            elif event.event in FENCED and (
                claim_epoch is None or (event.epoch, event.attempt) != (claim_epoch, attempt)
            ):
                check.fail(f"{where}: worker write at attempt {event.attempt} epoch "
                           f"{event.epoch}; the lease was at {attempt}/{claim_epoch}")  # fmt: skip
            elif event.event not in EPOCH_BUMPS and event.epoch != epoch:
                check.fail(f"{where}: epoch {epoch} -> {event.epoch} without a bump")
            epoch, attempt = max(epoch, event.epoch), max(attempt, event.attempt)
    check.note = f"{snap.counter('stale_writes')} stale writes refused"
    return check


async def check_verified_success(snap: Snapshot, storage: Storage) -> Check:
    """I4: every SUCCESS task's outputs are in storage with their size and sha256."""
    check = Check("I4", "every SUCCESS verified in storage (size, sha256)")
    for task in snap.tasks.values():
        # A pipeline's own task has no outputs (docs/pipelines.md): its steps, tasks
        # checked here like any other, hold them; PL1 ties its SUCCESS to theirs.
        if task.status is not Status.SUCCESS or task.kind == graph.KIND:
            continue
        outputs = [StoredOutput.from_json(o) for o in (task.result or {}).get("outputs", [])]
        if not outputs:
            check.fail(f"{task.id}: SUCCESS without outputs")
        for output in outputs:
            check.checked += 1
            if not await verify(storage, output):
                check.fail(f"{task.id}: {output.key} missing or not as recorded")
    return check


def check_uniqueness(snap: Snapshot, expected: Expected) -> Check:
    """I5: one task per (tenant, idempotency key); one live or successful task per
    (tenant, dedup key); and every submission answer agreed with that."""
    check = Check("I5", "one task per idempotency key, per live dedup key")
    by_key: dict[tuple[str, str], list[str]] = defaultdict(list)
    by_dedup: dict[tuple[str, str], list[str]] = defaultdict(list)
    for task in snap.tasks.values():
        if task.idempotency_key is not None:
            by_key[(task.tenant, task.idempotency_key)].append(task.id)
        if task.dedup_key is not None and (task.status in ACTIVE or task.status is Status.SUCCESS):
            by_dedup[(task.tenant, task.dedup_key)].append(task.id)
    for label, groups in (("idempotency key", by_key), ("dedup key", by_dedup)):
        for (tenant, _), ids in groups.items():
            check.checked += 1
            if len(ids) > 1:
                check.fail(f"{tenant}: {len(ids)} tasks share one {label}: {sorted(ids)}")
    check.checked += len(expected.submit_problems)
    for problem in expected.submit_problems:
        check.fail(f"submission: {problem}")
    return check


def check_log_replays(snap: Snapshot) -> Check:
    """I6: each task's log starts with submit, replays to its status; ids are unique."""
    check = Check("I6", "event logs replay to the status", len(snap.tasks))
    ids = Counter(e.id for log in snap.events.values() for e in log)
    for event_id, n in ids.items():
        if n > 1:
            check.fail(f"event id {event_id} appears {n} times")
    for task in snap.tasks.values():
        log = snap.events.get(task.id, [])
        if not log or log[0].event is not Event.SUBMIT:
            check.fail(f"{task.id}: the log does not start with submit")
            continue
        if any(b.seq <= a.seq for a, b in itertools.pairwise(log)):
            check.fail(f"{task.id}: seq does not increase")
        try:
            status = replay((e.event, e.from_status, e.status) for e in log)
        except IllegalTransition as exc:
            check.fail(f"{task.id}: the log does not replay: {exc}")
            continue
        if status != task.status:
            check.fail(f"{task.id}: the log replays to {status}, the task is {task.status}")
    return check


def check_bounded_attempts(snap: Snapshot) -> Check:
    """I7: attempt <= max_attempts, and one claim event per attempt."""
    check = Check("I7", "attempts within bounds", len(snap.tasks))
    for task in snap.tasks.values():
        claims = sum(1 for e in snap.events.get(task.id, []) if e.event is Event.CLAIM)
        if task.attempt > task.max_attempts:
            check.fail(f"{task.id}: attempt {task.attempt} > max_attempts {task.max_attempts}")
        if claims != task.attempt:
            check.fail(f"{task.id}: {claims} claims for attempt {task.attempt}")
    return check


def check_crash_recovery(snap: Snapshot, integrity: str | None) -> Check:
    """I8: every task whose worker vanished (its lease lapsed) was taken back and ended
    final; the database file itself is sound (``integrity``: SQLite's integrity_check)."""
    check = Check("I8", "crash anywhere: lost tasks recovered, store sound")
    for task_id, log in snap.events.items():
        lost = [e for e in log if e.event is Event.EXPIRE and (e.error or {}).get("code") == LOST]
        if lost:
            check.checked += 1
            if snap.tasks[task_id].status not in FINAL:
                check.fail(f"{task_id}: lost its worker, still {snap.tasks[task_id].status}")
    if integrity is not None and integrity != "ok":
        check.fail(f"integrity_check: {integrity}")
    sound = "not run (PostgreSQL)" if integrity is None else integrity
    check.note = f"{check.checked} tasks lost their worker's lease; integrity_check {sound}"
    return check


def check_exactly_once(snap: Snapshot, expected: Expected) -> Check:
    """One SUCCESS event per successful task, from its last attempt, with the outputs at
    that attempt's reserved location; none for any other task; none for a task whose
    handler can only fail."""
    check = Check("EO", "no duplicate SUCCESS; outputs from one attempt", len(snap.tasks))
    for task in snap.tasks.values():
        log = snap.events.get(task.id, [])
        done = [e for e in log if e.status is Status.SUCCESS]
        if task.status is not Status.SUCCESS:
            if done:
                check.fail(f"{task.id}: {task.status} after {len(done)} SUCCESS events")
            continue
        if (
            task.id in expected.permanent
            or (task.pipeline_id, task.step) in expected.permanent_steps
        ):
            check.fail(f"{task.id}: SUCCESS, but its handler always fails")
        if task.kind == graph.KIND:
            _check_pipeline_success(check, task, done)
            continue
        if len(done) != 1 or done[0].event not in (Event.UPLOADED, Event.RECOVER, Event.APPROVE):
            check.fail(f"{task.id}: {[str(e.event) for e in done]} reached SUCCESS")
            continue
        claims = [e for e in log if e.event is Event.CLAIM and e.attempt == done[0].attempt]
        prefix = f"tasks/{task.id}/{done[0].attempt}-{claims[0].epoch}" if claims else None
        if done[0].attempt != task.attempt or task.result_prefix != prefix:
            check.fail(
                f"{task.id}: SUCCESS in attempt {done[0].attempt} at "
                f"{task.result_prefix}, expected attempt {task.attempt} at {prefix}"
            )
        for raw in (task.result or {}).get("outputs", []):
            if not str(raw.get("key", "")).startswith(f"{prefix}/"):
                check.fail(f"{task.id}: output {raw.get('key')} outside {prefix}/")
    return check


def check_pipelines_final(snap: Snapshot, expected: Expected) -> Check:
    """PL1: every pipeline is final and its status agrees with its steps and its policy:
    SUCCESS, every copy of its plan made and SUCCESS; FAILED, a step failed or timed out
    for good; CANCELLED, the run cancelled it (no one else cancels steps here); and no
    step of an ended pipeline moved on after that end, but one that was running and asked
    to stop, which then ended (a new attempt of it, if any, did not succeed)."""
    check = Check("PL1", "pipelines final, status agrees with steps and policy")
    reclaimed: list[str] = []
    for pipeline in snap.pipelines():
        check.checked += 1
        where = f"pipeline {pipeline.id} {pipeline.status}"
        mapping = step_map(pipeline)
        _, copies, _ = plan_of(pipeline)
        steps = {key: snap.tasks[task_id] for key, task_id in mapping.items()
                 if task_id in snap.tasks}  # fmt: skip
        for key in sorted(mapping.keys() - steps.keys()):
            check.fail(f"{where}: step {key} is task {mapping[key]}, not in the store")
        for key in sorted(mapping.keys() - set(copies)):
            check.fail(f"{where}: step {key} is not in its plan")
        if pipeline.status not in FINAL:
            check.fail(f"{where}: not final")
            continue
        statuses = {key: task.status for key, task in steps.items()}
        for problem in _disagreements(pipeline, copies, statuses, expected):
            check.fail(f"{where}: {problem}")
        reclaimed += _check_after_end(check, snap, pipeline, steps)
    check.note = (f"{len(reclaimed)} steps asked to stop were expired and claimed again "
                  f"before they stopped: {sorted(reclaimed)[:3]}")  # fmt: skip
    return check


def _disagreements(
    pipeline: Task, copies: list[str], statuses: dict[str, Status], expected: Expected
) -> list[str]:
    """How a final pipeline's status disagrees with its steps' and the run's cancels."""
    found = []
    cancelled = pipeline.id in expected.cancelled_pipelines
    if pipeline.status is Status.SUCCESS:
        found += [f"its step {key} is {statuses.get(key, 'not made')}"
                  for key in copies if statuses.get(key) is not Status.SUCCESS]  # fmt: skip
    elif pipeline.status is Status.FAILED:
        if not any(s in (Status.FAILED, Status.TIMEOUT) for s in statuses.values()):
            found.append(f"({(pipeline.error or {}).get('message')}): no step failed or "
                         f"timed out: {sorted(statuses.items())}")  # fmt: skip
    elif pipeline.status is Status.CANCELLED:
        if not cancelled:
            found.append(f"the run did not cancel it: {sorted(statuses.items())}")
    else:
        found.append("a pipeline never times out (it has no deadline of its own)")
    if cancelled and pipeline.status is not Status.CANCELLED:
        found.append("the run cancelled it (and did not retry it)")
    return found


def _check_after_end(
    check: Check, snap: Snapshot, pipeline: Task, steps: dict[str, Task]
) -> list[str]:
    """No step of the pipeline changed after its (last) final event, but one that was
    running then (asked to stop, or finishing its upload) and ended; one that started a
    new attempt meanwhile must not have succeeded. The steps that did are returned."""
    ends = [e for e in snap.events.get(pipeline.id, []) if e.final]
    reclaimed: list[str] = []
    if not ends:
        return reclaimed
    end = ends[-1].seq
    for key, task in sorted(steps.items()):
        if task.pipeline_id != pipeline.id:
            continue  # another task's content (dedup): not its pipeline's to stop
        log = snap.events.get(task.id, [])
        after = [e for e in log if e.seq > end]
        if not after:
            continue
        before = [e for e in log if e.seq < end]
        then = before[-1].status if before else None
        moves = [str(e.event) for e in after]
        if pipeline.status is Status.SUCCESS or then not in RUNNING:
            check.fail(f"pipeline {pipeline.id} ended {pipeline.status} (seq {end}) with "
                       f"step {key} {then}, which then did {moves}")  # fmt: skip
        elif any(e.event is Event.CLAIM for e in after):
            # Asked to stop, yet expired and claimed again: the supervisor decided to
            # retry it on a read from before the stop was asked (the engine's expire
            # races a cancel request, for any task; docs/reliability.md). Its new attempt
            # must stop, not succeed; counted in the note.
            reclaimed.append(task.id)
            if task.status is Status.SUCCESS:
                check.fail(f"pipeline {pipeline.id} ended {pipeline.status} (seq {end}); its "
                           f"step {key} ({task.id}) ran again and succeeded: {moves}")  # fmt: skip
    return reclaimed


def check_one_task_per_step(snap: Snapshot) -> Check:
    """PL2: each step copy (pipeline, step, copy) is one task, the one its pipeline's map
    names, made by a pipeline that exists; each step has at most one ``uploaded`` event,
    exactly one when it reached SUCCESS by uploading (EO checks the one SUCCESS)."""
    check = Check("PL2", "one task per step copy, one upload per SUCCESS step")
    _check_copies(check, snap)
    _check_dedup_steps(check, snap)
    _check_uploads(check, snap)
    return check


def _check_copies(check: Check, snap: Snapshot) -> None:
    by_copy: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    for task in snap.tasks.values():
        if task.pipeline_id is not None:
            by_copy[(task.pipeline_id, str(task.step), int(task.step_copy or 0))].append(task.id)
    for (pipeline_id, step, copy), ids in sorted(by_copy.items()):
        check.checked += 1
        key = graph.key((step, copy))
        pipeline = snap.tasks.get(pipeline_id)
        if len(ids) != 1:
            check.fail(f"pipeline {pipeline_id} step {key}: {len(ids)} tasks {sorted(ids)}")
        if pipeline is None or pipeline.kind != graph.KIND:
            check.fail(f"{ids[0]}: step {key} of {pipeline_id}, which is not a pipeline")
        elif step_map(pipeline).get(key) not in ids:
            check.fail(f"{ids[0]}: step {key}, its pipeline's map names "
                       f"{step_map(pipeline).get(key)}")  # fmt: skip


def _check_dedup_steps(check: Check, snap: Snapshot) -> None:
    for pipeline in snap.pipelines():
        for key, task_id in step_map(pipeline).items():
            task = snap.tasks.get(task_id)
            if task is not None and task.pipeline_id != pipeline.id:
                check.checked += 1  # content dedup: another task, done before it was read
                if task.status is not Status.SUCCESS:
                    check.fail(f"pipeline {pipeline.id} step {key} is {task.status} "
                               f"task {task_id} of another")  # fmt: skip


def _check_uploads(check: Check, snap: Snapshot) -> None:
    for task in snap.tasks.values():
        if task.pipeline_id is None:
            continue
        log = snap.events.get(task.id, [])
        uploads = [e for e in log if e.event is Event.UPLOADED]
        by_upload = any(e.event is Event.UPLOADED and e.status is Status.SUCCESS for e in log)
        if len(uploads) > 1 or (by_upload and len(uploads) != 1):
            check.fail(f"{task.id} (step {task.step}/{task.step_copy}): {len(uploads)} "
                       f"uploaded events, attempts {[e.attempt for e in uploads]}")  # fmt: skip


async def check_step_inputs(snap: Snapshot, storage: Storage) -> Check:
    """PL3: outputs passed by reference: each step's input records are exactly the output
    records (key, sha256, size) of the step copies it reads, which all succeeded, in the
    plan's order; each object is in storage with that size and sha256 (no pipeline is
    purged during the run)."""
    check = Check("PL3", "step inputs name their sources' outputs, in storage")
    for pipeline in snap.pipelines():
        plan, _, repeats = plan_of(pipeline)
        mapping = step_map(pipeline)
        for key, task_id in sorted(mapping.items()):
            task = snap.tasks.get(task_id)
            if task is None or task.pipeline_id != pipeline.id:
                continue  # PL1 names a missing one; a dedup hit's inputs are its own
            name, _, copy = key.rpartition("/")
            sources = graph.sources(plan[name], int(copy), repeats)
            wanted = _source_outputs(check, snap, mapping, sources, f"{task_id} (step {key})")
            given = [(i["name"], i.get("key"), i.get("sha256"), i.get("size"))
                     for i in task.inputs]  # fmt: skip
            if given != wanted:
                check.fail(f"{task_id} (step {key}): inputs {given}, its sources made {wanted}")
            for record in task.inputs:
                check.checked += 1
                if "key" in record and not await verify(storage, StoredOutput.from_json(record)):
                    check.fail(f"{task_id} (step {key}): input {record['key']} missing or "
                               "not as recorded")  # fmt: skip
    return check


def _check_pipeline_success(check: Check, task: Task, done: list[TaskEvent]) -> None:
    """No worker runs a pipeline: it reaches SUCCESS once, by steps_done, in the
    transaction of its last step's SUCCESS, with no attempt and no outputs of its own."""
    outputs = (task.result or {}).get("outputs", [])
    if [e.event for e in done] != [Event.STEPS_DONE] or outputs or task.attempt:
        check.fail(f"{task.id}: pipeline reached SUCCESS by {[str(e.event) for e in done]}, "
                   f"attempt {task.attempt}, {len(outputs)} outputs of its own")  # fmt: skip


def _source_outputs(
    check: Check,
    snap: Snapshot,
    mapping: dict[str, str],
    sources: list[tuple[str, graph.Copy, str]],
    where: str,
) -> list[tuple[str, Any, Any, Any]]:
    """(input name, key, sha256, size) of every output a step copy reads, in order."""
    wanted: list[tuple[str, Any, Any, Any]] = []
    for input_name, source, output in sources:
        origin = snap.tasks.get(mapping.get(graph.key(source), ""))
        if origin is None or origin.status is not Status.SUCCESS:
            state = "not made" if origin is None else origin.status
            check.fail(f"{where} reads step {graph.key(source)}, which is {state}")
            continue
        for made in (origin.result or {}).get("outputs", []):
            if output in (graph.WILDCARD, made["name"]):
                wanted.append((input_name, made["key"], made["sha256"], made["size"]))
    return wanted


async def check_by_reference(snap: Snapshot, storage: Storage, expected: Expected) -> Check:
    """RF: each task submitted with an earlier output by reference has that output's
    content (sha256, size) as its input, kept once under ``inputs/`` and in storage with
    that sha256: the copy the submission made is the output's, whatever the chaos did."""
    check = Check("RF", "inputs by reference are their outputs' content, in storage")
    for task_id, output in sorted(expected.by_reference.items()):
        check.checked += 1
        task = snap.tasks.get(task_id)
        if task is None:
            continue  # I1 names it
        given = [(i.get("sha256"), i.get("size")) for i in task.inputs]
        if given != [(output["sha256"], output["size"])]:
            check.fail(f"{task_id}: inputs {given}, the output it named "
                       f"{(output['sha256'], output['size'])}")  # fmt: skip
            continue
        kept = StoredOutput(name=str(task.inputs[0]["name"]), key=input_key(output["sha256"]),
                            content_type=str(task.inputs[0]["content_type"]),
                            size=int(output["size"]), sha256=str(output["sha256"]))  # fmt: skip
        if not await verify(storage, kept):
            check.fail(f"{task_id}: its input {kept.key} missing or not as recorded")
    return check


def check_illegal_transitions(snap: Snapshot) -> Check:
    """The engine refused (and counted) no transition the state table forbids."""
    check = Check("IT", "illegal transitions counter is zero", 1)
    for (name, labels), n in snap.counters.items():
        if name == "illegal_transitions" and n:
            check.fail(f"{n} illegal transitions {labels}")
    return check


async def check_no_orphans(app: kiln.App) -> Check:
    """Reconcile with repair and grace 0: no result lost, every orphan deleted; then a
    second pass without repair: clean."""
    check = Check("RC", "no orphan left after reconciliation")
    first = await reconcile(app, Options(repair=True, grace_s=0.0))
    second = await reconcile(app, Options(repair=False, grace_s=0.0))
    check.checked = first.objects_checked
    for report in (first, second):
        for missing in report.missing:
            check.fail(f"{missing.task_id}: {missing.key} {missing.problem}")
        if report.lost_tasks > len(report.missing):
            check.fail(f"{report.lost_tasks} SUCCESS tasks with lost outputs")
    if first.deleted_count != first.orphan_count:
        check.fail(f"repair deleted {first.deleted_count} of {first.orphan_count} orphans")
    for orphan in second.orphans:
        check.fail(f"orphan left after repair: {orphan.key} ({orphan.task_status})")
    if second.orphan_count > len(second.orphans):
        check.fail(f"{second.orphan_count} orphans left after repair")
    check.note = (
        f"{first.deleted_count} orphans removed ({first.orphan_bytes} bytes), "
        f"{second.objects_checked} objects kept"
    )
    return check


async def check_all(
    app: kiln.App, expected: Expected, *, integrity: str | None = None
) -> list[Check]:
    """Every check on one snapshot, in DESIGN.md's order. Reconciliation, which deletes
    orphans, runs after the outputs were verified."""
    snap = await load(app.engine.store)
    verified = await check_verified_success(snap, app.storage)
    step_inputs = await check_step_inputs(snap, app.storage)
    by_reference = await check_by_reference(snap, app.storage, expected)
    reconciled = await check_no_orphans(app)
    return [
        check_one_final_state(snap, expected),
        check_no_ghost(snap),
        check_fencing(snap),
        verified,
        check_uniqueness(snap, expected),
        check_log_replays(snap),
        check_bounded_attempts(snap),
        check_crash_recovery(snap, integrity),
        check_exactly_once(snap, expected),
        reconciled,
        check_illegal_transitions(snap),
        check_pipelines_final(snap, expected),
        check_one_task_per_step(snap),
        step_inputs,
        by_reference,
    ]


def all_ok(checks: Iterable[Check]) -> bool:
    return all(check.ok for check in checks)
