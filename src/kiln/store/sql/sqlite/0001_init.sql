-- kiln schema v1 (SQLite). Times are REAL seconds since the epoch, set by the engine's clock.
CREATE TABLE tasks (
    id                  TEXT PRIMARY KEY,
    tenant              TEXT NOT NULL,
    kind                TEXT NOT NULL,
    status              TEXT NOT NULL,
    priority            INTEGER NOT NULL,
    ready_at            REAL NOT NULL,
    params              TEXT NOT NULL,
    metadata            TEXT NOT NULL,
    inputs              TEXT NOT NULL,
    fingerprint         TEXT NOT NULL,
    idempotency_key     TEXT,
    dedup_key           TEXT,
    attempt             INTEGER NOT NULL DEFAULT 0,
    max_attempts        INTEGER NOT NULL,
    epoch               INTEGER NOT NULL DEFAULT 0,
    version             INTEGER NOT NULL DEFAULT 1,
    lease_owner         TEXT,
    lease_expires_at    REAL,
    state_deadline_at   REAL,
    deadline_s          REAL NOT NULL,
    deadline_at         REAL NOT NULL,
    timeouts            TEXT NOT NULL,
    stage               TEXT,
    progress_step       INTEGER,
    progress_total      INTEGER,
    progress_at         REAL,
    cancel_requested    INTEGER NOT NULL DEFAULT 0,
    cancel_requested_at REAL,
    next_retry_at       REAL,
    result_prefix       TEXT,
    error               TEXT,
    result              TEXT,
    created_at          REAL NOT NULL,
    updated_at          REAL NOT NULL,
    status_since        REAL NOT NULL,
    started_at          REAL,
    finished_at         REAL
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
CREATE INDEX tasks_lease_due ON tasks (lease_expires_at)
    WHERE status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING');
CREATE INDEX tasks_state_due ON tasks (state_deadline_at)
    WHERE status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING');
CREATE INDEX tasks_deadline_due ON tasks (deadline_at)
    WHERE status IN ('PENDING', 'RETRYING', 'WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING');
CREATE INDEX tasks_cancel_due ON tasks (cancel_requested_at)
    WHERE cancel_requested = 1 AND status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING');
-- Cross-process progress tail.
CREATE INDEX tasks_progress ON tasks (progress_at) WHERE progress_at IS NOT NULL;

-- The log is the truth (I6): one row per status change, in the same transaction.
CREATE TABLE events (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT NOT NULL UNIQUE,
    task_id      TEXT NOT NULL,
    tenant       TEXT NOT NULL,
    event        TEXT NOT NULL,
    from_status  TEXT,
    to_status    TEXT NOT NULL,
    final        INTEGER NOT NULL,
    attempt      INTEGER NOT NULL,
    epoch        INTEGER NOT NULL,
    error        TEXT,
    at           REAL NOT NULL,
    dwell_s      REAL
);
CREATE INDEX events_task ON events (task_id, seq);
CREATE INDEX events_tenant ON events (tenant, seq);
CREATE INDEX events_dwell ON events (from_status, seq);

-- At most one task per (tenant, idempotency key): I5.
CREATE TABLE idempotency_keys (
    tenant      TEXT NOT NULL,
    key         TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    task_id     TEXT NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (tenant, key)
) WITHOUT ROWID;

-- Counts kept in the same transactions as the changes they count, so stats and metrics
-- never scan the task table.
CREATE TABLE task_counts (
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,
    n      INTEGER NOT NULL,
    PRIMARY KEY (tenant, status)
) WITHOUT ROWID;

CREATE TABLE counters (
    name   TEXT NOT NULL,
    labels TEXT NOT NULL,
    n      INTEGER NOT NULL,
    PRIMARY KEY (name, labels)
) WITHOUT ROWID;

-- Leased leadership records (the supervisor), each with its own fencing epoch.
CREATE TABLE leaders (
    name       TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    epoch      INTEGER NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
