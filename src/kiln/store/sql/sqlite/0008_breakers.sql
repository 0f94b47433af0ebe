-- kiln schema v8: circuit breakers shared by every process, and the cluster's retry clock.
-- One row per breaker (an upstream dependency: a generator backend, the storage), written
-- only when its state changes; workers read the whole table every second or so.
CREATE TABLE breakers (
    name         TEXT PRIMARY KEY,
    state        TEXT NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    opened_until REAL,
    updated_at   REAL NOT NULL,
    "by"         TEXT NOT NULL
) WITHOUT ROWID;
-- The next free retry slot (KILN_RETRY_RATE): each scheduled retry takes one and moves it on.
CREATE TABLE retry_clock (
    name    TEXT PRIMARY KEY,
    next_at REAL NOT NULL
) WITHOUT ROWID;
