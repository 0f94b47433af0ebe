-- The store's SQL for both dialects (kiln/store/queries.py renders it): parameters are
-- written ?, {TOKENS} are status sets from kiln/states.py and the words the dialects spell
-- differently. Each query says its parameters in order.

-- tasks ---------------------------------------------------------------------------------

-- get_task --
-- A task: (id).
SELECT * FROM tasks WHERE id = ?

-- get_tasks --
-- Tasks by id: ([ids]).
SELECT * FROM tasks WHERE id {IN_LIST}

-- lock_task --
-- What a change checks before it writes, locked until commit: (id).
SELECT status, epoch, version, status_since, tenant, attempt, cancel_requested FROM tasks
WHERE id = ?
{FOR_UPDATE}

-- insert_task --
-- A new PENDING task, unless a live or successful task holds its content (then no row):
-- (id, tenant, kind, priority, ready_at, params, metadata, inputs, fingerprint,
-- idempotency_key, dedup_key, max_attempts, deadline_s, deadline_at, timeouts,
-- created_at, updated_at, status_since, webhook, model, batch_key, rerun_of, pipeline_id,
-- step, step_copy).
INSERT INTO tasks (id, tenant, kind, status, priority, ready_at, params, metadata, inputs,
    fingerprint, idempotency_key, dedup_key, max_attempts, deadline_s, deadline_at,
    timeouts, created_at, updated_at, status_since, webhook, model, batch_key, rerun_of,
    pipeline_id, step, step_copy)
VALUES (?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL AND status NOT IN {ENDED_UNSUCCESSFULLY}
DO NOTHING RETURNING *

-- pipeline_progress --
-- A running pipeline's map of steps and how many succeeded (docs/pipelines.md):
-- (result, step, total, now, now, id).
UPDATE tasks SET result = ?, progress_step = ?, progress_total = ?, progress_at = ?,
    updated_at = ?
WHERE id = ? RETURNING *

-- keep_running --
-- A retried pipeline's step no longer asked to stop, running or sent back to the queue
-- meanwhile (an expire decided before the stop was asked): (now, id).
UPDATE tasks SET cancel_requested = {FALSE}, cancel_requested_at = NULL, updated_at = ?
WHERE id = ? AND status NOT IN {FINAL}

-- dedup_lookup --
-- The live or successful task holding a dedup key: (tenant, dedup_key).
SELECT * FROM tasks WHERE tenant = ? AND dedup_key = ? AND status NOT IN {ENDED_UNSUCCESSFULLY}

-- dedup_lookup_many --
-- The live or successful tasks holding any of several dedup keys: (tenant, [dedup_key]).
SELECT * FROM tasks
WHERE tenant = ? AND dedup_key {IN_LIST} AND status NOT IN {ENDED_UNSUCCESSFULLY}

-- claim_key --
-- Take an idempotency key for a new task; no row when the key exists:
-- (tenant, key, fingerprint, task_id, created_at).
INSERT INTO idempotency_keys (tenant, key, fingerprint, task_id, created_at)
VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, key) DO NOTHING RETURNING 1

-- read_key --
-- An idempotency key's request and task, locked: (tenant, key).
SELECT fingerprint, task_id FROM idempotency_keys WHERE tenant = ? AND key = ? {FOR_UPDATE}

-- point_key --
-- Point a key at a task: (fingerprint, task_id, created_at, tenant, key).
UPDATE idempotency_keys SET fingerprint = ?, task_id = ?, created_at = ?
WHERE tenant = ? AND key = ?

-- progressed --
-- Tasks whose progress moved since a time: (since, limit).
SELECT * FROM tasks WHERE progress_at > ? ORDER BY progress_at LIMIT ?

-- heartbeat --
-- Renew a running attempt's lease: (lease_expires_at, now, id, epoch).
UPDATE tasks SET lease_expires_at = ?, updated_at = ?
WHERE id = ? AND epoch = ? AND status IN {RUNNING} RETURNING *

-- heartbeat_progress --
-- Renew the lease and record progress: (lease_expires_at, now, stage, step, total, now,
-- id, epoch).
UPDATE tasks SET lease_expires_at = ?, updated_at = ?, stage = ?, progress_step = ?,
    progress_total = ?, progress_at = ?
WHERE id = ? AND epoch = ? AND status IN {RUNNING} RETURNING *

-- request_cancel --
-- Ask a running attempt to stop: (now, now, id).
UPDATE tasks SET cancel_requested = {TRUE},
    cancel_requested_at = coalesce(cancel_requested_at, ?), updated_at = ?
WHERE id = ? AND status IN {RUNNING} RETURNING *

-- claim_tasks --
-- Claim chosen candidates (still claimable): ([kinds that go on to GENERATING], [the
-- same], lease_owner, lease_expires_at, now, [the same], now, now, now, [ids]). A task
-- of such a kind (it waits for no resource) is acquired too: two steps, two versions.
UPDATE tasks SET
    status = CASE WHEN kind {IN_LIST} THEN 'GENERATING' ELSE 'WAITING_FOR_RESOURCE' END,
    attempt = attempt + 1, epoch = epoch + 1,
    version = version + CASE WHEN kind {IN_LIST} THEN 2 ELSE 1 END,
    lease_owner = ?, lease_expires_at = ?,
    state_deadline_at = ? + CASE WHEN kind {IN_LIST} THEN {GENERATING_S} ELSE {WAITING_S} END,
    started_at = coalesce(started_at, ?),
    updated_at = ?, status_since = ?, next_retry_at = NULL, stage = NULL,
    progress_step = NULL, progress_total = NULL, progress_at = NULL, yield_requested_at = NULL,
    result_prefix = 'tasks/' || id || '/' || (attempt + 1) || '-' || (epoch + 1)
