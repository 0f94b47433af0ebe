"""Circuit breakers shared by every worker on every machine, and what a task kind does
while one is open.

Each task kind depends on two breakers: its generator (named after the backend that
serves it, ``openai-images``, ``comfyui``, ``demo``; a kind without a backend has one of
its own, named after the kind) and ``storage``. A backend that calls a service through
:class:`~kiln.backends.upstream.Upstream` feeds its breaker call by call; any other
generator breaker counts the kind's handler errors (``upstream_unavailable``,
``upstream_rate_limited`` and ``upstream_bad_response`` fail, success or
``upstream_rejected`` succeed), and the ``storage`` breaker counts the outputs' writes and
verifications.

Local outcomes decide transitions; the store carries the state. A process that opens,
closes or takes the half-open probe of a breaker writes one row (``breakers`` table), and
every worker reads the table at most once a second, so a breaker tripped on one machine
holds back the kind everywhere. Only the process whose compare-and-set wins the half-open
row sends the probe.

While a kind's breaker is open its policy (KILN_BREAKER_POLICY) applies: ``pause`` (the
default) stops claiming the kind, its tasks stay PENDING, and the probe lets one task
through; ``fail_fast`` claims as usual and ends each task at once, FAILED
``upstream_unavailable``, not retried.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.circuit import CircuitBreaker, Permit, State
from kiln.engine import Engine, SupportsEngine, engine_of
from kiln.errors import StorageError, StoreUnavailable, TaskError
from kiln.models import iso
from kiln.store import BreakerRecord

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from kiln.kinds import TaskKind
    from kiln.models import JSON, Task

log = logging.getLogger("kiln.breakers")

STORAGE = "storage"
PAUSE = "pause"
FAIL_FAST = "fail_fast"
#: The error code of a task a ``fail_fast`` kind ends while its breaker is open.
UNAVAILABLE = "upstream_unavailable"
#: Handler error codes that count as a failure of the kind's generator.
UPSTREAM_FAILURES = frozenset(
    {"upstream_unavailable", "upstream_rate_limited", "upstream_bad_response"}
)
#: The upstream answered (and refused the request): it works.
UPSTREAM_ANSWERED = frozenset({"upstream_rejected"})
STORAGE_FAILURES = frozenset({"storage_error", "storage_verify_failed"})
#: Workers read the shared states at most this often (seconds).
READ_EVERY_S = 1.0
#: ``probe_task`` while the probe's task is being claimed.
CLAIMING = "(claiming)"
#: ``kiln_breaker_state`` values.
STATE_VALUES: dict[str, int] = {"closed": 0, "half_open": 1, "open": 2}


def shared_state(record: BreakerRecord, now: float) -> str:
    """What a stored row means now: an open breaker whose open period is over is
    half-open (the next probe may go)."""
    if record.state == "open" and (record.opened_until or 0.0) <= now:
        return "half_open"
    return record.state


def breakers_json(records: Iterable[BreakerRecord], now: float) -> dict[str, JSON]:
    """``/v1/stats``'s ``breakers``: {name: {"state", "until"}}; ``until`` is when an open
    breaker lets its next probe through (or a half-open one's probe expires), else None."""
    found: dict[str, JSON] = {}
    for record in records:
        state = shared_state(record, now)
        until = iso(record.opened_until) if state != "closed" else None
        found[record.name] = {"state": state, "until": until}
    return found


def generator_of(kind: TaskKind) -> tuple[str, CircuitBreaker | None]:
    """The name of the kind's generator breaker, and the breaker its backend's
    :class:`~kiln.backends.upstream.Upstream` feeds (None: the worker feeds it)."""
    backend = getattr(kind.handler, "backend", None)
    name = getattr(backend, "name", None)
    if not isinstance(name, str):
        return kind.name, None
    fed = getattr(getattr(kind.handler, "metrics", None), "breakers", None)
    found = fed.get(name) if isinstance(fed, dict) else None
    return name, found if isinstance(found, CircuitBreaker) else None


@dataclass(slots=True)
class _Shared:
    """One breaker as this process shares it."""

    breaker: CircuitBreaker
    fed_by_worker: bool
    #: The last row this process wrote or took from the store.
    last: BreakerRecord | None = None
    #: This process holds the half-open probe until then (store clock).
    probe_until: float | None = None
    #: The task sent as the probe, while it runs.
    probe_task: str | None = None
    tried_at: float = float("-inf")
    #: Transitions this process made (read before and after a read of the store).
    changes: int = 0


class Breakers:
    """One process's breakers (``App.breakers``, shared by its workers): their shared
    state, the kinds' policies, and a Prometheus collector (``kiln_breaker_state``,
    ``kiln_breaker_transitions_total``). ``owner`` is what the store's ``by`` says."""

    def __init__(self, engine: Engine | SupportsEngine, owner: str | None = None) -> None:
        self.engine = engine = engine_of(engine)
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self.settings = engine.settings
        self.breakers: dict[str, _Shared] = {}
        self._dependencies: dict[str, tuple[str, ...]] = {}
        #: Transitions this process decided, by (breaker, to).
        self.transitions: collections.Counter[tuple[str, str]] = collections.Counter()
        self._pending: list[BreakerRecord] = []
        self._read_at = float("-inf")
        self._syncing = False
        self._add(STORAGE, None)
        for name in engine.kinds:
            self.dependencies(name)

    def dependencies(self, kind: str) -> tuple[str, ...]:
        """The names of the breakers a kind depends on: its generator's, then storage."""
        found = self._dependencies.get(kind)
        if found is None:
            generator, fed = generator_of(self.engine.kinds[kind])
            self._add(generator, fed)
            found = self._dependencies[kind] = (generator, STORAGE)
        return found

    def _add(self, name: str, fed: CircuitBreaker | None) -> None:
        if name in self.breakers:
            return
        breaker = fed or CircuitBreaker.from_settings(self.settings, clock=self.engine.now)
        breaker.listeners.append(lambda state: self._decided(name, state))
        self.breakers[name] = _Shared(breaker, fed_by_worker=fed is None)

    def policy(self, kind: str) -> str:
        found = self.settings.breaker_policy
        return found.get(kind) or found.get("*") or PAUSE

    def state(self, name: str) -> State:
        return self.breakers[name].breaker.state

    def closed(self, kind: str) -> bool:
        """Whether every breaker the kind depends on is closed (as of the last sync)."""
        return all(self.state(name) == "closed" for name in self.dependencies(kind))

    # sharing through the store

    def _decided(self, name: str, state: State) -> None:
        """A transition this process decided: written to the store at the next sync."""
        now = self.engine.now()
        shared = self.breakers[name]
        until = now + shared.breaker.retry_after_s() if state == "open" else None
        record = BreakerRecord(name, state, until, now, self.owner)
        self._pending.append(record)
        shared.last, shared.probe_until, shared.probe_task = record, None, None
        shared.changes += 1
        self.transitions[(name, state)] += 1
        level = logging.WARNING if state == "open" else logging.INFO
        log.log(level, f"breaker_{state}", extra={"breaker": name, "until": until})

    async def sync(self) -> None:
        """Write this process's transitions, then read every breaker's shared state (at
        most every READ_EVERY_S). A store that does not answer leaves the local states.
        One sync at a time: the workers of a process share these breakers."""
        if self._syncing:
            return
        self._syncing = True
        try:
            await self._sync()
        finally:
            self._syncing = False

    async def _sync(self) -> None:
        try:
            while self._pending:
                await self.engine.store.limits.save_breaker(self._pending[0])
                self._pending.pop(0)
            now = self.engine.now()
            if now - self._read_at < READ_EVERY_S:
                return
            self._read_at = now
            changes = {name: shared.changes for name, shared in self.breakers.items()}
            rows = await self.engine.store.limits.breakers()
        except StoreUnavailable as exc:
            log.warning("breaker_sync_failed", extra={"error": exc.message})
            return
        for row in rows:
            if changes.get(row.name) == getattr(self.breakers.get(row.name), "changes", None):
                self._adopt(row, now)  # else this process changed it during the read

    def _adopt(self, row: BreakerRecord, now: float) -> None:
        shared = self.breakers.get(row.name)
        if shared is None or row == shared.last:
            return
        if any(p.name == row.name for p in self._pending):
            return  # a newer transition of this process is on its way to the store
        shared.last, shared.probe_until, shared.probe_task = row, None, None
        remaining_s = max(0.0, (row.opened_until or now) - now)
        shared.breaker.adopt(row.state, remaining_s)  # type: ignore[arg-type]
        log.info("breaker_adopted", extra={"breaker": row.name, "state": row.state, "by": row.by})

    async def take_probe(self, name: str) -> bool:
        """Whether this process holds (or now took) the half-open probe of ``name``."""
        shared = self.breakers[name]
        now = self.engine.now()
        if shared.probe_until is not None and shared.probe_until > now:
            return True
        if shared.breaker.state == "closed" or shared.breaker.retry_after_s() > 0:
            return False
        if now - shared.tried_at < READ_EVERY_S:
            return False
        shared.tried_at = now
        until = now + self.settings.breaker_open_s
        record = BreakerRecord(name, "half_open", until, now, self.owner)
        try:
            won = await self.engine.store.limits.save_breaker(record, only_if_due=True)
        except StoreUnavailable:
            return False
        if not won:
            self._read_at = float("-inf")  # someone else moved it: read it at the next sync
            return False
        shared.last, shared.probe_until = record, until
        shared.changes += 1
        self.transitions[(name, "half_open")] += 1
        log.info("breaker_probe", extra={"breaker": name, "until": until})
        return True

    # the policies

    async def claimable(self, kinds: Iterable[str]) -> tuple[list[str], list[str]]:
        """(kinds to claim as usual, ``pause`` kinds to claim one probe task of)."""
        await self.sync()
        usual: list[str] = []
        probes: list[str] = []
        for kind in kinds:
            blocking = [n for n in self.dependencies(kind) if self.state(n) != "closed"]
            if not blocking or self.policy(kind) == FAIL_FAST:
                usual.append(kind)
            elif await self._probe_free(blocking):
                probes.append(kind)
        return usual, probes

    async def _probe_free(self, names: list[str]) -> bool:
        """Whether this process holds the probe of each of ``names`` and has no probe task
        out for them; if so they are marked, so that no other worker of the process
        claims a probe too, until :meth:`probing` names the task (or None)."""
        for name in names:
            if self.breakers[name].probe_task is not None or not await self.take_probe(name):
                return False
        for name in names:
            self.breakers[name].probe_task = CLAIMING
        return True

    def probing(self, kind: str, task_id: str | None) -> None:
        """``task_id`` is the probe of the kind's breakers that are not closed; None: the
        probe claim found no task."""
        for name in self.dependencies(kind):
            shared = self.breakers[name]
            if shared.probe_task == CLAIMING:
                shared.probe_task = task_id

    async def refusal(self, kind: str, task_id: str) -> str | None:
        """Why a claimed task of a ``fail_fast`` kind must fail at once, or None: its
        breakers are closed, or it is their probe."""
        if self.policy(kind) != FAIL_FAST:
            return None
        for name in self.dependencies(kind):
            shared = self.breakers[name]
            if shared.breaker.state == "closed" or shared.probe_task == task_id:
                continue
            if shared.probe_task is None and await self.take_probe(name):
                shared.probe_task = task_id
                continue
            wait_s = shared.breaker.retry_after_s()
            return (
                f"the circuit breaker {name!r} is open after repeated failures; {kind} "
                f"fails fast (next probe in {wait_s:.1f} s)"
            )
        return None

    # the verdicts the worker gives

    def admit(self, kind: str) -> dict[str, Permit]:
        """Permits of the kind's breakers that the worker feeds (not an Upstream)."""
        permits: dict[str, Permit] = {}
        for name in self.dependencies(kind):
            shared = self.breakers[name]
            if shared.fed_by_worker and (permit := shared.breaker.admit()) is not None:
                permits[name] = permit
        return permits

    def settle(self, task: Task, permits: dict[str, Permit], error: BaseException | None) -> None:
        """Record what the attempt came to on each permit's breaker; end its probe."""
        for name, permit in permits.items():
            verdict = (_storage_verdict if name == STORAGE else _generator_verdict)(task, error)
            if verdict is None:
                self.breakers[name].breaker.release(permit)
            else:
                self.breakers[name].breaker.record(permit, verdict)
        for shared in self.breakers.values():
            if shared.probe_task == task.id:
                shared.probe_task = None

    # metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gauge = GaugeMetricFamily(
            "kiln_breaker_state",
            "Circuit breaker state as this process sees it: 0 closed, 1 half-open, 2 open",
            labels=["breaker"],
        )
        for name, shared in sorted(self.breakers.items()):
            gauge.add_metric([name], STATE_VALUES[shared.breaker.state])
        yield gauge
        counter = CounterMetricFamily(
            "kiln_breaker_transitions",
            "Circuit breaker transitions this process decided, by the state entered",
            labels=["breaker", "to"],
        )
        for (name, to), n in sorted(self.transitions.items()):
            counter.add_metric([name, to], n)
        yield counter


def _code(error: BaseException | None) -> str | None:
    if isinstance(error, TaskError | StorageError):
        return error.code
    return None


def _storage_verdict(task: Task, error: BaseException | None) -> bool | None:
    """ok, failed, or None (storage was not what decided the attempt)."""
    if error is None:
        return True
    return False if _code(error) in STORAGE_FAILURES else None


def _generator_verdict(task: Task, error: BaseException | None) -> bool | None:
    """ok (the handler returned, or the upstream answered), failed (an upstream error), or
    None (the attempt ended before the handler decided anything)."""
    code = _code(error)
    if code in UPSTREAM_FAILURES:
        return False
    if error is None or code in UPSTREAM_ANSWERED or _past_handler(task):
        return True
    return None


def _past_handler(task: Task) -> bool:
    return str(task.status) in ("UPLOADING", "SUCCESS", "NEEDS_REVIEW")
