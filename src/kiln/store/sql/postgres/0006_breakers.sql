-- kiln schema v6 (PostgreSQL): circuit breakers shared by every process, and the cluster's
-- retry clock. One row per breaker (an upstream dependency: a generator backend, the
-- storage), written only when its state changes; workers read the whole table every second
-- or so.
CREATE TABLE breakers (
    name         text PRIMARY KEY,
    state        text NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    opened_until double precision,
    updated_at   double precision NOT NULL,
    "by"         text NOT NULL
);
-- The next free retry slot (KILN_RETRY_RATE): each scheduled retry takes one and moves it on.
CREATE TABLE retry_clock (
    name    text PRIMARY KEY,
    next_at double precision NOT NULL
);
