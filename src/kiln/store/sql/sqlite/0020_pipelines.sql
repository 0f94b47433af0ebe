-- kiln schema v20: pipelines (docs/pipelines.md). A step of a pipeline is a task of its
-- own that names its pipeline, its step and its copy (fan-out); NULL for every other task.
ALTER TABLE tasks ADD COLUMN pipeline_id TEXT;
ALTER TABLE tasks ADD COLUMN step TEXT;
ALTER TABLE tasks ADD COLUMN step_copy INTEGER;
CREATE INDEX tasks_pipeline ON tasks (pipeline_id) WHERE pipeline_id IS NOT NULL;
