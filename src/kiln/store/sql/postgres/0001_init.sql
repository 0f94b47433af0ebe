-- kiln schema v1 (PostgreSQL). The same tables, columns and column order as SQLite's
-- schema after its own migrations; times are seconds since the epoch set by the engine's
-- clock, JSON documents are text written by the engine.
CREATE TABLE tasks (
    id                  text PRIMARY KEY,
    tenant              text NOT NULL,
    kind                text NOT NULL,
    status              text NOT NULL,
    priority            integer NOT NULL,
    ready_at            double precision NOT NULL,
    params              text NOT NULL,
    metadata            text NOT NULL,
    inputs              text NOT NULL,
    fingerprint         text NOT NULL,
    idempotency_key     text,
    dedup_key           text,
    attempt             integer NOT NULL DEFAULT 0,
    max_attempts        integer NOT NULL,
    epoch               integer NOT NULL DEFAULT 0,
    version             integer NOT NULL DEFAULT 1,
    lease_owner         text,
    lease_expires_at    double precision,
    state_deadline_at   double precision,
    deadline_s          double precision NOT NULL,
    deadline_at         double precision NOT NULL,
    timeouts            text NOT NULL,
    stage               text,
    progress_step       integer,
    progress_total      integer,
    progress_at         double precision,
    cancel_requested    boolean NOT NULL DEFAULT false,
    cancel_requested_at double precision,
    next_retry_at       double precision,
    result_prefix       text,
    error               text,
    result              text,
    created_at          double precision NOT NULL,
    updated_at          double precision NOT NULL,
    status_since        double precision NOT NULL,
    started_at          double precision,
    finished_at         double precision,
    -- The earliest moment the supervisor must look at the task; a sweep reads only the
    -- rows whose due_at has passed, through one index.
    due_at              double precision GENERATED ALWAYS AS (
        CASE
            WHEN status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING') THEN least(
                coalesce(lease_expires_at, deadline_at),
                coalesce(state_deadline_at, deadline_at),
                deadline_at)
            WHEN status IN ('PENDING', 'RETRYING') THEN deadline_at
        END) STORED
);

-- Listing, newest first (ids are time-ordered).
CREATE INDEX tasks_tenant_id ON tasks (tenant, id);
CREATE INDEX tasks_tenant_status_id ON tasks (tenant, status, id);
-- At most one live or successful task per (tenant, dedup key): I5.
CREATE UNIQUE INDEX tasks_dedup ON tasks (tenant, dedup_key)
    WHERE dedup_key IS NOT NULL AND status NOT IN ('FAILED', 'TIMEOUT', 'CANCELLED');
-- Claim order: priority, then the time the task became ready.
CREATE INDEX tasks_claim ON tasks (kind, priority DESC, ready_at, id)
    WHERE status IN ('PENDING', 'RETRYING');
CREATE INDEX tasks_ready ON tasks (ready_at) WHERE status IN ('PENDING', 'RETRYING');
-- Supervisor: each sweep reads only what is due.
CREATE INDEX tasks_due ON tasks (due_at) WHERE due_at IS NOT NULL;
CREATE INDEX tasks_cancel_due ON tasks (cancel_requested_at)
    WHERE cancel_requested AND status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING');
-- Cross-process progress tail.
CREATE INDEX tasks_progress ON tasks (progress_at) WHERE progress_at IS NOT NULL;

-- The log is the truth (I6): one row per status change, in the same transaction. seq is
-- handed out at insert, not at commit: readers of the tail wait out the gaps of
-- transactions still in flight (see PostgresStore.tail).
CREATE TABLE events (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id           text NOT NULL UNIQUE,
    task_id      text NOT NULL,
    tenant       text NOT NULL,
    event        text NOT NULL,
    from_status  text,
    to_status    text NOT NULL,
    final        boolean NOT NULL,
    attempt      integer NOT NULL,
    epoch        integer NOT NULL,
    error        text,
    at           double precision NOT NULL,
    dwell_s      double precision
);
CREATE INDEX events_task ON events (task_id, seq);
CREATE INDEX events_tenant ON events (tenant, seq);

-- At most one task per (tenant, idempotency key): I5.
CREATE TABLE idempotency_keys (
    tenant      text NOT NULL,
    key         text NOT NULL,
    fingerprint text NOT NULL,
    task_id     text NOT NULL,
    created_at  double precision NOT NULL,
    PRIMARY KEY (tenant, key)
);

-- Counts kept in the same transactions as the changes they count, so stats and metrics
-- never scan the task table. Each transaction adds its deltas to one of several shards
-- picked at random, so concurrent transactions rarely wait on the same counter row;
-- readers sum the shards.
CREATE TABLE task_counts (
    tenant text NOT NULL,
    status text NOT NULL,
    shard  smallint NOT NULL,
    n      bigint NOT NULL,
    PRIMARY KEY (tenant, status, shard)
);

CREATE TABLE counters (
    name   text NOT NULL,
    labels text NOT NULL,
    shard  smallint NOT NULL,
    n      bigint NOT NULL,
    PRIMARY KEY (name, labels, shard)
);

-- Leased leadership records (the supervisor), each with its own fencing epoch.
CREATE TABLE leaders (
    name       text PRIMARY KEY,
    owner      text NOT NULL,
    epoch      integer NOT NULL,
    expires_at double precision NOT NULL
);