WHERE id {IN_LIST} AND status IN {CLAIMABLE} RETURNING *

-- events ------------------------------------------------------------------------------

-- events_of_task --
-- (task_id, after, limit).
SELECT seq, id, task_id, tenant, event, from_status, to_status, attempt, epoch, error, at,
    dwell_s, final, loading_s
FROM events WHERE task_id = ? AND seq > ? ORDER BY seq LIMIT ?

-- events_of_tenant --
-- (tenant, after, limit).
SELECT seq, id, task_id, tenant, event, from_status, to_status, attempt, epoch, error, at,
    dwell_s, final, loading_s
FROM events WHERE tenant = ? AND seq > ? ORDER BY seq LIMIT ?

-- events_after --
-- (after, limit).
SELECT seq, id, task_id, tenant, event, from_status, to_status, attempt, epoch, error, at,
    dwell_s, final, loading_s
FROM events WHERE seq > ? ORDER BY seq LIMIT ?

-- last_seq --
SELECT coalesce(MAX(seq), 0) FROM events

-- supervisor ----------------------------------------------------------------------------

-- due --
-- Tasks whose due_at passed (deadline, lease, state timeout), soonest first: (now, limit).
SELECT * FROM tasks WHERE due_at < ? ORDER BY due_at LIMIT ?

-- due_cancel --
-- Running tasks asked to stop before a cutoff: (cutoff, limit).
SELECT * FROM tasks WHERE cancel_requested = {TRUE} AND status IN {RUNNING}
    AND cancel_requested_at < ?
ORDER BY cancel_requested_at LIMIT ?

-- ghosts --
-- Running tasks whose lease lapsed before a cutoff: (cutoff, cutoff).
SELECT COUNT(*) FROM tasks WHERE due_at < ? AND status IN {RUNNING} AND lease_expires_at < ?

-- ghosts_of_tenant --
-- (cutoff, cutoff, tenant).
SELECT COUNT(*) FROM tasks WHERE due_at < ? AND status IN {RUNNING} AND lease_expires_at < ?
    AND tenant = ?

-- lead --
-- Take or renew a leadership: (name, owner, expires_at, now, now).
INSERT INTO leaders (name, owner, epoch, expires_at) VALUES (?, ?, 1, ?)
ON CONFLICT (name) DO UPDATE SET
    epoch = CASE WHEN leaders.owner = excluded.owner AND leaders.expires_at >= ?
        THEN leaders.epoch ELSE leaders.epoch + 1 END,
    owner = excluded.owner, expires_at = excluded.expires_at
WHERE leaders.owner = excluded.owner OR leaders.expires_at < ?
RETURNING epoch, expires_at

-- holds --
-- Whether a token still leads; share-locked, so a takeover waits for the guarded write:
-- (name, owner, epoch, now).
SELECT 1 FROM leaders WHERE name = ? AND owner = ? AND epoch = ? AND expires_at >= ?
{FOR_SHARE}

-- stats and counters ----------------------------------------------------------------------

-- status_counts --
SELECT status, SUM(n) FROM task_counts GROUP BY status

-- status_counts_of_tenant --
-- (tenant).
SELECT status, SUM(n) FROM task_counts WHERE tenant = ? GROUP BY status

-- counter_rows --
-- One counter's rows from a label on: (name, labels from).
SELECT labels, SUM(n) FROM counters WHERE name = ? AND labels >= ? GROUP BY labels

-- all_counters --
SELECT name, labels, SUM(n) FROM counters GROUP BY name, labels

-- prune_counter --
-- Drop a counter's rows below a label: (name, labels below).
DELETE FROM counters WHERE name = ? AND labels < ?

-- dwell --
-- The time spent in each status over the latest transitions: (window).
SELECT from_status, dwell_s FROM events ORDER BY seq DESC LIMIT ?

-- dwell_of_tenant --
-- (tenant, window).
SELECT from_status, dwell_s FROM events WHERE tenant = ? ORDER BY seq DESC LIMIT ?

-- oldest_ready --
SELECT ready_at FROM tasks WHERE status IN {CLAIMABLE} ORDER BY ready_at LIMIT 1

-- retention -----------------------------------------------------------------------------

-- purge_events --
-- ([task ids]).
DELETE FROM events WHERE task_id {IN_LIST}

-- purge_keys --
DELETE FROM idempotency_keys WHERE task_id {IN_LIST}

-- purge_deliveries --
DELETE FROM webhook_deliveries WHERE task_id {IN_LIST}

-- purge_traces --
DELETE FROM task_traces WHERE task_id {IN_LIST}

-- purge_tasks --
DELETE FROM tasks WHERE id {IN_LIST}

-- the GPU-second ledger (kiln/store/usage.py) ----------------------------------------------

