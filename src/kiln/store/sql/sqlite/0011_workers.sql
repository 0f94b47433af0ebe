-- kiln schema v11: the worker processes, each a row it keeps fresh with its beat
-- (kiln/store/workers.py). A row whose expires_at passed is a worker gone: it is no longer
-- listed, and deleted an hour later.
CREATE TABLE workers (
    id         TEXT PRIMARY KEY,
    host       TEXT NOT NULL,
    pid        INTEGER NOT NULL,
    version    TEXT NOT NULL,
    kinds      TEXT NOT NULL,
    slots      INTEGER NOT NULL,
    running    INTEGER NOT NULL,
    resources  TEXT NOT NULL,
    models     TEXT NOT NULL,
    started_at REAL NOT NULL,
    seen_at    REAL NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX workers_expires ON workers (expires_at);
