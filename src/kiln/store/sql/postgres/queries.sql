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

-- submit_one --
-- A submission without an idempotency key in one statement: the task (unless a live or
-- successful task holds its content), its event and its count. The event row reads the
-- inserted row, so the insert (and the transaction id) come before the event's seq, as
-- tail requires: (insert_task's parameters, submit, now, shard).
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
        NULL, ?, NULL FROM t RETURNING seq),
c AS (
    INSERT INTO task_counts (tenant, status, shard, n) SELECT t.tenant, 'PENDING', ?, 1
    FROM t ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n)
SELECT t.*, (SELECT seq FROM e) FROM t

-- one_step --
-- A worker's fenced single step in one statement: lock and check the row, update it
-- ({sets}: the change's columns), insert its event and add the counts (rows in a fixed
-- order within each table): (id, status, epoch, the SET parameters, event, from, to,
-- final, error, now, now, shard, from, to, from>to, shard).
WITH o AS (SELECT id, status_since FROM tasks WHERE id = ? AND status = ? AND epoch = ?
    FOR UPDATE),
u AS (UPDATE tasks SET {sets} FROM o WHERE tasks.id = o.id
    RETURNING tasks.*, o.status_since AS since),
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT u.id || ':' || u.version, u.id, u.tenant, ?, ?, ?, ?, u.attempt, u.epoch, ?, ?,
        ? - u.since FROM u RETURNING seq),
tc AS (
    INSERT INTO task_counts (tenant, status, shard, n) SELECT u.tenant, d.s, ?, d.n
    FROM u, (VALUES (?::text, -1), (?::text, 1)) AS d(s, n) ORDER BY d.s
    ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n),
c AS (
    INSERT INTO counters (name, labels, shard, n) SELECT 'transitions', ?, ?, 1 FROM u
    ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n)
SELECT u.*, (SELECT seq FROM e) FROM u

-- submit_bare --
-- submit_one without its count, for a batch of statements (kiln/store/postgres.py,
-- _Batch) that adds its counts once, in a fixed order, at the end: (insert_task's
-- parameters, submit, now).
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
SELECT t.*, (SELECT seq FROM e) FROM t

-- step_bare --
-- one_step without its counts, for a batch: (id, status, epoch, the SET parameters,
-- event, from, to, final, error, now, now).
WITH o AS (SELECT id, status_since FROM tasks WHERE id = ? AND status = ? AND epoch = ?
    FOR UPDATE),
u AS (UPDATE tasks SET {sets} FROM o WHERE tasks.id = o.id
    RETURNING tasks.*, o.status_since AS since),
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT u.id || ':' || u.version, u.id, u.tenant, ?, ?, ?, ?, u.attempt, u.epoch, ?, ?,
        ? - u.since FROM u RETURNING seq)
SELECT u.*, (SELECT seq FROM e) FROM u