-- usage_row --
-- An attempt's row of the ledger, written by the change that ends it, from the relation
-- ``ended`` (task_id, attempt, epoch, tenant, kind, model, pool, worker, outcome, source,
-- dwell_s, loading_s, share, ended_at) that the statement around it defines: the row path
-- (usage_ended, before the change's own event rows) and PostgreSQL's one-statement path
-- (kiln/store/pgstep.py, which cannot see its own event row). The seconds waiting and
-- generating are the dwell_s of the attempt's event rows so far that leave those statuses,
-- plus the ending step's dwell in the status it leaves (source); a NULL pool reads the
-- attempt's pool slots. A replay adds nothing. The one text of the GPU-seconds.
INSERT INTO usage_ledger (task_id, attempt, epoch, tenant, kind, model, pool, worker,
    outcome, waiting_s, loading_s, generating_s, share, ended_at)
SELECT s.task_id, s.attempt, s.epoch, s.tenant, s.kind, s.model,
    coalesce(s.pool, (SELECT {JOIN_POOLS} FROM (SELECT pool FROM pool_slots
        WHERE task_id = s.task_id AND epoch = s.epoch ORDER BY pool) AS p), ''),
    s.worker, s.outcome,
    coalesce((SELECT sum(v.dwell_s) FROM events v WHERE v.task_id = s.task_id
        AND v.attempt = s.attempt AND v.epoch = s.epoch
        AND v.from_status = 'WAITING_FOR_RESOURCE'), 0)
        + CASE WHEN s.source = 'WAITING_FOR_RESOURCE' THEN s.dwell_s ELSE 0 END,
    s.loading_s,
    coalesce((SELECT sum(v.dwell_s) FROM events v WHERE v.task_id = s.task_id
        AND v.attempt = s.attempt AND v.epoch = s.epoch
        AND v.from_status = 'GENERATING'), 0)
        + CASE WHEN s.source = 'GENERATING' THEN s.dwell_s ELSE 0 END,
    s.share, s.ended_at
FROM ended AS s WHERE 1 = 1
ON CONFLICT (task_id, attempt, epoch) DO NOTHING

-- usage_ended --
-- The relation usage_row reads, on the row path: named parameters (the attempt and epoch
-- as it ran, before the change; the status the change leaves and its dwell there).
SELECT CAST(:task_id AS TEXT) AS task_id, CAST(:attempt AS INTEGER) AS attempt,
    CAST(:epoch AS INTEGER) AS epoch, CAST(:tenant AS TEXT) AS tenant,
    CAST(:kind AS TEXT) AS kind, CAST(:model AS TEXT) AS model, CAST(:pool AS TEXT) AS pool,
    CAST(:worker AS TEXT) AS worker, CAST(:outcome AS TEXT) AS outcome,
    CAST(:source AS TEXT) AS source, CAST(:dwell_s AS DOUBLE PRECISION) AS dwell_s,
    CAST(:loading_s AS DOUBLE PRECISION) AS loading_s,
    CAST(:share AS DOUBLE PRECISION) AS share, CAST(:ended_at AS DOUBLE PRECISION) AS ended_at

-- usage_of_task --
-- A task's rows of the ledger, in attempt order: (task_id).
SELECT task_id, attempt, epoch, tenant, kind, model, pool, worker, outcome, waiting_s,
    loading_s, generating_s, share, ended_at
FROM usage_ledger WHERE task_id = ? ORDER BY attempt, epoch

-- gpu_seconds --
-- GPU-seconds (generating_s x share) by tenant, kind, model and outcome, of the attempts
-- that ended in a window (kiln_gpu_seconds_total): (since, until).
SELECT tenant, kind, coalesce(model, ''), outcome, sum(generating_s * share)
FROM usage_ledger WHERE ended_at >= ? AND ended_at < ?
GROUP BY tenant, kind, coalesce(model, ''), outcome
ORDER BY tenant, kind, coalesce(model, ''), outcome

-- claims (kiln/store/claims.py) ------------------------------------------------------------

-- claim_candidates --
-- Claim candidates of one kind, in claim order, locked: (kind, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND status IN {CLAIMABLE} AND ready_at <= ? AND deadline_at > ?
ORDER BY priority DESC, ready_at, id LIMIT ? {SKIP_LOCKED}

-- claim_warm --
-- Claim candidates of one kind that need one model (warm-model routing: the claiming
-- worker holds it loaded), in claim order, locked: (kind, model, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND model = ? AND status IN {CLAIMABLE} AND ready_at <= ? AND deadline_at > ?
ORDER BY priority DESC, ready_at, id LIMIT ? {SKIP_LOCKED}

-- claim_batch --
-- Claim candidates of one kind that join one batch (the same batch key), in claim order,
-- locked: (kind, batch_key, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND batch_key = ? AND status IN {CLAIMABLE} AND ready_at <= ?
    AND deadline_at > ?
ORDER BY priority DESC, ready_at, id LIMIT ? {SKIP_LOCKED}

-- claim_routed --
-- Claim candidates of one kind a routed claim may take, in claim order, locked: a task
-- whose model another idle worker holds loaded is left to that worker until it has been
-- ready for the affinity wait: (kind, now, now, [reserved models], ready by, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND status IN {CLAIMABLE} AND ready_at <= ? AND deadline_at > ?
    AND (model IS NULL OR NOT (model {IN_LIST}) OR ready_at <= ?)
ORDER BY priority DESC, ready_at, id LIMIT ? {SKIP_LOCKED}

-- lock_candidates --
-- Chosen candidates that are still ready, locked: ([ids], now, now).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE id {IN_LIST} AND status IN {CLAIMABLE} AND ready_at <= ? AND deadline_at > ?
{SKIP_LOCKED}

-- heads --
-- The first ready tasks of a kind: (kind, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND status IN {CLAIMABLE} AND ready_at <= ? AND deadline_at > ?
ORDER BY priority DESC, ready_at, id LIMIT ?

-- heads_of_model --
-- The first ready tasks of a kind that need one model: (kind, model, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND model = ? AND status IN {CLAIMABLE} AND ready_at <= ? AND deadline_at > ?
ORDER BY priority DESC, ready_at, id LIMIT ?

-- heads_of_tenant --
-- (kind, tenant, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND tenant = ? AND status IN {CLAIMABLE} AND ready_at <= ? AND deadline_at > ?
ORDER BY priority DESC, ready_at, id LIMIT ?

-- heads_of_level --
-- One priority level's first ready tasks: (kind, priority, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND status IN {CLAIMABLE} AND priority = ? AND ready_at <= ?
    AND deadline_at > ?
ORDER BY ready_at, id LIMIT ?

-- heads_of_tenant_level --
-- (kind, tenant, priority, now, now, limit).
SELECT id, priority, ready_at, status, status_since, version, tenant, model FROM tasks
WHERE kind = ? AND tenant = ? AND status IN {CLAIMABLE} AND priority = ? AND ready_at <= ?
    AND deadline_at > ?
ORDER BY ready_at, id LIMIT ?

-- levels --
-- The distinct priorities of a kind's claimable tasks, highest first, each found by one
-- index probe: (kind, kind).
WITH RECURSIVE levels(p) AS (
    SELECT (SELECT priority FROM tasks WHERE kind = ? AND status IN {CLAIMABLE}
        ORDER BY priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT priority FROM tasks WHERE kind = ? AND status IN {CLAIMABLE}
        AND priority < levels.p ORDER BY priority DESC LIMIT 1)
    FROM levels WHERE levels.p IS NOT NULL
) SELECT p FROM levels WHERE p IS NOT NULL

-- levels_of_tenant --
-- (kind, tenant, kind, tenant).
WITH RECURSIVE levels(p) AS (
    SELECT (SELECT priority FROM tasks WHERE kind = ? AND tenant = ? AND status IN {CLAIMABLE}
        ORDER BY priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT priority FROM tasks WHERE kind = ? AND tenant = ? AND status IN {CLAIMABLE}
        AND priority < levels.p ORDER BY priority DESC LIMIT 1)
    FROM levels WHERE levels.p IS NOT NULL
) SELECT p FROM levels WHERE p IS NOT NULL

-- queue_due_above --
-- The due tasks (ready, before their deadline) of a kind's levels above a priority: the
-- kept counts (queue_counts) less, per level, those not yet ready (one index range each)
-- and those past their deadline the sweep has not ended yet (the due index):
-- (now, kind, priority, now, kind, priority, now).
SELECT coalesce(sum(level.n - (SELECT COUNT(*) FROM tasks WHERE kind = level.kind
        AND status IN {CLAIMABLE} AND priority = level.priority AND ready_at > ?)), 0)
    - (SELECT COUNT(*) FROM tasks {BY_DUE} WHERE due_at <= ? AND status IN {CLAIMABLE}
        AND kind = ? AND priority > ? AND ready_at <= ?)
FROM (SELECT kind, priority, sum(n) AS n FROM queue_counts WHERE kind = ? AND priority > ?
    GROUP BY kind, priority) AS level

-- queue_due_above_of_tenant --
-- (now, now, kind, tenant, priority, now, kind, tenant, priority).
SELECT coalesce(sum(level.n - (SELECT COUNT(*) FROM tasks WHERE kind = level.kind
        AND tenant = level.tenant AND status IN {CLAIMABLE} AND priority = level.priority
        AND ready_at > ?)), 0)
    - (SELECT COUNT(*) FROM tasks {BY_DUE} WHERE due_at <= ? AND status IN {CLAIMABLE}
        AND kind = ? AND tenant = ? AND priority > ? AND ready_at <= ?)
FROM (SELECT kind, tenant, priority, sum(n) AS n FROM queue_counts_of_tenant
    WHERE kind = ? AND tenant = ? AND priority > ? GROUP BY kind, tenant, priority) AS level

-- queue_place --
-- One priority level of a kind's line around a key (ready_at, id): its due tasks (as in
-- queue_due_above), those of them at or after the key counted up to a limit, and, when
-- that limit was reached, those before the key counted up to a limit (else -1). Each
-- count walks the level's index range from one end, so the place of a task near either
-- end of its line costs little: (kind, priority, now, now, kind, priority, now, kind,
-- priority, ready_at, id, now, now, limit, limit, kind, priority, ready_at, id, now, now,
-- limit).
SELECT due, behind, CASE WHEN behind < ? THEN -1 ELSE
    (SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE kind = ? AND status IN {CLAIMABLE}
        AND priority = ? AND (ready_at, id) < (?, ?) AND ready_at <= ? AND deadline_at > ?
        LIMIT ?) AS ahead) END
FROM (SELECT
    coalesce((SELECT sum(n) FROM queue_counts WHERE kind = ? AND priority = ?), 0)
    - (SELECT COUNT(*) FROM tasks WHERE kind = ? AND status IN {CLAIMABLE} AND priority = ?
        AND ready_at > ?)
    - (SELECT COUNT(*) FROM tasks {BY_DUE} WHERE due_at <= ? AND status IN {CLAIMABLE}
        AND kind = ? AND priority = ? AND ready_at <= ?) AS due,
    (SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE kind = ? AND status IN {CLAIMABLE}
        AND priority = ? AND (ready_at, id) >= (?, ?) AND ready_at <= ? AND deadline_at > ?
        LIMIT ?) AS after) AS behind) AS level

-- queue_place_of_tenant --
-- The same in one tenant's line.
SELECT due, behind, CASE WHEN behind < ? THEN -1 ELSE
    (SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE kind = ? AND tenant = ?
        AND status IN {CLAIMABLE} AND priority = ? AND (ready_at, id) < (?, ?)
        AND ready_at <= ? AND deadline_at > ? LIMIT ?) AS ahead) END
FROM (SELECT
    coalesce((SELECT sum(n) FROM queue_counts_of_tenant WHERE kind = ? AND tenant = ?
        AND priority = ?), 0)
    - (SELECT COUNT(*) FROM tasks WHERE kind = ? AND tenant = ? AND status IN {CLAIMABLE}
        AND priority = ? AND ready_at > ?)
    - (SELECT COUNT(*) FROM tasks {BY_DUE} WHERE due_at <= ? AND status IN {CLAIMABLE}
        AND kind = ? AND tenant = ? AND priority = ? AND ready_at <= ?) AS due,
    (SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE kind = ? AND tenant = ?
        AND status IN {CLAIMABLE} AND priority = ? AND (ready_at, id) >= (?, ?)
        AND ready_at <= ? AND deadline_at > ? LIMIT ?) AS after) AS behind) AS level

-- queue_levels --
-- The priorities of a kind's queued tasks, highest first, from the kept counts: (kind).
SELECT priority FROM queue_counts WHERE kind = ? GROUP BY priority HAVING sum(n) > 0
ORDER BY priority DESC

-- queue_levels_of_tenant --
-- (kind, tenant).
SELECT priority FROM queue_counts_of_tenant WHERE kind = ? AND tenant = ?
GROUP BY priority HAVING sum(n) > 0 ORDER BY priority DESC

-- queue_places_of_level --
-- Places, counted from 1, in one priority level of a kind's line from a given task on, of
-- the tasks among some ids: one pass over the index range from that task to the last of
-- them: (kind, priority, first ready_at, first id, last ready_at, last id, now, now, [ids]).
SELECT id, place FROM (
    SELECT id, ROW_NUMBER() OVER (ORDER BY ready_at, id) AS place
    FROM tasks WHERE kind = ? AND status IN {CLAIMABLE} AND priority = ?
        AND (ready_at, id) >= (?, ?) AND (ready_at, id) <= (?, ?)
        AND ready_at <= ? AND deadline_at > ?
) AS level WHERE id {IN_LIST}

-- ready_tenants --
-- Tenants with claimable tasks, from the per-status counts (no task row is read).
SELECT tenant FROM task_counts WHERE status IN {CLAIMABLE}
GROUP BY tenant HAVING sum(n) > 0 ORDER BY tenant

-- running_of_tenants --
-- Claimed-and-unfinished tasks of some tenants, counted from the tasks themselves so a
-- claim sees its own transaction's earlier claims; a running pipeline is no claimed task
-- (its steps are): ([tenants]).
SELECT tenant, COUNT(*) FROM tasks WHERE tenant {IN_LIST} AND status IN {RUNNING}
    AND kind <> 'pipeline'
GROUP BY tenant

-- resource pools (kiln/store/pools.py) ------------------------------------------------------

-- lock_pools --
-- Pools' capacities, locked in name order: ([names]).
SELECT name, capacity FROM pools WHERE name {IN_LIST} ORDER BY name {FOR_UPDATE}

-- save_pool --
-- (name, capacity).
INSERT INTO pools (name, capacity) VALUES (?, ?)
ON CONFLICT (name) DO UPDATE SET capacity = excluded.capacity

-- join_line --
-- Into a pool's line, if the attempt still holds its lease (a new attempt of the task
-- starts again at the end): (pool, units, since, task_id, epoch, now).
INSERT INTO pool_slots (pool, task_id, epoch, units, held, since)
SELECT ?, t.id, t.epoch, ?, {FALSE}, ? FROM tasks t WHERE t.id = ? AND t.epoch = ?
    AND t.status = 'WAITING_FOR_RESOURCE' AND t.lease_expires_at > ?
ON CONFLICT (pool, task_id) DO UPDATE SET epoch = excluded.epoch, units = excluded.units,
    held = {FALSE}, since = excluded.since WHERE pool_slots.epoch <> excluded.epoch

-- slot_rows --
-- Every row of some pools, with whether its attempt is alive: (now, [names]).
SELECT pool, task_id, units, held, since, EXISTS (SELECT 1 FROM tasks t
    WHERE t.id = pool_slots.task_id AND t.epoch = pool_slots.epoch
    AND t.status IN {HOLDS_SLOT} AND t.lease_expires_at > ?)
FROM pool_slots WHERE pool {IN_LIST}

-- live_slot_rows --
-- The live rows of some pools: ([names], now).
SELECT pool, task_id, units, held, since FROM pool_slots WHERE pool {IN_LIST}
    AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = pool_slots.task_id
    AND t.epoch = pool_slots.epoch AND t.status IN {HOLDS_SLOT} AND t.lease_expires_at > ?)

-- drop_slot --
-- (pool, task_id).
DELETE FROM pool_slots WHERE pool = ? AND task_id = ?

-- hold_slots --
-- (task_id).
UPDATE pool_slots SET held = {TRUE} WHERE task_id = ? AND held = {FALSE}

-- waiting_in --
-- The pools a task waits for (live rows), with their capacity: (task_id, now).
SELECT pool_slots.pool, pools.capacity FROM pool_slots JOIN pools
    ON pools.name = pool_slots.pool WHERE task_id = ? AND held = {FALSE}
    AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = pool_slots.task_id
    AND t.epoch = pool_slots.epoch AND t.status IN {HOLDS_SLOT} AND t.lease_expires_at > ?)
