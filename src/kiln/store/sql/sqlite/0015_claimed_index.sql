-- kiln schema v15: the claimed tasks by kind, for the autoscaling signals
-- (kiln/store/load.py): only tasks in hand (as many as the workers' slots), so the read
-- and the index stay small whatever the history; covering, the table is not read.
CREATE INDEX tasks_claimed ON tasks (kind, status, ready_at)
    WHERE status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING');
