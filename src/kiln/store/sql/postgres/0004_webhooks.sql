-- kiln schema v4 (PostgreSQL): webhooks. A task's webhook ({"url", "events"} as JSON
-- text, or NULL) is written with the task, in the same insert.
ALTER TABLE tasks ADD COLUMN webhook text;

-- The outbox: one row per event to deliver, keyed by the event's id, so turning the same
-- event into a delivery twice is a no-op. Rows stay after delivery or failure, for
-- inspection, and leave with their task when retention purges it.
CREATE TABLE webhook_deliveries (
    event_id        text PRIMARY KEY,
    seq             bigint NOT NULL,
    task_id         text NOT NULL,
    tenant          text NOT NULL,
    event           text NOT NULL,
    url             text NOT NULL,
    payload         text NOT NULL,
    status          text NOT NULL,
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at double precision NOT NULL,
    last_error      text,
    response_status integer,
    created_at      double precision NOT NULL,
    updated_at      double precision NOT NULL
);
-- What is due, read through the pending rows only; a task's deliveries in seq order (the
-- head of each task's line, and the purge).
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at, seq)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_task ON webhook_deliveries (task_id, seq);

-- How far the dispatcher has turned the event log into deliveries. It starts at the end
-- of the log: no event written before this migration belongs to a task with a webhook.
-- (A seq still in flight right now belongs to a task without one: the column is new.)
CREATE TABLE webhook_cursor (
    name text PRIMARY KEY,
    seq  bigint NOT NULL
);
INSERT INTO webhook_cursor (name, seq) SELECT 'events', coalesce(max(seq), 0) FROM events;
