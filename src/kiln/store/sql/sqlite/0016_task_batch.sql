-- kiln schema v16: the batch a task may join (durable dynamic batching): a digest of the
-- params its kind's batch policy says must match (NULL for a kind that does not batch).
-- A worker that claimed a task of a batching kind fills its batch with the ready tasks of
-- the same key: each key's ready tasks are one index range.
ALTER TABLE tasks ADD COLUMN batch_key TEXT;
CREATE INDEX tasks_claim_batch ON tasks (kind, batch_key, priority DESC, ready_at, id)
    WHERE status IN ('PENDING', 'RETRYING') AND batch_key IS NOT NULL;
