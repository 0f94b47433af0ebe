-- kiln schema v23: kept counts of the queue, so a task's queue position is a few index
-- probes however long its line is (kiln/store/positions.py).
-- queue_counts holds the claimable (PENDING or RETRYING) tasks of each kind and priority,
-- queue_counts_of_tenant the same per tenant (fair turns read a tenant's line). The
-- database keeps them: the triggers below run in the statement that changes a task, so a
-- count commits (or rolls back) with the change it counts, on every path (a submission, a
-- claim, a retry, a cancel, a deadline, a purge). A change that does not move a task into
-- or out of the queue costs the comparison in WHEN and nothing more. Whether a queued
-- task is due (ready_at) or past its deadline moves with the clock, not with a write: the
-- position subtracts those from the count through their own index ranges.
CREATE TABLE queue_counts (
    kind     TEXT NOT NULL,
    priority INTEGER NOT NULL,
    n        INTEGER NOT NULL,
    PRIMARY KEY (kind, priority)
) WITHOUT ROWID;

CREATE TABLE queue_counts_of_tenant (
    kind     TEXT NOT NULL,
    tenant   TEXT NOT NULL,
    priority INTEGER NOT NULL,
    n        INTEGER NOT NULL,
    PRIMARY KEY (kind, tenant, priority)
) WITHOUT ROWID;

CREATE TRIGGER queue_counts_insert AFTER INSERT ON tasks
WHEN new.status IN ('PENDING', 'RETRYING')
BEGIN
    INSERT INTO queue_counts (kind, priority, n) VALUES (new.kind, new.priority, 1)
    ON CONFLICT (kind, priority) DO UPDATE SET n = n + 1;
    INSERT INTO queue_counts_of_tenant (kind, tenant, priority, n)
    VALUES (new.kind, new.tenant, new.priority, 1)
    ON CONFLICT (kind, tenant, priority) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER queue_counts_delete AFTER DELETE ON tasks
WHEN old.status IN ('PENDING', 'RETRYING')
BEGIN
    UPDATE queue_counts SET n = n - 1 WHERE kind = old.kind AND priority = old.priority;
    UPDATE queue_counts_of_tenant SET n = n - 1
    WHERE kind = old.kind AND tenant = old.tenant AND priority = old.priority;
END;

CREATE TRIGGER queue_counts_leave AFTER UPDATE OF status, kind, tenant, priority ON tasks
WHEN old.status IN ('PENDING', 'RETRYING') AND (new.status NOT IN ('PENDING', 'RETRYING')
    OR new.kind <> old.kind OR new.tenant <> old.tenant OR new.priority <> old.priority)
BEGIN
    UPDATE queue_counts SET n = n - 1 WHERE kind = old.kind AND priority = old.priority;
    UPDATE queue_counts_of_tenant SET n = n - 1
    WHERE kind = old.kind AND tenant = old.tenant AND priority = old.priority;
END;

CREATE TRIGGER queue_counts_enter AFTER UPDATE OF status, kind, tenant, priority ON tasks
WHEN new.status IN ('PENDING', 'RETRYING') AND (old.status NOT IN ('PENDING', 'RETRYING')
    OR new.kind <> old.kind OR new.tenant <> old.tenant OR new.priority <> old.priority)
BEGIN
    INSERT INTO queue_counts (kind, priority, n) VALUES (new.kind, new.priority, 1)
    ON CONFLICT (kind, priority) DO UPDATE SET n = n + 1;
    INSERT INTO queue_counts_of_tenant (kind, tenant, priority, n)
    VALUES (new.kind, new.tenant, new.priority, 1)
    ON CONFLICT (kind, tenant, priority) DO UPDATE SET n = n + 1;
END;

-- The queue that exists now.
INSERT INTO queue_counts (kind, priority, n)
    SELECT kind, priority, count(*) FROM tasks WHERE status IN ('PENDING', 'RETRYING')
    GROUP BY kind, priority;
INSERT INTO queue_counts_of_tenant (kind, tenant, priority, n)
    SELECT kind, tenant, priority, count(*) FROM tasks WHERE status IN ('PENDING', 'RETRYING')
    GROUP BY kind, tenant, priority;
