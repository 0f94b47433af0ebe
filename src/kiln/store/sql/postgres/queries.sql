-- What PostgreSQL says its own way (kiln/store/queries.py renders it; see sql/queries.sql).

-- insert_events --
-- Event rows in one statement, their seqs back: arrays of (id, task_id, tenant, event,
-- from_status, to_status, final, attempt, epoch, error, at, dwell_s, loading_s).
INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
    epoch, error, at, dwell_s, loading_s)
SELECT * FROM unnest(?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::text[],
    ?::boolean[], ?::int[], ?::int[], ?::text[], ?::float8[], ?::float8[], ?::float8[])
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
    dwell_s, final, loading_s, pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
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
        deadline_at, timeouts, created_at, updated_at, status_since, webhook, model,
        batch_key, rerun_of, pipeline_id, step, step_copy)
    VALUES (?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL
        AND status NOT IN {ENDED_UNSUCCESSFULLY} DO NOTHING
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

-- step_usage --
-- The ledger row of the attempt the step ends (see record_usage), in the same statement:
-- the event rows of earlier statements give the seconds waiting and generating, and the
-- step's own dwell is added (a statement does not see its own event row): (pool, worker,
-- outcome, from, now, loading_s, from, now, share, now).
, g AS (
    INSERT INTO usage_ledger (task_id, attempt, epoch, tenant, kind, model, pool, worker,
        outcome, waiting_s, loading_s, generating_s, share, ended_at)
    SELECT u.id, u.attempt, u.epoch, u.tenant, u.kind, u.model, coalesce(?::text, ''),
        ?::text, ?::text,
        coalesce((SELECT sum(v.dwell_s) FROM events v WHERE v.task_id = u.id
            AND v.attempt = u.attempt AND v.epoch = u.epoch
            AND v.from_status = 'WAITING_FOR_RESOURCE'), 0)
            + CASE WHEN ?::text = 'WAITING_FOR_RESOURCE' THEN ?::float8 - u.since ELSE 0 END,
        ?::float8,
        coalesce((SELECT sum(v.dwell_s) FROM events v WHERE v.task_id = u.id
            AND v.attempt = u.attempt AND v.epoch = u.epoch
            AND v.from_status = 'GENERATING'), 0)
            + CASE WHEN ?::text = 'GENERATING' THEN ?::float8 - u.since ELSE 0 END,
        ?::float8, ?::float8
    FROM u ON CONFLICT (task_id, attempt, epoch) DO NOTHING)

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

-- step_many --
-- Workers' plain steps of one shape (the same columns set) as one statement over arrays,
-- in a batch (which adds the counts): kiln/store/postgres.py renders {arrays} (the typed
-- arrays of id, status, epoch, {values}, event, from, to, final, error, now), {values}
-- (the SET values' names) and {sets} (the change's columns = d.k_v1, ...); steps that
-- end their attempts add {usage_columns} (the arrays of pool, worker, outcome, loading_s,
-- share) and {usage} (step_many_usage), else both are empty. Rows are locked and checked
-- in id order, updated, and their events inserted (reading the updated rows, as tail
-- requires); each updated row comes back with its place in the arrays and its event's seq.
WITH d AS (SELECT * FROM unnest({arrays}) WITH ORDINALITY AS d(k_id, k_status, k_epoch,
    {values}, k_event, k_from, k_to, k_final, k_error, k_at{usage_columns}, k_n)),
o AS (SELECT tasks.id, tasks.status_since, d.k_n FROM tasks JOIN d ON tasks.id = d.k_id
    AND tasks.status = d.k_status AND tasks.epoch = d.k_epoch ORDER BY tasks.id
    FOR UPDATE OF tasks),
u AS (UPDATE tasks SET {sets} FROM o JOIN d ON d.k_n = o.k_n WHERE tasks.id = o.id
    RETURNING tasks.*, o.status_since AS since, d.k_n),
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT u.id || ':' || u.version, u.id, u.tenant, d.k_event, d.k_from, d.k_to, d.k_final,
        u.attempt, u.epoch, d.k_error, d.k_at, d.k_at - u.since
    FROM u JOIN d ON d.k_n = u.k_n ORDER BY u.k_n RETURNING seq, task_id){usage}
