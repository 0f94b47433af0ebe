"""The effects a feature adds to a status change, in the change's transaction.

A change (:class:`~kiln.store.records.Change`) is its row's compare-and-set and its event
rows; everything else a status change does is an :class:`~kiln.store.records.Effect` it
carries, written here once over :class:`~kiln.store.tx.Tx` for both drivers, the way a
middleware hooks a job without touching the core. The engine's contributions
(:mod:`kiln.contributions`) decide which effects a change carries; the store runs them
(``TaskOps._apply``), the :data:`STANDING` ones for every change.

A feature that needs a new effect adds a class here (and a contribution that adds it to
the changes it concerns); neither ``Change`` nor ``Engine.apply`` grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

from kiln.states import CLAIMABLE, FINAL
from kiln.store import pipelines
from kiln.store.queries import queries
from kiln.store.records import Applied, AttemptUsage, Change, Effect
from kiln.store.tx import EventRow, Ops, Tx
from kiln.store.usage import ledger_values

#: A counter to add to: ``(name, labels)``.
Count = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Ledger(Effect):
    """The attempt the change ends gets its row of the GPU-second ledger
    (:mod:`kiln.store.usage`), before the change's own event rows (the row adds the ending
    step's dwell itself). PostgreSQL's one-statement path writes it in its statement."""

    usage: AttemptUsage
    in_statement: ClassVar[bool] = True

    async def before_events(self, ops: Ops, tx: Tx, applied: Applied) -> None:
        await tx.run(USAGE_ROW[ops.q.dialect], ledger_values(self.usage, applied))


def _usage_row(dialect: str) -> str:
    q = queries(dialect)
    return f"WITH ended AS ({q.usage_ended}) {q.usage_row}"


#: The ledger's row on the row path, by dialect: ``usage_row`` over ``usage_ended``.
USAGE_ROW = {dialect: _usage_row(dialect) for dialect in ("sqlite", "postgres")}


@dataclass(frozen=True, slots=True)
class Loaded(Effect):
    """The seconds the attempt spent loading models in GENERATING, on the event row of
    the step that leaves it."""

    seconds: float

    def amend(self, rows: list[EventRow]) -> None:
        rows[0].loading_s = self.seconds


@dataclass(frozen=True, slots=True)
class Counted(Effect):
    """Counters to add to in the change's transaction (failures, recoveries, ...)."""

    counts: tuple[Count, ...]

    async def after(self, ops: Ops, tx: Tx, applied: Applied) -> None:
        for name, labels in self.counts:
            tx.bump(name, labels)


@dataclass(frozen=True, slots=True)
class PipelineStep(Effect):
    """A step of a pipeline reaches a final status: its pipeline advances in the same
    transaction (:mod:`kiln.store.pipelines`). One lock order everywhere: the pipeline's
    row first, then its steps, or fan-outs deadlock."""

    pipeline_id: str

    def needed(self, change: Change) -> bool:
        return change.target in FINAL

    async def lock(self, ops: Ops, tx: Tx, change: Change) -> None:
        await tx.one(ops.q.lock_task, (self.pipeline_id,))

    async def after(self, ops: Ops, tx: Tx, applied: Applied) -> None:
        host = cast(pipelines.Host, ops)  # the store's TaskOps
        await pipelines.step_ended(host, tx, applied.task, applied.change.steps[-1][0])


class NotifyReady(Effect):
    """A change that makes its task claimable tells idle workers elsewhere."""

    __slots__ = ()

    def needed(self, change: Change) -> bool:
        return change.target in CLAIMABLE

    async def after(self, ops: Ops, tx: Tx, applied: Applied) -> None:
        await tx.notify_ready()


#: The effects every change has, each when :meth:`~kiln.store.records.Effect.needed`.
STANDING: tuple[Effect, ...] = (NotifyReady(),)


def effects_of(change: Change) -> list[Effect]:
    """The effects ``change`` takes: the standing ones, then its own, those needed."""
    return [effect for effect in (*STANDING, *change.effects) if effect.needed(change)]
