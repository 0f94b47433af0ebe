-- kiln schema v19: the outputs of successful tasks, by tenant and sha256, so that a
-- submission may name one as an input by its content hash ("sha256:<hex>",
-- docs/uploads.md) and the store finds it through an index instead of reading results.
-- A row per output of a SUCCESS task; written by the database when a task becomes
-- SUCCESS with a result (every path: a worker's upload step, an approval, a recovery, the
-- one-statement steps over arrays), and deleted when it leaves SUCCESS (a lost result
-- run again: its old objects are gone) or is deleted. A task without outputs
-- ('{"outputs":[]}', as the store writes it) costs the comparison in WHEN: the function is
-- not called.
CREATE TABLE task_outputs (
    tenant       text NOT NULL,
    sha256       text NOT NULL,
    task_id      text NOT NULL,
    name         text NOT NULL,
    key          text NOT NULL,
    content_type text NOT NULL,
    size         bigint NOT NULL,
    PRIMARY KEY (tenant, sha256, task_id, name)
);
CREATE INDEX task_outputs_task ON task_outputs (task_id);

CREATE FUNCTION kiln_task_outputs_success() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO task_outputs (tenant, sha256, task_id, name, key, content_type, size)
        SELECT NEW.tenant, item->>'sha256', NEW.id, item->>'name', item->>'key',
               coalesce(item->>'content_type', ''), coalesce((item->>'size')::bigint, 0)
        FROM jsonb_array_elements(coalesce(NEW.result::jsonb->'outputs', '[]'::jsonb)) AS item
        WHERE item->>'sha256' IS NOT NULL AND item->>'name' IS NOT NULL
          AND item->>'key' IS NOT NULL
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END;
$$;

CREATE FUNCTION kiln_task_outputs_gone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM task_outputs WHERE task_id = OLD.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER task_outputs_success AFTER UPDATE OF status ON tasks FOR EACH ROW
    WHEN (NEW.status = 'SUCCESS' AND OLD.status <> 'SUCCESS' AND NEW.result IS NOT NULL
          AND NEW.result <> '{"outputs":[]}')
    EXECUTE FUNCTION kiln_task_outputs_success();

CREATE TRIGGER task_outputs_gone AFTER DELETE ON tasks FOR EACH ROW
    EXECUTE FUNCTION kiln_task_outputs_gone();

CREATE TRIGGER task_outputs_left AFTER UPDATE OF status ON tasks FOR EACH ROW
    WHEN (OLD.status = 'SUCCESS' AND NEW.status <> 'SUCCESS')
    EXECUTE FUNCTION kiln_task_outputs_gone();

-- The outputs of the SUCCESS tasks that exist now.
INSERT INTO task_outputs (tenant, sha256, task_id, name, key, content_type, size)
    SELECT tasks.tenant, item->>'sha256', tasks.id, item->>'name', item->>'key',
           coalesce(item->>'content_type', ''), coalesce((item->>'size')::bigint, 0)
    FROM tasks,
         jsonb_array_elements(coalesce(tasks.result::jsonb->'outputs', '[]'::jsonb)) AS item
    WHERE tasks.status = 'SUCCESS' AND tasks.result IS NOT NULL
      AND item->>'sha256' IS NOT NULL AND item->>'name' IS NOT NULL
      AND item->>'key' IS NOT NULL
ON CONFLICT DO NOTHING;
