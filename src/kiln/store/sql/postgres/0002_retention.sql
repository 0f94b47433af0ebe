-- kiln schema v2 (PostgreSQL): retention. Final tasks in the order they finished, so a
-- purge pass reads only what is old enough; idempotency keys by task, to purge them with it.
CREATE INDEX tasks_finished ON tasks (finished_at)
    WHERE status IN ('SUCCESS', 'FAILED', 'TIMEOUT', 'CANCELLED');
CREATE INDEX idempotency_keys_task ON idempotency_keys (task_id);
