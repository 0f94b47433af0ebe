-- kiln schema v24: the tasks that have a webhook, indexed on their own (a partial index:
-- a task without one costs it nothing). The webhook outbox follows the event log for
-- their events; while no task has a webhook, it moves its cursor to the log's end
-- without reading the events (kiln/store/outbox.py).
CREATE INDEX tasks_hooked ON tasks (id) WHERE webhook IS NOT NULL;
