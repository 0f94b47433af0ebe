-- kiln schema v11: recurring schedules (kiln/store/schedules.py). Each row is a cron
-- expression in a time zone and the submission it makes; next_at is the next tick not yet
-- handled, advanced in the same transaction as the task that tick fires (whose
-- idempotency key names the schedule and the tick), so a tick fires at most once.
CREATE TABLE schedules (
    id              text PRIMARY KEY,
    tenant          text NOT NULL,
    cron            text NOT NULL,
    timezone        text NOT NULL,
    submission      text NOT NULL,
    overlap         text NOT NULL,
    missed          text NOT NULL,
    paused          boolean NOT NULL DEFAULT false,
    next_at         double precision,
    last_task_id    text,
    last_fired_at   double precision,
    fired           integer NOT NULL DEFAULT 0,
    skipped         integer NOT NULL DEFAULT 0,
    created_at      double precision NOT NULL,
    updated_at      double precision NOT NULL
);
CREATE INDEX schedules_tenant ON schedules (tenant, created_at, id);
CREATE INDEX schedules_due ON schedules (next_at) WHERE NOT paused AND next_at IS NOT NULL;