ORDER BY pool_slots.pool

-- pool_usage --
-- Every pool with its capacity, units held and tasks waiting (live rows): (now).
SELECT pools.name, pools.capacity,
    coalesce(sum(CASE WHEN pool_slots.held THEN pool_slots.units ELSE 0 END), 0),
    count(pool_slots.task_id) - count(CASE WHEN pool_slots.held THEN 1 END)
FROM pools LEFT JOIN pool_slots ON pool_slots.pool = pools.name
    AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = pool_slots.task_id
    AND t.epoch = pool_slots.epoch AND t.status IN {HOLDS_SLOT} AND t.lease_expires_at > ?)
GROUP BY pools.name, pools.capacity ORDER BY pools.name

-- preempt_pools --
-- Pools whose line has a live waiter that joined it before a time (preemption,
-- kiln/store/preempt.py): (joined before, now).
SELECT DISTINCT pool FROM pool_slots WHERE held = {FALSE} AND since < ?
    AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = pool_slots.task_id
    AND t.epoch = pool_slots.epoch AND t.status IN {HOLDS_SLOT} AND t.lease_expires_at > ?)
ORDER BY pool

-- preempt_rows --
-- The live rows of some pools with what preemption reads of their tasks: ([names], now).
SELECT s.pool, s.task_id, s.units, s.held, s.since, t.priority, t.status, t.status_since,
    t.epoch, t.yield_requested_at, p.capacity
