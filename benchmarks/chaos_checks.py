"""The invariants of DESIGN.md, checked on a store and a storage once every task is final.

``load`` reads every task and every event once into a :class:`Snapshot`; each ``check_*``
function reads the snapshot (and the storage where it must) and returns a :class:`Check`
that lists what it looked at and every violation it found. ``check_all`` runs them in
order; the reconciliation check comes last because it deletes orphan objects.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import kiln
from kiln.models import StoredOutput, Task, TaskEvent
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


@dataclass
class Expected:
    """What the run knows independently of the store."""

    #: Every task id a submission answered with as newly created.
    created: set[str]
    #: Tasks whose handler fails permanently: they can never be SUCCESS.
    permanent: set[str] = field(default_factory=set)
    #: Submission answers that broke I5 as they came back (a replay with another id...).
    submit_problems: list[str] = field(default_factory=list)


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
    for task_id in sorted(snap.tasks.keys() - expected.created):
        check.fail(f"{task_id}: in the store, but no submission created it")
    for task in snap.tasks.values():
        finals = [e for e in snap.events.get(task.id, []) if e.final]
        if task.status not in FINAL:
            check.fail(f"{task.id}: still {task.status}")
        elif len(finals) != 1 or finals[0] is not snap.events[task.id][-1]:
            check.fail(f"{task.id}: {len(finals)} final events, or the last is not final")
        elif finals[0].status != task.status:
            check.fail(f"{task.id}: is {task.status}, its final event says {finals[0].status}")
    actual = Counter(str(task.status) for task in snap.tasks.values())
    for status in Status:
        if snap.counts.get(str(status), 0) != actual.get(str(status), 0):
            check.fail(f"the store counts {snap.counts.get(str(status), 0)} {status}, "
                       f"the tasks say {actual.get(str(status), 0)}")  # fmt: skip
    return check


def check_no_ghost(snap: Snapshot) -> Check:
    """I2: nothing is left active, nothing holds a lease, the store counts no ghost."""
    check = Check("I2", "no ghost, no active task left", len(snap.tasks))
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
        if task.status is not Status.SUCCESS:
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
        if task.id in expected.permanent:
            check.fail(f"{task.id}: SUCCESS, but its handler always fails")
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
    snap = await load(app.store)
    verified = await check_verified_success(snap, app.storage)
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
    ]


def all_ok(checks: Iterable[Check]) -> bool:
    return all(check.ok for check in checks)
