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

-- claim_plain --
-- A claim in the default order (no claim policy, no route) as one statement
-- (kiln/store/pgclaim.py): up to :limit ready tasks of each of :kinds, locked in claim
-- order (one index range each, SKIP LOCKED); the first :limit of them claimed as
-- claim_tasks claims them (a task of an :acquire kind acquired too: two events, two
-- versions); their event rows, their counts and their counters. Each claimed row comes
-- back in claim order with the status it left, its dwell there and its events' seqs.
WITH c AS (
    SELECT t.* FROM unnest(CAST(:kinds AS text[])) AS k(kind) CROSS JOIN LATERAL (
        SELECT id, priority, ready_at, status, status_since FROM tasks
        WHERE tasks.kind = k.kind AND status IN {CLAIMABLE} AND ready_at <= :now
            AND deadline_at > :now
        ORDER BY priority DESC, ready_at, id LIMIT :limit FOR UPDATE SKIP LOCKED) AS t),
chosen AS (SELECT * FROM c ORDER BY priority DESC, ready_at, id LIMIT :limit),
u AS (
    UPDATE tasks SET
        status = CASE WHEN kind = ANY(CAST(:acquire AS text[])) THEN 'GENERATING'
            ELSE 'WAITING_FOR_RESOURCE' END,
        attempt = attempt + 1, epoch = epoch + 1,
        version = version + CASE WHEN kind = ANY(CAST(:acquire AS text[])) THEN 2 ELSE 1 END,
        lease_owner = :owner, lease_expires_at = :expires,
        state_deadline_at = :now + CASE WHEN kind = ANY(CAST(:acquire AS text[]))
            THEN {GENERATING_S} ELSE {WAITING_S} END,
        started_at = coalesce(started_at, :now),
        updated_at = :now, status_since = :now, next_retry_at = NULL, stage = NULL,
        progress_step = NULL, progress_total = NULL, progress_at = NULL,
        yield_requested_at = NULL,
        result_prefix = 'tasks/' || tasks.id || '/' || (attempt + 1) || '-' || (epoch + 1)
    FROM chosen WHERE tasks.id = chosen.id
    RETURNING tasks.*, chosen.status AS source, CAST(:now AS float8) - chosen.status_since AS dwell,
        chosen.priority AS claim_priority, chosen.ready_at AS claim_ready),
s AS (
    SELECT u.id, u.tenant, u.attempt, u.epoch, u.version, 'claim' AS event, u.source,
        'WAITING_FOR_RESOURCE' AS target, u.dwell, u.claim_priority, u.claim_ready,
        CASE WHEN u.status = 'GENERATING' THEN 1 ELSE 0 END AS back
    FROM u
    UNION ALL
    SELECT u.id, u.tenant, u.attempt, u.epoch, u.version, 'acquire', 'WAITING_FOR_RESOURCE',
        'GENERATING', 0, u.claim_priority, u.claim_ready, 0
    FROM u WHERE u.status = 'GENERATING'),
e AS (
    INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
        epoch, error, at, dwell_s)
    SELECT s.id || ':' || (s.version - s.back), s.id, s.tenant, s.event, s.source, s.target,
        false, s.attempt, s.epoch, NULL, :now, s.dwell
    FROM s ORDER BY s.claim_priority DESC, s.claim_ready, s.id, s.back DESC
    RETURNING seq, task_id),
tc AS (
    INSERT INTO task_counts (tenant, status, shard, n)
    SELECT d.tenant, d.status, :shard, sum(d.n) FROM (
        SELECT u.tenant, u.source AS status, -1 AS n FROM u
        UNION ALL SELECT u.tenant, u.status, 1 FROM u) AS d
    GROUP BY d.tenant, d.status HAVING sum(d.n) <> 0 ORDER BY d.tenant, d.status
    ON CONFLICT (tenant, status, shard) DO UPDATE SET n = task_counts.n + excluded.n),
n AS (
    INSERT INTO counters (name, labels, shard, n)
    SELECT 'transitions', s.source || '>' || s.target, :shard, count(*) FROM s
    GROUP BY s.source, s.target ORDER BY 2
    ON CONFLICT (name, labels, shard) DO UPDATE SET n = counters.n + excluded.n)
SELECT u.*, (SELECT array_agg(e.seq ORDER BY e.seq) FROM e WHERE e.task_id = u.id) FROM u
ORDER BY u.claim_priority DESC, u.claim_ready, u.id
