-- kiln schema v10: the claim index also covers a task's queue position.
-- A position counts the ready tasks ahead of a task (queries.sql, queue_ahead). With
-- deadline_at and status in the index, SQLite counts index entries without reading each
-- task's row, which on a line of thousands is several times cheaper. Claims read the
-- index in the same order as before.
DROP INDEX tasks_claim;
CREATE INDEX tasks_claim ON tasks (kind, priority DESC, ready_at, id, deadline_at, status)
    WHERE status IN ('PENDING', 'RETRYING');
