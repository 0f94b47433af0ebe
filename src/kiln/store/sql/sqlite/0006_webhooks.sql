-- kiln schema v6: webhooks. A task's webhook ({"url", "events"} as JSON, or NULL) is
-- written with the task, in the same insert.
ALTER TABLE tasks ADD COLUMN webhook TEXT;

-- The outbox: one row per event to deliver, keyed by the event's id, so turning the same
-- event into a delivery twice is a no-op. Rows stay after delivery or failure, for
-- inspection, and leave with their task when retention purges it.
CREATE TABLE webhook_deliveries (
    event_id        TEXT PRIMARY KEY,
    seq             INTEGER NOT NULL,
    task_id         TEXT NOT NULL,
    tenant          TEXT NOT NULL,
    event           TEXT NOT NULL,
    url             TEXT NOT NULL,
    payload         TEXT NOT NULL,
    status          TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    last_error      TEXT,
    response_status INTEGER,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL
);
-- What is due, read through the pending rows only; a task's deliveries in seq order (the
-- head of each task's line, and the purge).
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at, seq)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_task ON webhook_deliveries (task_id, seq);

-- How far the dispatcher has turned the event log into deliveries. It starts at the end
-- of the log: no event written before this migration belongs to a task with a webhook.
CREATE TABLE webhook_cursor (
    name TEXT PRIMARY KEY,
    seq  INTEGER NOT NULL
);
INSERT INTO webhook_cursor (name, seq) SELECT 'events', coalesce(max(seq), 0) FROM events;
