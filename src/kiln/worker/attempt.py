"""The records a worker keeps of its claimed work: an :class:`Attempt`, and a
:class:`Batch` of them (a batching kind)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kiln.kinds import HandlerResult, TaskKind
from kiln.models import StoredOutput, Task
from kiln.store import Progress
from kiln.store.pools import PoolWait


@dataclass
class Attempt:
    """One claimed attempt as its worker sees it: the fenced view of the task."""

    task: Task
    kind: TaskKind
    #: What the attempt takes of each pool (the kind's resources, its own amounts).
    needs: dict[str, int] = field(default_factory=dict)
    #: The shared pools it takes, as the ledger names them (a batch member's own, too).
    pools: str = ""
    runner: asyncio.Task[None] | None = None
    pipeline: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    ended: bool = False
    progress: Progress | None = None
    progress_saved_at: float = 0.0
    progress_dirty: bool = False
    outputs: list[StoredOutput] = field(default_factory=list)
    #: Where the task waits in a shared pool's line (None: not waiting for one).
    pool_wait: PoolWait | None = None
    #: Done generating: it holds (and waits for) no pool slot any more.
    past_pools: bool = False
    pool_wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the attempt is halted (``stop_reason`` given): ``Context.stopped``.
    halted: asyncio.Event = field(default_factory=asyncio.Event)
    #: The batch it runs in (a batching kind), and what the batch's call made of it.
    batch: Batch | None = None
    outcome: asyncio.Future[HandlerResult | BaseException] | None = None
    #: Seconds this attempt spent loading models (``ctx.loading_model``), for the ledger.
    loading_s: float = 0.0
    #: Those loads as (model, started, ended) on the store's clock, for its trace spans.
    loads: list[tuple[str, float, float]] = field(default_factory=list)
    #: Its share of the call that generated it (1/n of a batch of n), for the ledger.
    share: float = 1.0
    #: The leading supervisor asked it to yield its slot (its heartbeat said so).
    yield_requested: bool = False


@dataclass(eq=False)
class Batch:
    """One call of a batching kind's handler over several claimed tasks, its members.

    The batch fills (more tasks of its key, for at most the policy's wait), then takes
    its resources once for all (this process's slots; the shared pools' units of every
    member, held through its first live member, the leader), lets each member record its
    ``acquire``, calls the handler with the members still running, and hands each its
    outcome. Everything after the call (``generated``, upload, verification, the final
    transition, a retry) is each member's own, as for a task alone.
    """

    kind: TaskKind
    key: str
    members: list[Attempt] = field(default_factory=list)
    #: The members that recorded their ``acquire`` and wait for the call, with params.
    ready: dict[str, Any] = field(default_factory=dict)
    leader: Attempt | None = None
    #: Set when the batch holds its resources: its members acquire then.
    acquired: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set whenever a member became ready or ended: the runner counts again.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the call is over and the batch gave its own resources back.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None

    def live(self) -> list[Attempt]:
        return [m for m in self.members if not m.ended and m.stop_reason is None]

    def settled(self) -> bool:
        """Every member is ready for the call or gone."""
        return all(m.task.id in self.ready or m.ended or m.stop_reason for m in self.members)


def asked_to_yield(attempt: Attempt) -> bool:
    """Whether ``attempt`` was asked to yield its pool slot (its own heartbeat said so, or
    its batch's slot holder's did); see :meth:`kiln.worker.Context.should_yield`."""
    if attempt.yield_requested:
        return True
    leader = attempt.batch.leader if attempt.batch is not None else None
    return leader is not None and leader.yield_requested


def ids(attempt: Attempt) -> dict[str, Any]:
    """The attempt's ids, as its log lines carry them."""
    task = attempt.task
    return {"task_id": task.id, "attempt": task.attempt, "epoch": task.epoch}
