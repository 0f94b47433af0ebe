-- kiln schema v9 (PostgreSQL): the model a task needs (its kind says which, from its
-- params; NULL when the kind names none). A claim prefers the tasks whose model its worker
-- holds loaded (kiln/store/claims.py, warm-model routing): each model's ready tasks are
-- one index range.
ALTER TABLE tasks ADD COLUMN model text;
CREATE INDEX tasks_claim_model ON tasks (kind, model, priority DESC, ready_at, id)
    WHERE status IN ('PENDING', 'RETRYING') AND model IS NOT NULL;
