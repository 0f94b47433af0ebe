-- Resource pools shared by every worker (see kiln/store/pools.py), and rate-limit buckets.
CREATE TABLE pools (
    name     TEXT PRIMARY KEY,
    capacity INTEGER NOT NULL
) WITHOUT ROWID;

-- One row per (pool, task) while the task waits for or holds a slot; it counts only while
-- the task is at that epoch, in WAITING_FOR_RESOURCE or GENERATING, with a live lease.
CREATE TABLE pool_slots (
    pool    TEXT NOT NULL,
    task_id TEXT NOT NULL,
    epoch   INTEGER NOT NULL,
    units   INTEGER NOT NULL,
    held    INTEGER NOT NULL,
    since   REAL NOT NULL,
    PRIMARY KEY (pool, task_id)
) WITHOUT ROWID;
CREATE INDEX pool_slots_task ON pool_slots (task_id);

-- Token buckets (submission rate limits per tenant): tokens left as of updated_at.
CREATE TABLE rate_buckets (
    name       TEXT PRIMARY KEY,
    tokens     REAL NOT NULL,
    updated_at REAL NOT NULL
) WITHOUT ROWID;

-- Claim policies (kiln/store/claims.py): each tenant's line of a kind, for fair turns and
-- running caps.
CREATE INDEX tasks_claim_tenant ON tasks (kind, tenant, priority DESC, ready_at, id)
    WHERE status IN ('PENDING', 'RETRYING');
