-- What SQLite says its own way (kiln/store/queries.py renders it; see sql/queries.sql).

-- insert_event --
-- One event row; its seq is the cursor's lastrowid (no RETURNING: cheaper): (id, task_id,
-- tenant, event, from_status, to_status, final, attempt, epoch, error, at, dwell_s,
-- loading_s).
INSERT INTO events (id, task_id, tenant, event, from_status, to_status, final, attempt,
    epoch, error, at, dwell_s, loading_s)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- add_status_count --
-- (tenant, status, delta).
INSERT INTO task_counts (tenant, status, n) VALUES (?, ?, ?)
ON CONFLICT (tenant, status) DO UPDATE SET n = n + excluded.n

-- add_counter --
-- (name, labels, delta).
INSERT INTO counters (name, labels, n) VALUES (?, ?, ?)
ON CONFLICT (name, labels) DO UPDATE SET n = n + excluded.n