FROM pool_slots s JOIN tasks t ON t.id = s.task_id AND t.epoch = s.epoch
    JOIN pools p ON p.name = s.pool
WHERE s.pool {IN_LIST} AND t.status IN {HOLDS_SLOT} AND t.lease_expires_at > ?

-- request_yield --
-- Ask a generating attempt to yield its slots at its next step, once: (now, now, id, epoch).
UPDATE tasks SET yield_requested_at = ?, updated_at = ?
WHERE id = ? AND epoch = ? AND status = 'GENERATING' AND yield_requested_at IS NULL
RETURNING id

-- new_bucket --
-- A full token bucket, unless it exists: (name, burst, now).
INSERT INTO rate_buckets (name, tokens, updated_at) VALUES (?, ?, ?)
ON CONFLICT (name) DO NOTHING

-- lock_bucket --
-- (name).
SELECT tokens, updated_at FROM rate_buckets WHERE name = ? {FOR_UPDATE}

-- save_bucket --
-- (tokens, updated_at, name).
UPDATE rate_buckets SET tokens = ?, updated_at = ? WHERE name = ?

-- webhooks (kiln/store/outbox.py) ---------------------------------------------------------

-- outbox_cursor --
-- (cursor name).
SELECT seq FROM webhook_cursor WHERE name = ?

