-- What PostgreSQL says its own way (kiln/store/queries.py renders it; see sql/queries.sql).

-- insert_events --
-- Event rows in one statement, their seqs back: arrays of (id, task_id, tenant, event,
-- from_status, to_status, final, attempt, epoch, error, at, dwell_s).
INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
    epoch, error, at, dwell_s)
SELECT * FROM unnest(?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::text[],
    ?::boolean[], ?::int[], ?::int[], ?::text[], ?::float8[], ?::float8[])
RETURNING seq, id

-- add_status_counts --
-- Deltas into one shard, rows in a fixed order: (shard, [tenants], [statuses], [deltas]).
INSERT INTO task_counts (tenant, status, shard, n)
SELECT a, b, ?, n FROM unnest(?::text[], ?::text[], ?::bigint[]) AS d(a, b, n)
ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n

-- add_counters --
-- (shard, [names], [labels], [deltas]).
INSERT INTO counters (name, labels, shard, n)
SELECT a, b, ?, n FROM unnest(?::text[], ?::text[], ?::bigint[]) AS d(a, b, n)
ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n

-- tail --
-- Events after a seq, with the snapshot they were read in (kiln/store/postgres.py, tail):
-- (after, limit).
SELECT seq, id, task_id, tenant, event, from_status, to_status, attempt, epoch, error, at,
    dwell_s, final, pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
    pg_snapshot_xmax(pg_current_snapshot())::text::bigint
FROM events WHERE seq > ? ORDER BY seq LIMIT ?

-- lock_tenant --
-- One claim at a time per capped tenant, until commit: (namespace, tenant).
SELECT pg_advisory_xact_lock(?, hashtext(?))

-- try_lock_tenant --
-- The same lock when free now (true), else nothing taken (false): (namespace, tenant).
SELECT pg_try_advisory_xact_lock(?, hashtext(?))

-- submit_rows --
-- A submission without an idempotency key, as the first part of one statement: the task
-- (unless a live or successful task holds its content) and its event. The event row reads
-- the inserted row, so the insert (and the transaction id) come before the event's seq, as
-- tail requires. kiln/store/postgres.py ends it with submit_count (alone) or not (in a
-- batch, which adds the counts once): (insert_task's parameters, submit, now).
WITH t AS (
    INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata,
        inputs, fingerprint, idempotency_key, dedup_key, max_attempts, deadline_s,
        deadline_at, timeouts, created_at, updated_at, status_since, webhook)
    VALUES (?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL
        AND status NOT IN {NOT_LIVE} DO NOTHING
    RETURNING *),
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT t.id || ':1', t.id, t.tenant, ?, NULL, 'PENDING', false, t.attempt, t.epoch,
        NULL, ?, NULL FROM t RETURNING seq)

-- submit_count --
-- The submission's count, in the same statement: (shard).
, c AS (
    INSERT INTO task_counts (tenant, status, shard, n) SELECT t.tenant, 'PENDING', ?, 1
    FROM t ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n)

-- submit_end --
SELECT t.*, (SELECT seq FROM e) FROM t

-- step_rows --
-- A worker's fenced single step, as the first part of one statement: lock and check the
-- row, update it ({sets}: the change's columns), insert its event (which reads the updated
-- row, as tail requires): (id, status, epoch, the SET parameters, event, from, to, final,
-- error, now, now).
WITH o AS (SELECT id, status_since FROM tasks WHERE id = ? AND status = ? AND epoch = ?
    FOR UPDATE),
u AS (UPDATE tasks SET {sets} FROM o WHERE tasks.id = o.id
    RETURNING tasks.*, o.status_since AS since),
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT u.id || ':' || u.version, u.id, u.tenant, ?, ?, ?, ?, u.attempt, u.epoch, ?, ?,
        ? - u.since FROM u RETURNING seq)

-- step_count --
-- The step's counts, in the same statement, rows in a fixed order within each table:
-- (shard, from, to, from>to, shard).
, tc AS (
    INSERT INTO task_counts (tenant, status, shard, n) SELECT u.tenant, d.s, ?, d.n
    FROM u, (VALUES (?::text, -1), (?::text, 1)) AS d(s, n) ORDER BY d.s
    ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n),
c AS (
    INSERT INTO counters (name, labels, shard, n) SELECT 'transitions', ?, ?, 1 FROM u
    ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n)

-- step_end --
SELECT u.*, (SELECT seq FROM e) FROM u
