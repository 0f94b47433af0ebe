-- kiln schema v7: retention of uploaded inputs and of idempotency keys on their own.
-- An input (inputs/<sha256>) is kept once per content. A row per input says how many
-- uploads hold it right now (pins, between storing it and submitting its task), when it
-- was last used, and whether its deletion is under way; task_inputs says which tasks
-- refer to it. Retention deletes an input that no task refers to, nobody holds, and that
-- was last used before the retention period.
CREATE TABLE inputs (
    sha256      text PRIMARY KEY,
    pins        integer NOT NULL DEFAULT 0,
    used_at     double precision NOT NULL,
    deleting_at double precision
);
CREATE INDEX inputs_used ON inputs (used_at);

CREATE TABLE task_inputs (
    sha256  text NOT NULL,
    task_id text NOT NULL,
    PRIMARY KEY (sha256, task_id)
);
CREATE INDEX task_inputs_task ON task_inputs (task_id);

-- The inputs of the tasks that exist now; their last use is the newest task's creation.
INSERT INTO task_inputs (sha256, task_id)
    SELECT DISTINCT item->>'sha256', tasks.id
    FROM tasks, jsonb_array_elements(tasks.inputs::jsonb) AS item
    WHERE item->>'sha256' IS NOT NULL;
INSERT INTO inputs (sha256, pins, used_at)
    SELECT task_inputs.sha256, 0, max(tasks.created_at)
    FROM task_inputs JOIN tasks ON tasks.id = task_inputs.task_id
    GROUP BY task_inputs.sha256;

-- KILN_IDEMPOTENCY_TTL_S: keys older than the TTL go, whatever became of their task.
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);
