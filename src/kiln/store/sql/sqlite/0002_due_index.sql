-- kiln schema v2: one supervisor index instead of three.
-- Each index a row belongs to costs an index delete and insert on every status change; a
-- running task sat in three "due" indexes (lease, state timeout, deadline). due_at is the
-- earliest moment the supervisor must look at a task, computed by SQLite, and the sweep
-- reads only the rows whose due_at has passed.
ALTER TABLE tasks ADD COLUMN due_at REAL GENERATED ALWAYS AS (
    CASE
        WHEN status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING') THEN min(
            coalesce(lease_expires_at, deadline_at),
            coalesce(state_deadline_at, deadline_at),
            deadline_at)
        WHEN status IN ('PENDING', 'RETRYING') THEN deadline_at
    END) VIRTUAL;
DROP INDEX tasks_lease_due;
DROP INDEX tasks_state_due;
DROP INDEX tasks_deadline_due;
CREATE INDEX tasks_due ON tasks (due_at) WHERE due_at IS NOT NULL;
