-- kiln schema v14: recurring schedules (kiln/store/schedules.py). Each row is a cron
-- expression in a time zone and the submission it makes; next_at is the next tick not yet
-- handled, advanced in the same transaction as the task that tick fires (whose
-- idempotency key names the schedule and the tick), so a tick fires at most once.
CREATE TABLE schedules (
    id              TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    cron            TEXT NOT NULL,
    timezone        TEXT NOT NULL,
    submission      TEXT NOT NULL,
    overlap         TEXT NOT NULL,
    missed          TEXT NOT NULL,
    paused          INTEGER NOT NULL DEFAULT 0,
    next_at         REAL,
    last_task_id    TEXT,
    last_fired_at   REAL,
    fired           INTEGER NOT NULL DEFAULT 0,
    skipped         INTEGER NOT NULL DEFAULT 0,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX schedules_tenant ON schedules (tenant, created_at, id);
CREATE INDEX schedules_due ON schedules (next_at) WHERE paused = 0 AND next_at IS NOT NULL;