-- move_outbox_cursor --
-- (cursor name, seq).
INSERT INTO webhook_cursor (name, seq) VALUES (?, ?)
ON CONFLICT (name) DO UPDATE SET seq = {GREATEST}(webhook_cursor.seq, excluded.seq)

-- any_hooked_task --
-- Whether any task has a webhook (the partial index tasks_hooked answers it).
SELECT 1 FROM tasks WHERE webhook IS NOT NULL LIMIT 1

-- hooked_tasks --
-- The tasks among some that have a webhook: ([ids]).
SELECT * FROM tasks WHERE id {IN_LIST} AND webhook IS NOT NULL

-- enqueue_delivery --
-- A delivery, for a task that still exists (a purge may have taken it since its event
-- was read; on PostgreSQL the purge then waits or this skips it): (the DELIVERY_COLUMNS
-- of kiln/store/outbox.py, task_id).
INSERT INTO webhook_deliveries (event_id, seq, task_id, tenant, event, url, payload, status,
    attempts, next_attempt_at, last_error, response_status, created_at, updated_at)
SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?
WHERE EXISTS (SELECT 1 FROM tasks t WHERE t.id = ? {FOR_KEY_SHARE})
ON CONFLICT (event_id) DO NOTHING

-- deliveries_due --
-- Deliveries due, each the first pending one of its task: (pending, now, pending, limit).
SELECT event_id, seq, task_id, tenant, event, url, payload, status, attempts,
    next_attempt_at, last_error, response_status, created_at, updated_at
FROM webhook_deliveries d WHERE status = ? AND next_attempt_at <= ?
    AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p
    WHERE p.task_id = d.task_id AND p.status = ? AND p.seq < d.seq)
ORDER BY next_attempt_at, seq LIMIT ?

-- record_delivery --
-- (status, next_attempt_at, last_error, response_status, now, event_id, pending).
UPDATE webhook_deliveries SET status = ?, attempts = attempts + 1,
    next_attempt_at = coalesce(?, next_attempt_at), last_error = ?,
    response_status = ?, updated_at = ?
WHERE event_id = ? AND status = ?

-- deliveries --
-- (limit).
SELECT event_id, seq, task_id, tenant, event, url, payload, status, attempts,
    next_attempt_at, last_error, response_status, created_at, updated_at
FROM webhook_deliveries ORDER BY seq LIMIT ?

-- deliveries_of_task --
-- (task_id, limit).
SELECT event_id, seq, task_id, tenant, event, url, payload, status, attempts,
    next_attempt_at, last_error, response_status, created_at, updated_at
