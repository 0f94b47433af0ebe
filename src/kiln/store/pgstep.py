"""PostgreSQL's one statement of a worker's plain step, for one step or many.

A plain step (a fenced step of one event, or of two: ``generated`` then ``uploaded``, whose
effects the statement can write itself: see
``PostgresStore._apply_in_one_statement``) is described once, as named values
(:func:`step_values`) and a :class:`StepShape` (the columns it sets, whether it ends its
attempt). The statement is built from that description alone: the values become the
relation ``d``, one row per step (typed arrays of many steps, or one step's typed
values), passed as named parameters (psycopg's ``%(name)s``), so one step and a write
batch's many steps of one shape run the same statement around it (``step_lock``,
``step_events``, ``step_ended`` with the ledger's ``usage_row``, ``step_counts``,
``step_end`` in sql/postgres/queries.sql).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.states import FINAL
from kiln.store.pgtx import Q
from kiln.store.records import AttemptUsage, Change
from kiln.store.rows import dumps

#: What a step's statement matches: the row's id, status and epoch.
MATCH = (("k_id", "text"), ("k_status", "text"), ("k_epoch", "epoch"))
#: What its event row takes besides the updated row.
LOGGED = (
    ("k_event", "text"),
    ("k_from", "text"),
    ("k_to", "text"),
    ("k_final", "boolean"),
    ("k_error", "text"),
    ("k_at", "double precision"),
)
#: What a step of two events adds: the second event and the status it reaches.
CHAINED = (("k_event2", "text"), ("k_to2", "text"), ("k_final2", "boolean"))
#: What a step that ends its attempt adds: its row of the ledger (``step_ended``).
LEDGER = (
    ("k_pool", "text"),
    ("k_worker", "text"),
    ("k_outcome", "text"),
    ("k_loading", "double precision"),
    ("k_share", "double precision"),
)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the steps that share one statement have in common: the columns they set, in
    order (``(column, added)``: ``added`` sets ``column + value``), whether they end
    their attempts (the ledger's row goes with each), whether each is two events
    (``chained``: ``generated`` then ``uploaded``), and whether the statement adds its own
    counts (a step written alone; a write batch adds them once for all)."""

    sets: tuple[tuple[str, bool], ...]
    ledger: bool
    chained: bool = False
    counted: bool = False

    def alone(self) -> StepShape:
        return StepShape(self.sets, self.ledger, self.chained, counted=True)

    def named(self) -> list[tuple[str, str]]:
        """The steps' values by name, with each one's type (a tasks column's name stands
        for that column's type)."""
        sets = [(f"s_{column}", column) for column, _ in self.sets]
        chained = CHAINED if self.chained else ()
        return [*MATCH, *sets, *LOGGED, *chained, *(LEDGER if self.ledger else ())]


def step_values(
    change: Change, sets: Sequence[tuple[str, Any, bool]], usage: AttemptUsage | None, now: float
) -> dict[str, Any]:
    """One step's named values (``update_sets`` gives ``sets``); a step of two events
    (:data:`CHAINED`) is final only at its second."""
    (event, target), source = change.steps[0], change.expect_status
    values: dict[str, Any] = {
        "k_id": change.task_id,
        "k_status": str(source),
        "k_epoch": change.expect_epoch,
    }
    values.update((f"s_{column}", value) for column, value, _ in sets)
    values.update(
        k_event=str(event),
        k_from=str(source),
        k_to=str(target),
        k_final=len(change.steps) == 1 and target in FINAL,
        k_error=dumps(change.error),
        k_at=now,
    )
    if len(change.steps) == 2:
        event2, target2 = change.steps[1]
        values.update(k_event2=str(event2), k_to2=str(target2), k_final2=target2 in FINAL)
    if usage is not None:
        values.update(
            k_pool=usage.pool,
            k_worker=usage.worker,
            k_outcome=usage.outcome,
            k_loading=usage.loading_s,
            k_share=usage.share,
        )
    return values


def step_sql(shape: StepShape, types: Mapping[str, str], *, many: bool) -> str:
    """The statement of the steps of ``shape`` (``types``: the tasks table's columns):
    ``many`` steps' values as typed arrays cast from text (:func:`arrays_of`), or one
    step's as typed values (a value its column takes only by an assignment's rounding,
    1.5 for an integer, is taken as a statement of its own always took it)."""
    named = [(name, types.get(kind, kind)) for name, kind in shape.named()]
    if many:
        arrays = ", ".join(f"%({name})s::text[]::{kind}[]" for name, kind in named)
        columns = ", ".join(name for name, _ in named)
        rows = f"SELECT * FROM unnest({arrays}) WITH ORDINALITY AS d({columns}, k_n)"
    else:
        values = ", ".join(f"%({name})s::{kind} AS {name}" for name, kind in named)
        rows = f"SELECT {values}, 1::bigint AS k_n"
    sets = ", ".join(
        f"{column} = {column} + d.s_{column}" if added else f"{column} = d.s_{column}"
        for column, added in shape.sets
    )
    chained = shape.chained
    parts = [
        f"WITH d AS ({rows})",
        Q.step_lock,
        f"u AS (UPDATE tasks SET {sets} FROM o JOIN d ON d.k_n = o.k_n WHERE tasks.id = o.id"
        " RETURNING tasks.*, o.status_since AS since, d.k_n)",
        Q.step_events_chained if chained else Q.step_events,
    ]
    if shape.ledger:
        parts += [Q.step_ended, f"g AS ({Q.usage_row})"]
    if shape.counted:
        parts.append(Q.step_counts_chained if chained else Q.step_counts)
    return ", ".join(parts) + " " + (Q.step_end_chained if chained else Q.step_end)


def arrays_of(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str | None]]:
    """The named parameters of a statement over arrays: each value's column, as text."""
    return {name: [as_text(row[name]) for row in rows] for name in rows[0]}


def as_text(value: Any) -> str | None:
    """A value as the text PostgreSQL parses back to it (the arrays are cast from text)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # an int, or a float's shortest exact form
