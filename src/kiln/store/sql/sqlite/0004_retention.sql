-- kiln schema v4: retention. Final tasks in the order they finished, so a purge pass reads
-- only what is old enough.
CREATE INDEX tasks_finished ON tasks (finished_at)
    WHERE status IN ('SUCCESS', 'FAILED', 'TIMEOUT', 'CANCELLED');
-- Idempotency keys of a task, to purge them with it.
CREATE INDEX idempotency_keys_task ON idempotency_keys (task_id);