FROM webhook_deliveries WHERE task_id = ? ORDER BY seq LIMIT ?

-- delivery_of_task --
-- (event_id, task_id).
SELECT event_id, seq, task_id, tenant, event, url, payload, status, attempts,
    next_attempt_at, last_error, response_status, created_at, updated_at
FROM webhook_deliveries WHERE event_id = ? AND task_id = ?

-- redeliver --
-- Send a delivery again, due now; its attempts, last error and answer stay:
-- (pending, now, now, event_id, task_id).
UPDATE webhook_deliveries SET status = ?, next_attempt_at = ?, updated_at = ?
WHERE event_id = ? AND task_id = ?

-- pending_deliveries --
-- (pending).
SELECT COUNT(*) FROM webhook_deliveries WHERE status = ?

-- breakers (kiln/breakers.py) ---------------------------------------------------------------

-- breakers --
SELECT name, state, opened_until, updated_at, "by" FROM breakers ORDER BY name

-- save_breaker --
-- Insert or replace a breaker's row; a row back when written:
-- (name, state, opened_until, updated_at, by).
INSERT INTO breakers (name, state, opened_until, updated_at, "by") VALUES (?, ?, ?, ?, ?)
ON CONFLICT (name) DO UPDATE SET state = excluded.state,
    opened_until = excluded.opened_until, updated_at = excluded.updated_at,
    "by" = excluded."by"
RETURNING name

-- save_breaker_if_due --
-- The same, only when the stored breaker is open or half-open with its open period (or the
-- previous probe's time) over: the half-open probe goes to one process.
INSERT INTO breakers (name, state, opened_until, updated_at, "by") VALUES (?, ?, ?, ?, ?)
ON CONFLICT (name) DO UPDATE SET state = excluded.state,
    opened_until = excluded.opened_until, updated_at = excluded.updated_at,
    "by" = excluded."by"
WHERE breakers.state <> 'closed' AND breakers.opened_until <= excluded.updated_at
RETURNING name

-- reserve_retry --
-- Take the retry slot for (earliest, interval_s): max(earliest, next_at); next_at moves
-- to slot + interval_s: (earliest, interval_s, interval_s, interval_s, interval_s).
INSERT INTO retry_clock AS c (name, next_at) VALUES ('retries', ? + ?)
ON CONFLICT (name) DO UPDATE SET next_at = {GREATEST}(c.next_at, excluded.next_at - ?) + ?
RETURNING next_at - ?

-- uploaded inputs and idempotency keys (kiln/store/inputs.py) -------------------------------

-- add_task_input --
-- (sha256, task_id).
INSERT INTO task_inputs (sha256, task_id) VALUES (?, ?) ON CONFLICT DO NOTHING

-- drop_task_inputs --
-- ([task ids]).
DELETE FROM task_inputs WHERE task_id {IN_LIST}

-- lock_input --
-- (sha256).
SELECT pins, deleting_at FROM inputs WHERE sha256 = ? {FOR_UPDATE}

-- new_input --
-- An input pinned once: (sha256, used_at).
INSERT INTO inputs (sha256, pins, used_at) VALUES (?, 1, ?)

-- pin_input --
-- (used_at, sha256).
UPDATE inputs SET pins = pins + 1, used_at = ?, deleting_at = NULL WHERE sha256 = ?

-- unpin_input --
-- (used_at, sha256).
UPDATE inputs SET pins = pins - 1, used_at = ? WHERE sha256 = ? AND pins > 0

-- unused_inputs --
-- Inputs no task refers to and nobody holds (or whose holder vanished long ago), last used
-- before a time, whose deletion is not under way (or was left long ago), oldest first:
-- (used before, pins stale before, deletion stale before, limit).
SELECT sha256 FROM inputs WHERE used_at < ? AND (pins = 0 OR used_at < ?)
    AND (deleting_at IS NULL OR deleting_at < ?)
    AND NOT EXISTS (SELECT 1 FROM task_inputs t WHERE t.sha256 = inputs.sha256)
ORDER BY used_at LIMIT ? {SKIP_LOCKED}

-- unused_among --
-- The same among some inputs, whatever their last use: (pins stale before, deletion stale
-- before, [sha256s]).
SELECT sha256 FROM inputs WHERE (pins = 0 OR used_at < ?)
    AND (deleting_at IS NULL OR deleting_at < ?)
    AND NOT EXISTS (SELECT 1 FROM task_inputs t WHERE t.sha256 = inputs.sha256)
    AND sha256 {IN_LIST} {SKIP_LOCKED}

-- mark_deleting --
-- (deleting_at, [sha256s]).
UPDATE inputs SET deleting_at = ? WHERE sha256 {IN_LIST}

-- forget_input --
-- Its object is gone: (sha256, deleting_at).
DELETE FROM inputs WHERE sha256 = ? AND deleting_at = ?

-- known_inputs --
-- Which of some inputs the store knows, or a task refers to: ([sha256s], [sha256s]).
SELECT sha256 FROM inputs WHERE sha256 {IN_LIST}
UNION SELECT sha256 FROM task_inputs WHERE sha256 {IN_LIST}

-- tenant_input --
-- The inputs of one of a tenant's tasks that has an upload of this content (through
-- task_inputs' primary key, then the task's): (sha256, tenant).
SELECT tasks.inputs FROM task_inputs JOIN tasks ON tasks.id = task_inputs.task_id
WHERE task_inputs.sha256 = ? AND tasks.tenant = ? LIMIT 1

