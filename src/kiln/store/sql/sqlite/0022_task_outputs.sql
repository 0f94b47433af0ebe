-- kiln schema v22: the outputs of successful tasks, by tenant and sha256, so that a
-- submission may name one as an input by its content hash ("sha256:<hex>",
-- docs/uploads.md) and the store finds it through an index instead of reading results.
-- A row per output of a SUCCESS task; written by the database when a task becomes
-- SUCCESS with a result (every path: a worker's upload step, an approval, a recovery),
-- and deleted when it leaves SUCCESS (a lost result run again: its old objects are gone)
-- or is deleted. A task without outputs ('{"outputs":[]}', as the store writes
-- it) costs the comparison in WHEN and nothing more.
CREATE TABLE task_outputs (
    tenant       TEXT NOT NULL,
    sha256       TEXT NOT NULL,
    task_id      TEXT NOT NULL,
    name         TEXT NOT NULL,
    key          TEXT NOT NULL,
    content_type TEXT NOT NULL,
    size         INTEGER NOT NULL,
    PRIMARY KEY (tenant, sha256, task_id, name)
) WITHOUT ROWID;
CREATE INDEX task_outputs_task ON task_outputs (task_id);

CREATE TRIGGER task_outputs_success AFTER UPDATE OF status ON tasks
WHEN new.status = 'SUCCESS' AND old.status <> 'SUCCESS' AND new.result IS NOT NULL
     AND new.result <> '{"outputs":[]}'
BEGIN
    INSERT OR IGNORE INTO task_outputs (tenant, sha256, task_id, name, key, content_type, size)
        SELECT new.tenant, json_extract(item.value, '$.sha256'), new.id,
               json_extract(item.value, '$.name'), json_extract(item.value, '$.key'),
               coalesce(json_extract(item.value, '$.content_type'), ''),
               coalesce(json_extract(item.value, '$.size'), 0)
        FROM json_each(new.result, '$.outputs') AS item
        WHERE json_extract(item.value, '$.sha256') IS NOT NULL
          AND json_extract(item.value, '$.name') IS NOT NULL
          AND json_extract(item.value, '$.key') IS NOT NULL;
END;

CREATE TRIGGER task_outputs_gone AFTER DELETE ON tasks
BEGIN
    DELETE FROM task_outputs WHERE task_id = old.id;
END;

CREATE TRIGGER task_outputs_left AFTER UPDATE OF status ON tasks
WHEN old.status = 'SUCCESS' AND new.status <> 'SUCCESS'
BEGIN
    DELETE FROM task_outputs WHERE task_id = old.id;
END;

-- The outputs of the SUCCESS tasks that exist now.
INSERT OR IGNORE INTO task_outputs (tenant, sha256, task_id, name, key, content_type, size)
    SELECT tasks.tenant, json_extract(item.value, '$.sha256'), tasks.id,
           json_extract(item.value, '$.name'), json_extract(item.value, '$.key'),
           coalesce(json_extract(item.value, '$.content_type'), ''),
           coalesce(json_extract(item.value, '$.size'), 0)
    FROM tasks, json_each(tasks.result, '$.outputs') AS item
    WHERE tasks.status = 'SUCCESS' AND tasks.result IS NOT NULL
      AND json_extract(item.value, '$.sha256') IS NOT NULL
      AND json_extract(item.value, '$.name') IS NOT NULL
      AND json_extract(item.value, '$.key') IS NOT NULL;
