-- kiln schema v15 (PostgreSQL): a rerun's link to the task it ran again
-- (POST /v1/tasks/{id}/rerun); NULL for every other task.
ALTER TABLE tasks ADD COLUMN rerun_of text;