-- tenant_output --
-- An output of this content of one of a tenant's SUCCESS tasks: (tenant, sha256).
SELECT task_id, name, key, content_type, size FROM task_outputs
WHERE tenant = ? AND sha256 = ? ORDER BY task_id, name LIMIT 1

-- expire_keys --
-- Idempotency keys created before a time, oldest first: (created before, limit).
DELETE FROM idempotency_keys WHERE (tenant, key) IN (SELECT tenant, key
    FROM idempotency_keys WHERE created_at < ? ORDER BY created_at LIMIT ?)

-- workers (kiln/store/workers.py) ------------------------------------------------------

-- worker_seen --
-- A worker process says it is alive (the first time, it registers): (id, host, pid,
-- version, kinds, slots, running, resources, models, started_at, seen_at, expires_at).
INSERT INTO workers (id, host, pid, version, kinds, slots, running, resources, models,
    started_at, seen_at, expires_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET kinds = excluded.kinds, slots = excluded.slots,
    running = excluded.running, resources = excluded.resources, models = excluded.models,
    seen_at = excluded.seen_at, expires_at = excluded.expires_at

-- forget_workers --
-- The rows of workers gone long ago: (before).
DELETE FROM workers WHERE expires_at < ?

-- worker_gone --
-- A worker that stopped cleanly: (id).
DELETE FROM workers WHERE id = ?

-- live_workers --
-- The workers whose beat has not lapsed, in a stable order: (now).
SELECT id, host, pid, version, kinds, slots, running, resources, models, started_at,
    seen_at, expires_at
FROM workers WHERE expires_at > ? ORDER BY host, pid, id

-- autoscaling signals (kiln/store/load.py) -------------------------------------------------

-- ready_by_kind --
-- Ready tasks (PENDING, due RETRYING) of each kind and the oldest one's ready time, read
-- from the claim index (only live tasks, never the finished history): (now).
SELECT kind, COUNT(*), MIN(ready_at) FROM tasks
WHERE status IN {CLAIMABLE} AND ready_at <= ? GROUP BY kind

-- claimed_tasks --
-- The claimed tasks (waiting for a resource, generating, uploading), one row each, read
-- from the lease index: at most the live workers' slots plus the dead ones' not yet swept.
-- A running pipeline (kind pipeline) is no worker's (docs/pipelines.md).
SELECT kind, status, ready_at FROM tasks WHERE status IN {RUNNING} AND kind <> 'pipeline'

-- pool_line_rows --
-- The live rows of every pool's line (as pool_usage counts them): (pool, held, since); (now).
SELECT pool_slots.pool, pool_slots.held, pool_slots.since FROM pool_slots
JOIN tasks t ON t.id = pool_slots.task_id AND t.epoch = pool_slots.epoch
    AND t.status IN {HOLDS_SLOT} AND t.lease_expires_at > ?

-- schedules (kiln/store/schedules.py) ---------------------------------------------------

-- insert_schedule --
-- A new schedule: (id, tenant, cron, timezone, submission, overlap, missed, paused,
-- next_at, created_at, updated_at).
INSERT INTO schedules (id, tenant, cron, timezone, submission, overlap, missed, paused,
    next_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- count_schedules --
-- The schedules a tenant holds: (tenant).
SELECT count(*) FROM schedules WHERE tenant = ?

-- get_schedule --
-- A schedule: (id).
SELECT id, tenant, cron, timezone, submission, overlap, missed, paused, next_at,
    last_task_id, last_fired_at, fired, skipped, created_at, updated_at
FROM schedules WHERE id = ?

-- lock_schedule --
-- A schedule about to fire, locked until commit: (id).
SELECT id, tenant, cron, timezone, submission, overlap, missed, paused, next_at,
    last_task_id, last_fired_at, fired, skipped, created_at, updated_at
FROM schedules WHERE id = ? {FOR_UPDATE}

-- due_schedules --
-- The schedules whose next tick has come, earliest first: (now, limit).
SELECT id, tenant, cron, timezone, submission, overlap, missed, paused, next_at,
    last_task_id, last_fired_at, fired, skipped, created_at, updated_at
FROM schedules WHERE paused = {FALSE} AND next_at IS NOT NULL AND next_at <= ?
ORDER BY next_at LIMIT ?

-- next_schedule_at --
-- The earliest next tick of a running schedule (no parameters).
SELECT MIN(next_at) FROM schedules WHERE paused = {FALSE} AND next_at IS NOT NULL

-- advance_schedule --
-- A handled tick: the next one, the task it fired (or the last one kept), how many it
-- fired and skipped: (next_at, last_task_id, last_fired_at, fired, skipped, now, id).
UPDATE schedules SET next_at = ?, last_task_id = ?, last_fired_at = ?, fired = fired + ?,
    skipped = skipped + ?, updated_at = ?
WHERE id = ?

-- pause_schedule --
-- Pause or resume a schedule, with its next tick: (paused, next_at, now, id).
UPDATE schedules SET paused = ?, next_at = ?, updated_at = ? WHERE id = ?

-- delete_schedule --
-- (id).
DELETE FROM schedules WHERE id = ?

-- trace contexts (kiln/tracing.py) -------------------------------------------------------

-- insert_trace --
-- The trace context a new task was submitted in: (task_id, traceparent, tracestate).
INSERT INTO task_traces (task_id, traceparent, tracestate) VALUES (?, ?, ?)

-- get_trace --
-- A task's trace context: (task_id).
SELECT traceparent, tracestate FROM task_traces WHERE task_id = ?
