"""The SQL of the ``breakers`` and ``retry_clock`` tables, shared by both SQL stores.

Each statement is a template: ``{p}`` is the driver's placeholder (``?`` or ``%s``) and
``{greatest}`` the two-argument maximum (SQLite ``MAX``, PostgreSQL ``GREATEST``).
"""

from __future__ import annotations

#: Every breaker's row, by name.
BREAKERS_SQL = 'SELECT name, state, opened_until, updated_at, "by" FROM breakers ORDER BY name'

#: Insert or replace one breaker's row; ``{guard}`` is empty or :data:`SAVE_BREAKER_IF_DUE`.
#: Returns a row only when it was written.
SAVE_BREAKER_SQL = (
    'INSERT INTO breakers (name, state, opened_until, updated_at, "by")'
    " VALUES ({p}, {p}, {p}, {p}, {p})"
    " ON CONFLICT (name) DO UPDATE SET state = excluded.state,"
    " opened_until = excluded.opened_until, updated_at = excluded.updated_at,"
    ' "by" = excluded."by"{guard} RETURNING name'
)

#: The half-open probe goes to one process: the stored breaker must be open or half-open,
#: with its open period (or the previous probe's time) over.
SAVE_BREAKER_IF_DUE = (
    " WHERE breakers.state <> 'closed' AND breakers.opened_until <= excluded.updated_at"
)

#: Take the retry slot for (earliest, interval_s): the slot is max(earliest, next_at), and
#: next_at moves to slot + interval_s. Returns the slot.
RESERVE_RETRY_SQL = (
    "INSERT INTO retry_clock AS c (name, next_at) VALUES ('retries', {p} + {p})"
    " ON CONFLICT (name) DO UPDATE SET"
    " next_at = {greatest}(c.next_at, excluded.next_at - {p}) + {p}"
    " RETURNING next_at - {p}"
)