SELECT u.*, e.seq FROM u JOIN e ON e.task_id = u.id

-- step_many_usage --
-- The ledger rows of the attempts that step_many's steps end (see step_usage), in the
-- same statement.
, g AS (
    INSERT INTO usage_ledger (task_id, attempt, epoch, tenant, kind, model, pool, worker,
        outcome, waiting_s, loading_s, generating_s, share, ended_at)
    SELECT u.id, u.attempt, u.epoch, u.tenant, u.kind, u.model, coalesce(d.k_pool, ''),
        d.k_worker, d.k_outcome,
        coalesce((SELECT sum(v.dwell_s) FROM events v WHERE v.task_id = u.id
            AND v.attempt = u.attempt AND v.epoch = u.epoch
            AND v.from_status = 'WAITING_FOR_RESOURCE'), 0)
            + CASE WHEN d.k_from = 'WAITING_FOR_RESOURCE' THEN d.k_at - u.since ELSE 0 END,
        d.k_loading,
        coalesce((SELECT sum(v.dwell_s) FROM events v WHERE v.task_id = u.id
            AND v.attempt = u.attempt AND v.epoch = u.epoch
            AND v.from_status = 'GENERATING'), 0)
            + CASE WHEN d.k_from = 'GENERATING' THEN d.k_at - u.since ELSE 0 END,
        d.k_share, d.k_at
    FROM u JOIN d ON d.k_n = u.k_n ON CONFLICT (task_id, attempt, epoch) DO NOTHING)

-- submit_many --
-- Submissions without an idempotency key as one statement over arrays, in a batch (which
-- adds the counts): kiln/store/postgres.py renders {arrays}, the typed arrays of
-- (insert_task's parameters, submit, now). A content already live or done (by another
-- submission of this statement too) inserts nothing; each inserted task comes back with
-- its place in the arrays and its event's seq.
WITH d AS (SELECT * FROM unnest({arrays}) WITH ORDINALITY AS d(k_id, k_tenant, k_kind,
    k_priority, k_ready_at, k_params, k_metadata, k_inputs, k_fingerprint,
    k_idempotency_key, k_dedup_key, k_max_attempts, k_deadline_s, k_deadline_at,
    k_timeouts, k_created_at, k_updated_at, k_status_since, k_webhook, k_model,
    k_batch_key, k_rerun_of, k_pipeline_id, k_step, k_step_copy, k_event, k_at, k_n)),
t AS (
    INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata,
        inputs, fingerprint, idempotency_key, dedup_key, max_attempts, deadline_s,
        deadline_at, timeouts, created_at, updated_at, status_since, webhook, model,
        batch_key, rerun_of, pipeline_id, step, step_copy)
    SELECT k_id, k_tenant, k_kind, 'PENDING', k_priority, k_ready_at, k_params, k_metadata,
        k_inputs, k_fingerprint, k_idempotency_key, k_dedup_key, k_max_attempts,
        k_deadline_s, k_deadline_at, k_timeouts, k_created_at, k_updated_at,
        k_status_since, k_webhook, k_model, k_batch_key, k_rerun_of, k_pipeline_id, k_step,
        k_step_copy
    FROM d ORDER BY k_n
    ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL
        AND status NOT IN {ENDED_UNSUCCESSFULLY} DO NOTHING
    RETURNING *),
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT t.id || ':1', t.id, t.tenant, d.k_event, NULL, 'PENDING', false, t.attempt,
        t.epoch, NULL, d.k_at, NULL FROM t JOIN d ON d.k_id = t.id ORDER BY d.k_n
    RETURNING seq, task_id)
SELECT t.*, d.k_n, e.seq FROM t JOIN d ON d.k_id = t.id JOIN e ON e.task_id = t.id
