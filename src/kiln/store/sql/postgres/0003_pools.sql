-- Resource pools shared by every worker (see kiln/store/pools.py), and rate-limit buckets.
CREATE TABLE pools (
    name     text PRIMARY KEY,
    capacity integer NOT NULL
);

-- One row per (pool, task) while the task waits for or holds a slot; it counts only while
-- the task is at that epoch, in WAITING_FOR_RESOURCE or GENERATING, with a live lease.
CREATE TABLE pool_slots (
    pool    text NOT NULL,
    task_id text NOT NULL,
    epoch   integer NOT NULL,
    units   integer NOT NULL,
    held    boolean NOT NULL,
    since   double precision NOT NULL,
    PRIMARY KEY (pool, task_id)
);
CREATE INDEX pool_slots_task ON pool_slots (task_id);

-- Token buckets (submission rate limits per tenant): tokens left as of updated_at.
CREATE TABLE rate_buckets (
    name       text PRIMARY KEY,
    tokens     double precision NOT NULL,
    updated_at double precision NOT NULL
);

-- Claim policies (kiln/store/claims.py): each tenant's line of a kind, for fair turns and
-- running caps.
CREATE INDEX tasks_claim_tenant ON tasks (kind, tenant, priority DESC, ready_at, id)
    WHERE status IN ('PENDING', 'RETRYING');
