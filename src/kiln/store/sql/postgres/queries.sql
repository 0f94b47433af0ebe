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

-- step_lock --
-- PostgreSQL's one statement of workers' plain steps (kiln/store/pgstep.py builds it from
-- one description, for one step or many): the relation d holds the steps' values, one
-- row each (k_n: its place), named as the description names them. The rows that still
-- match are locked in id order (the one lock order) ...
o AS (SELECT tasks.id, tasks.status_since, d.k_n FROM tasks JOIN d ON tasks.id = d.k_id
    AND tasks.status = d.k_status AND tasks.epoch = d.k_epoch ORDER BY tasks.id
    FOR UPDATE OF tasks)

-- step_events --
-- ... updated (u), and their event rows inserted, reading the updated rows (so each
-- transaction id comes before its seq, as tail requires).
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT u.id || ':' || u.version, u.id, u.tenant, d.k_event, d.k_from, d.k_to, d.k_final,
        u.attempt, u.epoch, d.k_error, d.k_at, d.k_at - u.since
    FROM u JOIN d ON d.k_n = u.k_n ORDER BY u.k_n RETURNING seq, task_id)

-- step_events_chained --
-- ... the same for steps of two events (generated, then uploaded: nothing acts between
-- them): each row's two event rows, numbered up to its new version, the second leaving a
-- status it held for no time, as the row path numbers them (kiln/store/sqlstore.py).
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT u.id || ':' || (u.version - s.back), u.id, u.tenant, s.event, s.source, s.target,
        s.final, u.attempt, u.epoch, d.k_error, d.k_at, s.dwell
    FROM u JOIN d ON d.k_n = u.k_n CROSS JOIN LATERAL (VALUES
        (1, d.k_event, d.k_from, d.k_to, d.k_final, d.k_at - u.since),
        (0, d.k_event2, d.k_to, d.k_to2, d.k_final2, 0::double precision))
        AS s(back, event, source, target, final, dwell)
    ORDER BY u.k_n, s.back DESC RETURNING seq, task_id)

-- step_ended --
-- The attempts the steps end, as the ledger's row reads them (usage_row, which follows
-- as the CTE g): the step's own dwell is its own (a statement does not see its own
-- event row).
ended AS (
    SELECT u.id AS task_id, u.attempt AS attempt, u.epoch AS epoch, u.tenant AS tenant,
        u.kind AS kind, u.model AS model, d.k_pool AS pool, d.k_worker AS worker,
        d.k_outcome AS outcome, d.k_from AS source, d.k_at - u.since AS dwell_s,
        d.k_loading AS loading_s, d.k_share AS share, d.k_at AS ended_at
    FROM u JOIN d ON d.k_n = u.k_n)

-- step_counts --
-- A step written alone adds its own counts (a write batch adds them once for all), rows
-- in a fixed order within each table: (shard).
tc AS (
    INSERT INTO task_counts (tenant, status, shard, n)
    SELECT u.tenant, s.status, :shard, s.n
    FROM u JOIN d ON d.k_n = u.k_n CROSS JOIN LATERAL (VALUES (d.k_from, -1), (d.k_to, 1))
        AS s(status, n)
    ORDER BY s.status
    ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n),
c AS (
    INSERT INTO counters (name, labels, shard, n)
    SELECT 'transitions', d.k_from || '>' || d.k_to, :shard, 1 FROM u JOIN d ON d.k_n = u.k_n
    ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n)

-- step_counts_chained --
-- ... and for steps of two events: the status left and the one reached, and each event's
-- transition.
tc AS (
    INSERT INTO task_counts (tenant, status, shard, n)
    SELECT u.tenant, s.status, :shard, s.n
    FROM u JOIN d ON d.k_n = u.k_n CROSS JOIN LATERAL (VALUES (d.k_from, -1), (d.k_to2, 1))
        AS s(status, n)
    ORDER BY s.status
    ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n),
c AS (
    INSERT INTO counters (name, labels, shard, n)
    SELECT 'transitions', s.labels, :shard, 1
    FROM u JOIN d ON d.k_n = u.k_n CROSS JOIN LATERAL (VALUES (d.k_from || '>' || d.k_to),
        (d.k_to || '>' || d.k_to2)) AS s(labels)
    ORDER BY s.labels
    ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n)

-- step_end --
-- Each updated row comes back with its place in d and its event's seq.
SELECT u.*, e.seq FROM u JOIN e ON e.task_id = u.id

-- step_end_chained --
-- ... or with its two events' seqs, in order, as an array.
SELECT u.*, (SELECT array_agg(e.seq ORDER BY e.seq) FROM e WHERE e.task_id = u.id) FROM u

-- submit_many --
-- Submissions without an idempotency key as one statement over arrays, in a batch (which
-- adds the counts): kiln/store/pgbatch.py puts before it the relation d of their values
-- (insert_task's parameters as k_<name>, k_event, k_at; k_n: the place). A content
-- already live or done (by another submission of this statement too) inserts nothing;
-- each inserted task comes back with its place in the arrays and its event's seq.
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
