-- kiln schema v20: kept counts of the queue, so a task's queue position is a few index
-- probes however long its line is (kiln/store/positions.py).
-- queue_counts holds the claimable (PENDING or RETRYING) tasks of each kind and priority,
-- queue_counts_of_tenant the same per tenant (fair turns read a tenant's line). The
-- database keeps them: the triggers below run in the statement that changes a task, so a
-- count commits (or rolls back) with the change it counts, on every path (a submission, a
-- claim, a retry, a cancel, a deadline, a purge). A change that does not move a task into
-- or out of the queue costs the comparison in WHEN and nothing more. Each connection adds
-- to its own shard of a count (its backend pid), so concurrent transactions do not wait
-- on one row; readers sum the shards. Whether a queued task is due (ready_at) or past its
-- deadline moves with the clock, not with a write: the position subtracts those from the
-- count through their own index ranges.
CREATE TABLE queue_counts (
    kind     text NOT NULL,
    priority integer NOT NULL,
    shard    smallint NOT NULL,
    n        bigint NOT NULL,
    PRIMARY KEY (kind, priority, shard)
);

CREATE TABLE queue_counts_of_tenant (
    kind     text NOT NULL,
    tenant   text NOT NULL,
    priority integer NOT NULL,
    shard    smallint NOT NULL,
    n        bigint NOT NULL,
    PRIMARY KEY (kind, tenant, priority, shard)
);

CREATE FUNCTION kiln_queue_count(k text, t text, p integer, delta integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    s smallint := pg_backend_pid() % 8;
BEGIN
    INSERT INTO queue_counts (kind, priority, shard, n) VALUES (k, p, s, delta)
    ON CONFLICT (kind, priority, shard) DO UPDATE SET n = queue_counts.n + delta;
    INSERT INTO queue_counts_of_tenant (kind, tenant, priority, shard, n)
    VALUES (k, t, p, s, delta)
    ON CONFLICT (kind, tenant, priority, shard)
    DO UPDATE SET n = queue_counts_of_tenant.n + delta;
END;
$$;

CREATE FUNCTION kiln_queue_enter() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kiln_queue_count(NEW.kind, NEW.tenant, NEW.priority, 1);
    RETURN NULL;
END;
$$;

CREATE FUNCTION kiln_queue_leave() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kiln_queue_count(OLD.kind, OLD.tenant, OLD.priority, -1);
    RETURN NULL;
END;
$$;

CREATE TRIGGER queue_counts_insert AFTER INSERT ON tasks FOR EACH ROW
    WHEN (NEW.status IN ('PENDING', 'RETRYING'))
    EXECUTE FUNCTION kiln_queue_enter();

CREATE TRIGGER queue_counts_delete AFTER DELETE ON tasks FOR EACH ROW
    WHEN (OLD.status IN ('PENDING', 'RETRYING'))
    EXECUTE FUNCTION kiln_queue_leave();

CREATE TRIGGER queue_counts_leave AFTER UPDATE OF status, kind, tenant, priority ON tasks
    FOR EACH ROW
    WHEN (OLD.status IN ('PENDING', 'RETRYING') AND (NEW.status NOT IN ('PENDING', 'RETRYING')
          OR NEW.kind <> OLD.kind OR NEW.tenant <> OLD.tenant OR NEW.priority <> OLD.priority))
    EXECUTE FUNCTION kiln_queue_leave();

CREATE TRIGGER queue_counts_enter AFTER UPDATE OF status, kind, tenant, priority ON tasks
    FOR EACH ROW
    WHEN (NEW.status IN ('PENDING', 'RETRYING') AND (OLD.status NOT IN ('PENDING', 'RETRYING')
          OR NEW.kind <> OLD.kind OR NEW.tenant <> OLD.tenant OR NEW.priority <> OLD.priority))
    EXECUTE FUNCTION kiln_queue_enter();

-- The queue that exists now.
INSERT INTO queue_counts (kind, priority, shard, n)
    SELECT kind, priority, 0, count(*) FROM tasks WHERE status IN ('PENDING', 'RETRYING')
    GROUP BY kind, priority;
INSERT INTO queue_counts_of_tenant (kind, tenant, priority, shard, n)
    SELECT kind, tenant, priority, 0, count(*) FROM tasks
    WHERE status IN ('PENDING', 'RETRYING') GROUP BY kind, tenant, priority;
